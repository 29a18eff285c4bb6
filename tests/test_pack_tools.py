"""tools/pack_rec.py and tools/make_synthetic.py, run end to end and read back."""
from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import decode_jpeg

from dataset import RecordReader, build_dataset, recorded_preparation, unpack
from tests.run_helpers import start_command
from tools import demo, make_synthetic, pack_rec

# (size, PIL mode, file suffix) per image: mixed sizes, grayscale, alpha and palette images.
IMAGE_KINDS = [((130, 150), "RGB", ".jpg"), ((80, 60), "L", ".png"), ((112, 112), "RGBA", ".png"),
               ((200, 100), "RGB", ".png"), ((90, 90), "P", ".png"), ((64, 128), "L", ".jpg")]


@pytest.fixture(scope="module")
def faces(tmp_path_factory):
    """person_a: 5 images, person_b: 3, person_c: 1 (too few for V >= 2), person_d: 4."""
    root = tmp_path_factory.mktemp("faces")
    rng = np.random.default_rng(0)
    for name, count in [("person_a", 5), ("person_b", 3), ("person_c", 1), ("person_d", 4)]:
        (root / name).mkdir()
        for i in range(count):
            (width, height), mode, suffix = IMAGE_KINDS[(i + len(name) + count) % len(IMAGE_KINDS)]
            # Smooth content, so JPEG and resampling differences stay small.
            yy, xx = np.mgrid[0:height, 0:width]
            pixels = np.stack([(xx * 255 // width), (yy * 255 // height), np.full_like(xx, rng.integers(256))], -1)
            image = Image.fromarray(pixels.astype(np.uint8))
            if mode == "P":
                image = image.convert("P", palette=Image.Palette.ADAPTIVE, dither=Image.Dither.NONE)
            else:
                image = image.convert(mode)
            image.save(root / name / f"img{i}{suffix}")
    (root / "notes.txt").write_text("not an identity")
    return root


def reference_view(path, mode: str) -> np.ndarray:
    """The 112x112 RGB a view must hold, computed straight with PIL."""
    image = Image.open(path).convert("RGB")
    if mode == "resize":
        return np.asarray(image.resize((112, 112), Image.BILINEAR))
    scale = min(1.0, 112 / max(image.size))
    if scale < 1:
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BILINEAR)
    canvas = np.zeros((112, 112, 3), np.uint8)
    top, left = (112 - image.height) // 2, (112 - image.width) // 2
    canvas[top:top + image.height, left:left + image.width] = np.asarray(image)
    return canvas


def expected_records(root, views: int) -> list[tuple[list[str], int]]:
    """(image paths side by side, label) per record, in key order."""
    records, label = [], 0
    for name in sorted(p for p in os.listdir(root) if os.path.isdir(root / p)):
        paths = sorted(str(root / name / f) for f in os.listdir(root / name))
        if len(paths) < views:
            continue
        for start in range(0, len(paths), views):
            group = paths[start:start + views]
            records.append((group + paths[:views - len(group)], label))
        label += 1
    return records


@pytest.mark.parametrize("views", [1, 2, 3])
def test_pack_read_round_trip_lossless(faces, tmp_path, views):
    assert pack_rec.main([str(faces), str(tmp_path), "--views", str(views), "--format", "png", "--workers", "1"]) == 0
    ds = build_dataset(str(tmp_path), num_views=views, flip=False)
    expected = expected_records(faces, views)
    assert len(ds) == len(expected) and ds.num_classes == 1 + expected[-1][1]
    for index, (paths, label) in enumerate(expected):
        images, got_label = ds[index]
        assert int(got_label) == label
        for view, path in zip(images, paths):
            assert np.array_equal(view.permute(1, 2, 0).numpy(), reference_view(path, "resize")), path
        assert len(set(paths)) == views  # V different images of the identity


def test_pack_writes_insightface_identity_table(faces, tmp_path):
    pack_rec.main([str(faces), str(tmp_path), "--views", "2", "--workers", "1"])
    reader = RecordReader(str(tmp_path / "train.idx"), str(tmp_path / "train.rec"))
    header = unpack(reader.read(0))[0]
    first_identity, end = header.label.astype(int).tolist()
    assert header.flag == 2 and first_identity == 1 + len(expected_records(faces, 2)) and end == first_identity + 3
    image_keys = []
    for label, key in enumerate(range(first_identity, end)):
        start, stop = unpack(reader.read(key))[0].label.astype(int).tolist()
        for image_key in range(start, stop):
            assert unpack(reader.read(image_key))[0].label == label
        image_keys += range(start, stop)
    assert image_keys == list(range(1, first_identity))


def test_pack_jpeg_default_and_pad(faces, tmp_path):
    for fit in ("resize", "pad"):
        out = tmp_path / fit
        assert pack_rec.main([str(faces), str(out), f"--{fit}", "--workers", "1"]) == 0
        reader = RecordReader(str(out / "train.idx"), str(out / "train.rec"))
        for key, (paths, _) in enumerate(expected_records(faces, 1), 1):
            payload = unpack(reader.read(key))[1]
            assert payload[:2] == b"\xff\xd8"  # JPEG
            pixels = decode_jpeg(torch.frombuffer(bytearray(payload), dtype=torch.uint8)).permute(1, 2, 0).numpy()
            reference = reference_view(paths[0], fit)
            assert np.abs(pixels.astype(int) - reference).mean() < 3, paths[0]
            if fit == "pad" and Image.open(paths[0]).size == (80, 60):
                assert pixels[:20].max() < 10 and pixels[:, :10].max() < 10  # black borders


def test_pack_leaves_out_identities_with_too_few_images(faces, tmp_path, capsys):
    assert pack_rec.main([str(faces), str(tmp_path), "--views", "4", "--workers", "1"]) == 0
    assert "left out 2 identities with fewer than 4 images: person_b, person_c" in capsys.readouterr().out
    assert build_dataset(str(tmp_path), num_views=4).num_classes == 2


def exits_with(capsys, main, argv) -> str:
    """``main(argv)`` ends with status 1 and one ``error: ...`` line (no traceback); returns it."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 1 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_pack_refuses_bad_images_and_existing_output(faces, tmp_path, capsys):
    broken = tmp_path / "broken"
    (broken / "x").mkdir(parents=True)
    Image.new("RGB", (100, 100)).save(broken / "x" / "fine.png")
    (broken / "x" / "zz_bad.jpg").write_bytes(b"\xff\xd8 truncated")
    out = tmp_path / "out"
    message = exits_with(capsys, pack_rec.main, [str(broken), str(out), "--workers", "1"])
    assert message.startswith("error: cannot read image ") and "zz_bad.jpg" in message
    assert not (out / "train.rec").exists() and not (out / "train.idx").exists()  # nothing half-written

    assert pack_rec.main([str(faces), str(out), "--workers", "1"]) == 0
    assert "already holds train.rec, train.idx; choose another output folder or pass --overwrite" in exits_with(
        capsys, pack_rec.main, [str(faces), str(out), "--workers", "1"])
    assert pack_rec.main([str(faces), str(out), "--workers", "1", "--force"]) == 0
    assert "missing does not exist" in exits_with(capsys, pack_rec.main, [str(tmp_path / "missing"),
                                                                          str(tmp_path / "o2")])
    assert "--views 0 is not a positive number" in exits_with(capsys, pack_rec.main, [str(faces), str(tmp_path),
                                                                                      "--views", "0"])


def test_pack_takes_every_photo_format_pillow_decodes(tmp_path):
    """Portable graymaps (an old face set's format) and GIFs, as tools.inference reads them."""
    photos = tmp_path / "photos"
    paths = []
    for person, suffix in (("anna", ".pgm"), ("bo", ".gif"), ("cy", ".ppm")):
        (photos / person).mkdir(parents=True)
        yy, xx = np.mgrid[0:96, 0:80]
        pixels = ((xx * 3 + yy * 2 + len(person) * 40) % 256).astype(np.uint8)
        image = Image.fromarray(pixels) if suffix != ".ppm" else Image.fromarray(np.stack([pixels] * 3, -1))
        image.save(photos / person / f"0{suffix}")
        paths.append(photos / person / f"0{suffix}")
    assert pack_rec.main([str(photos), str(tmp_path / "data"), "--format", "png", "--workers", "1"]) == 0
    dataset = build_dataset(str(tmp_path / "data"), num_views=1, flip=False)
    assert len(dataset) == 3
    for index, path in enumerate(paths):
        images, label = dataset[index]
        assert int(label) == index
        assert np.array_equal(images[0].permute(1, 2, 0).numpy(), reference_view(path, "resize")), path


def test_pack_shows_its_progress_on_stderr(faces, tmp_path, capsys):
    assert pack_rec.main([str(faces), str(tmp_path), "--workers", "1"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: ")]
    # 4 identities: a line at each of 25, 50, 75 and 100%, rounded down to its tenth.
    assert [line.split(" (")[0] for line in lines] == [f"packing identities: {p}%" for p in (20, 50, 70, 100)]


def test_make_synthetic_writes_train_rec_and_val_bin(tmp_path, capsys):
    args = ["--output", str(tmp_path), "--identities", "12", "--images-per-identity", "5", "--views", "2",
            "--val-identities", "6", "--val-pairs", "20", "--workers", "1", "--seed", "3"]
    assert make_synthetic.main(args) == 0
    ds = build_dataset(str(tmp_path), num_views=2, num_classes=12)
    assert len(ds) == 12 * 2 and ds[0][0].shape == (2, 3, 112, 112)
    assert sorted(set(int(ds[i][1]) for i in range(len(ds)))) == list(range(12))
    with open(tmp_path / "synthetic_val.bin", "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    assert len(bins) == 40 and len(issame) == 20 and sum(issame) == 10
    assert all(isinstance(b, bytes) and b[:2] == b"\xff\xd8" for b in bins)
    assert decode_jpeg(torch.frombuffer(bytearray(bins[0]), dtype=torch.uint8)).shape == (3, 112, 112)
    # Never overwrites silently.
    assert "already holds" in exits_with(capsys, make_synthetic.main, args)
    assert "--val-pairs 3" in exits_with(capsys, make_synthetic.main, [*args, "--val-pairs", "3"])


def test_pack_records_its_preparation_beside_the_records_and_lists_folders_without_images(tmp_path, capsys):
    photos = tmp_path / "photos"
    for name in ("anna", "bo"):
        (photos / name).mkdir(parents=True)
        for number in range(2):
            Image.new("RGB", (92, 112), (40 * number, 90, 200)).save(photos / name / f"{number}.png")
    (photos / "cy").mkdir()  # an empty person folder
    (photos / "dee").mkdir()
    (photos / "dee" / "notes.txt").write_text("no photo here")
    assert pack_rec.main([str(photos), str(tmp_path / "data"), "--crop", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert (f"skipped 2 sub-folder(s) of {photos} without images (a format Pillow reads: .jpg, .png, "
            ".webp, .bmp, .tif, .pgm, ...): cy, dee") in out.splitlines()
    assert "2 identities (classes 0..1), crop to 112x112" in out
    assert json.loads((tmp_path / "data" / "train.rec.preparation.json").read_text()) == {
        "photo_preparation": "crop", "landmarks_file": None, "written_by": "tools.pack_rec", "people": ["anna", "bo"],
        "same_pixels_as": ["crop"]}  # of a 92x112 photo, stretching or padding the whole differs from its square


def ctrl_c_once_it_says(arguments: list[str], console: Path, text: str) -> tuple[int, str]:
    """`python ARGUMENTS` in a process group of its own, as a terminal's foreground job; Ctrl-C (SIGINT to the
    whole group, its worker processes too) once its output shows `text`: (exit status, its output)."""
    command = start_command([sys.executable, *arguments], own_group=True, output=console)
    deadline = time.monotonic() + 300
    while text not in console.read_text():
        assert command.poll() is None and time.monotonic() < deadline, console.read_text()
        time.sleep(0.01)
    os.killpg(command.pid, signal.SIGINT)
    return command.wait(120), console.read_text()


def assert_stopped_by_ctrl_c(status: int, output: str) -> None:
    assert status == 130 and "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.splitlines()[-1] == "stopped by Ctrl-C" and output.count("stopped by Ctrl-C") == 1, output[-3000:]


def test_the_demos_data_records_its_preparation_as_the_photo_tools_record_theirs(tmp_path, capsys):
    """Issue 58: the demo's model.json said nothing of how its photos were prepared. Its data, made now or by an
    earlier demo: 112x112 faces, which every fit leaves as drawn, and a verification set of identities none of
    which is trained on."""
    assert make_synthetic.main(["--output", str(tmp_path), "--identities", "4", "--images-per-identity", "2",
                                "--val-identities", "2", "--val-pairs", "2", "--workers", "1"]) == 0
    assert not (tmp_path / "train.rec.preparation.json").exists()  # the tool alone: data as if packed elsewhere
    demo.ensure_data(tmp_path)
    assert f"demo: using the synthetic data in {tmp_path}" in capsys.readouterr().out
    recorded = {"photo_preparation": "resize", "landmarks_file": None, "written_by": "tools.make_synthetic",
                "same_pixels_as": ["resize", "crop", "pad"]}
    assert json.loads((tmp_path / "train.rec.preparation.json").read_text()) == recorded
    assert json.loads((tmp_path / "synthetic_val.bin.preparation.json").read_text()) == {
        **recorded, "people_in_training": 0}
    assert recorded_preparation(str(tmp_path)) == "resize"  # what training carries into model.json


def test_ctrl_c_stops_pack_rec_and_make_synthetic_in_one_line_leaving_no_output_folder(tmp_path):
    photos = tmp_path / "photos"
    rng = np.random.default_rng(0)
    for person in range(40):
        (photos / f"p{person:02d}").mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(photos / f"p{person:02d}" / "0.png")
    packed = tmp_path / "packed"
    assert_stopped_by_ctrl_c(*ctrl_c_once_it_says(
        ["-m", "tools.pack_rec", str(photos), str(packed), "--workers", "2"], tmp_path / "pack.out",
        "packing identities: 10%"))
    assert not packed.exists()
    drawn = tmp_path / "synthetic"
    assert_stopped_by_ctrl_c(*ctrl_c_once_it_says(
        ["-m", "tools.make_synthetic", "--output", str(drawn), "--identities", "400", "--images-per-identity", "2",
         "--workers", "2"], tmp_path / "synthetic.out", "drawing identities: 10%"))
    assert not drawn.exists()
