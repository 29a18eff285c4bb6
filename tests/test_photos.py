"""One preparation of photos in every tool that reads them (tools.pack_rec, tools.make_bin, tools.inference):
the same photo becomes the same 112x112 face in the packed records, in the .bin set and in inference, for
each of --resize, --crop and --pad and for --landmarks; a stretched aspect ratio is said.

References: PIL's own resize, crop and paste of the photo; for landmarks, the template's points moved by
whole pixels, where the alignment is a plain crop of the photo; embeddings of the reference pixels
computed here with the network loaded by plain load_state_dict.
"""
from __future__ import annotations

import json
import logging
import pickle
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.io import decode_image

from backbones import get_model
from dataset import RecordReader, unpack
from facedata.alignment import ARCFACE_TEMPLATE
from tests.test_pack_tools import exits_with
from tools import inference, make_bin, pack_rec, search

NAMES = ("ann", "bob", "cyd")
PORTRAIT = (92, 112)  # width, height: the AT&T/ORL faces a newcomer tried
SHIFT = (9, 23)  # x, y: the landmark photo's face sits here, so its alignment is a crop


def smooth_photo(size: tuple[int, int], seed: int) -> Image.Image:
    """Smooth content (resampling differences stay small) that differs between photos and between halves."""
    width, height = size
    yy, xx = np.mgrid[0:height, 0:width]
    phase = np.random.default_rng(seed).uniform(0, 6, 3)
    pixels = np.stack([127 + 120 * np.sin(xx / 9 + yy / 23 + p) for p in phase], -1)
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """3 identities x 2 portrait PNGs (92x112)."""
    root = tmp_path_factory.mktemp("photos")
    for identity, name in enumerate(NAMES):
        (root / name).mkdir()
        for number in range(2):
            smooth_photo(PORTRAIT, 10 * identity + number).save(root / name / f"{number}.png")
    return root


@pytest.fixture(scope="module")
def landmark_photos(tmp_path_factory):
    """3 identities x 2 larger photos, and a landmarks file giving each the ArcFace template moved by SHIFT."""
    root = tmp_path_factory.mktemp("landmark_photos")
    lines = []
    for identity, name in enumerate(NAMES):
        (root / name).mkdir()
        for number in range(2):
            smooth_photo((140, 150), 10 * identity + number).save(root / name / f"{number}.png")
            points = " ".join(f"{value:g}" for value in (ARCFACE_TEMPLATE + SHIFT).ravel())
            lines.append(f"{name}/{number}.png {points} 0.99")  # a detector's score after the ten numbers
    (root / "landmarks.txt").write_text("\n".join(lines) + "\n")
    return root


def reference_face(path, fit: str) -> np.ndarray:
    """The 112x112 face of `path`, made with PIL's own operations."""
    image = Image.open(path).convert("RGB")
    if fit == "landmarks":
        x, y = SHIFT
        return np.asarray(image)[y:y + 112, x:x + 112]
    if fit == "resize":
        return np.asarray(image.resize((112, 112), Image.BILINEAR))
    if fit == "crop":
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        return np.asarray(image.crop((left, top, left + side, top + side)).resize((112, 112), Image.BILINEAR))
    canvas = Image.new("RGB", (112, 112))
    canvas.paste(image, ((112 - image.width) // 2, (112 - image.height) // 2))  # pad: smaller photos keep their size
    return np.asarray(canvas)


def decoded(payload: bytes) -> np.ndarray:
    return decode_image(torch.frombuffer(bytearray(payload), dtype=torch.uint8)).permute(1, 2, 0).numpy()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A run folder as train.py writes it: a tiny r18's backbone.pth and model.json."""
    folder = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    torch.save(get_model("r18", num_features=32, width_mult=0.0625).state_dict(), folder / "backbone.pth")
    (folder / "model.json").write_text(json.dumps({"network": "r18", "network_kwargs": {"width_mult": 0.0625},
                                                   "embedding_size": 32, "num_classes": 3}))
    return folder


def reference_embedding(folder, pixels: np.ndarray) -> np.ndarray:
    model = get_model("r18", num_features=32, width_mult=0.0625)
    model.load_state_dict(torch.load(folder / "backbone.pth", weights_only=True))
    image = torch.from_numpy(pixels.astype(np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
    with torch.no_grad():
        model.eval()
        return F.normalize(model(image) + model(image.flip(3)), dim=1)[0].numpy()


@pytest.mark.parametrize("fit", ["resize", "crop", "pad", "landmarks"])
def test_a_photo_becomes_the_same_face_in_records_bin_sets_and_inference(
        fit, photos, landmark_photos, model_folder, tmp_path, capsys):
    root = landmark_photos if fit == "landmarks" else photos
    option = ["--landmarks", str(root / "landmarks.txt")] if fit == "landmarks" else [f"--{fit}"]
    first = root / "ann" / "0.png"
    want = {path: reference_face(path, fit) for path in sorted(root.glob("*/*.png"))}

    assert pack_rec.main([str(root), str(tmp_path / "rec"), "--format", "png", "--workers", "1", *option]) == 0
    reader = RecordReader(str(tmp_path / "rec" / "train.idx"), str(tmp_path / "rec" / "train.rec"))
    for key, path in enumerate(want, 1):  # one view per record, in name order: PNG, so exactly
        assert np.array_equal(decoded(unpack(reader.read(key))[1]), want[path]), path

    assert make_bin.main([str(root), str(tmp_path / "set.bin"), "--random", "2", "--seed", "0", *option]) == 0
    bins, _ = pickle.loads((tmp_path / "set.bin").read_bytes())
    for payload in bins:  # every stored face is one photo's reference face, exactly (PNG in, PNG out)
        face = decoded(payload)
        assert any(np.array_equal(face, reference) for reference in want.values())

    if fit == "landmarks":  # inference names a photo as given on its command line
        (tmp_path / "points.txt").write_text((root / "landmarks.txt").read_text().replace("ann/0.png", str(first)))
        option = ["--landmarks", str(tmp_path / "points.txt")]
    saved = tmp_path / "ann.npy"
    assert inference.main([str(first), "--model", str(model_folder), "--save", str(saved), *option]) == 0
    np.testing.assert_allclose(np.load(saved), reference_embedding(model_folder, want[first]), atol=1e-5)
    capsys.readouterr()


def test_stretching_is_said_once_per_tool_and_only_by_resize(photos, model_folder, tmp_path, capsys, caplog):
    assert pack_rec.main([str(photos), str(tmp_path / "rec"), "--workers", "1"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert said == [f"warning: 6 of 6 photos are not square (e.g. {photos / 'ann' / '0.png'}, 92x112): --resize "
                    "stretched them to 112x112, changing their aspect ratio; --crop or --pad keeps it. Prepare "
                    "training, .bin and inference photos with the same option"]
    assert make_bin.main([str(photos), str(tmp_path / "set.bin"), "--random", "2"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(said) == 1 and re.match(r"warning: (\d) of \1 photos are not square", said[0])  # those in pairs
    with caplog.at_level(logging.WARNING):
        assert inference.main([str(photos / "ann" / "0.png"), "--model", str(model_folder)]) == 0
    assert "1 of 1 photos are not square" in caplog.text
    caplog.clear()
    for fit in ("--crop", "--pad"):
        assert pack_rec.main([str(photos), str(tmp_path / fit), "--workers", "1", fit]) == 0
        assert make_bin.main([str(photos), str(tmp_path / f"{fit}.bin"), "--random", "2", fit]) == 0
        assert inference.main([str(photos / "ann" / "0.png"), "--model", str(model_folder), fit]) == 0
        assert "warning" not in capsys.readouterr().err and not caplog.text


def test_a_bad_landmarks_file_and_a_relative_missing_folder_are_one_sentence(photos, tmp_path, capsys, monkeypatch):
    points = tmp_path / "points.txt"
    points.write_text("ann/0.png 1 2 3\n")
    assert f"{points} line 1 is not 'PHOTO x1 y1 x2 y2 x3 y3 x4 y4 x5 y5'" in exits_with(
        capsys, make_bin.main, [str(photos), str(tmp_path / "x.bin"), "--random", "1", "--landmarks", str(points)])
    points.write_text("ann/0.png 38 52 74 52 56 72 42 92 71 92\n")
    assert (f"{photos / 'ann' / '1.png'} has no line in landmarks file {points}; add its five points ('ann/1.png x1 y1 "
            "... x5 y5') or leave the photo out") in exits_with(
        capsys, pack_rec.main, [str(photos), str(tmp_path / "rec"), "--landmarks", str(points), "--workers", "1"])
    assert not (tmp_path / "rec" / "train.rec").exists()
    points.write_text("ann/0.png 5 5 5 5 5 5 5 5 5 5\n")  # five points on one: no similarity maps them apart
    assert (f"{photos / 'ann' / '0.png'} cannot be aligned by its line in landmarks file {points} (the landmarks all "
            "sit on one point; a face needs five distinct landmarks); fix that line") in exits_with(
        capsys, pack_rec.main, [str(photos), str(tmp_path / "rec"), "--landmarks", str(points), "--workers", "1"])
    monkeypatch.chdir(tmp_path)
    assert f"image folder faces (looked up from {tmp_path}) does not exist" in exits_with(
        capsys, make_bin.main, ["faces", "x.bin", "--random", "1"])
    assert f"input folder faces (looked up from {tmp_path}) does not exist" in exits_with(
        capsys, pack_rec.main, ["faces", "rec"])


@pytest.mark.parametrize(("tool", "default"), [
    (inference, "the default when the model's model.json records no option; when it records one, that one is the "
                "default"),
    (search, "the default when the model's model.json records no option; when it records one, that one is the "
             "default"),
    (make_bin, "the default when the train.rec.preparation.json beside the .bin records no option; when it records "
               "one, that one is the default"),
    (pack_rec, "default; warns")])
def test_help_says_where_the_default_preparation_comes_from_and_names_every_tool_sharing_it(tool, default, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert default in text
    assert "the same options in tools.pack_rec, tools.make_bin, tools.inference and tools.search" in text
