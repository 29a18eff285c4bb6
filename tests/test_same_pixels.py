"""The preparation check compares the faces a model sees, not the option's name (issue 54, item 3): on square
photos --crop and --resize give the same pixels, and neither eval.verification nor training warns about them;
where the faces do differ, both warn alike and record no threshold of that set, and fine-tuning warns when its
records are prepared unlike the backbone's training photos.

References: the pixels fit_photo gives each fit, compared here (the claim of ``same_pixels_as``); the photos'
shapes written by the test.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from backbones import get_model
from eval import verification
from eval.callback import VerificationCallback
from facedata.photos import FITS, fit_photo, same_pixels_as
from gpu_acceptance.runs import INFO
from tests.run_helpers import run_here
from tests.test_export_inference import trained_like
from tools import make_bin

SIZES = [(250, 250), (250, 200), (200, 250), (112, 112), (80, 80), (300, 120), (60, 90), (113, 112)]


def test_same_pixels_as_names_exactly_the_fits_that_give_a_photo_the_same_pixels():
    rng = np.random.default_rng(0)
    photos = {size: Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for size in SIZES}
    pixels = {(size, fit): fit_photo(photo, fit).pixels for size, photo in photos.items() for fit in FITS}
    for size in SIZES:
        for fit in FITS:
            alike = [other for other in FITS if np.array_equal(pixels[size, other], pixels[size, fit])]
            assert same_pixels_as(fit, [size]) == alike, (size, fit)
    # Over several sizes: the fits alike on every one of them.
    assert same_pixels_as("crop", [(250, 250), (112, 112)]) == ["resize", "crop", "pad"]
    assert same_pixels_as("crop", [(250, 250), (250, 200)]) == ["crop"]
    assert same_pixels_as("resize", [(250, 250), (80, 80)]) == ["resize", "crop"]  # pad does not enlarge


def write_photos(root: Path, size: tuple[int, int]) -> Path:
    """Three people with two photos each, of one size."""
    rng = np.random.default_rng(1)
    for person in ("ann", "bob", "cid"):
        (root / person).mkdir(parents=True)
        for number in range(2):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / person / f"{number}.png")
    return root


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """square.bin and oblong.bin: --crop of 250x250 and of 250x200 photos."""
    folder = tmp_path_factory.mktemp("sets")
    for name, size in (("square", (250, 250)), ("oblong", (250, 200))):
        photos = write_photos(folder / f"{name}_photos", size)
        assert make_bin.main([str(photos), str(folder / f"{name}.bin"), "--random", "3", "--crop"]) == 0
    return folder


@pytest.fixture()
def resize_model(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save(trained_like("r18", 0.25).state_dict(), folder / "backbone.pth")
    (folder / "model.json").write_text(json.dumps({"network": "r18", "network_kwargs": {"width_mult": 0.25},
                                                   "embedding_size": 512, "num_classes": 10,
                                                   "photo_preparation": "resize"}))
    return folder


def test_make_bin_records_the_fits_that_give_its_photos_the_same_pixels(sets):
    for name, alike in (("square", ["resize", "crop", "pad"]), ("oblong", ["crop"])):
        record = json.loads((sets / f"{name}.bin.preparation.json").read_text())
        assert record["photo_preparation"] == "crop" and record["same_pixels_as"] == alike


def test_eval_does_not_warn_of_crop_on_square_photos_for_a_resize_model_and_records_its_threshold(
        sets, resize_model, capsys):
    square = sets / "square.bin"
    assert verification.main(["--model", str(resize_model), "--bins", str(square), "--batch-size", "8"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err + captured.out
    assert (f"{square}: photos prepared with --crop, which gives these photos the same pixels as --resize, the "
            f"preparation {resize_model / 'model.json'} records for the model's training photos") in captured.out
    assert "square" in json.loads((resize_model / "model.json").read_text())["verification"]
    # Where the faces differ, the warning stays and no threshold is recorded.
    oblong = sets / "oblong.bin"
    assert verification.main(["--model", str(resize_model), "--bins", str(oblong), "--batch-size", "8"]) == 0
    assert f"warning: {oblong} holds photos prepared with --crop, but" in capsys.readouterr().err
    assert "oblong" not in json.loads((resize_model / "model.json").read_text())["verification"]


def test_training_checks_its_verification_sets_as_eval_does(sets, tmp_path, caplog):
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "train.rec").write_bytes(b"")  # only its preparation record is read here
    (rec / "train.rec.preparation.json").write_text(json.dumps({"photo_preparation": "resize",
                                                                "same_pixels_as": ["resize"]}))
    with caplog.at_level(logging.INFO, logger="eval.callback"):
        callback = VerificationCallback(1, [str(sets / "square.bin"), str(sets / "oblong.bin")], str(rec),
                                        batch_size=8)
    said = [record.getMessage() for record in caplog.records]
    where = rec / "train.rec.preparation.json"
    assert (f"{sets / 'square.bin'}: photos prepared with --crop, which gives these photos the same pixels as "
            f"--resize, the preparation {where} records for the model's training photos") in said
    warned = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith(f"{sets / 'oblong.bin'} holds photos prepared with --crop, but "
                                                     f"{where} records --resize")
    assert warned[0].endswith("; model.json records no threshold of it")
    callback.evaluate_now(trained_like("r18", 0.25), 1)
    assert set(callback.operating_points) == {"square"}


def test_fine_tuning_warns_when_its_records_give_the_backbone_other_faces(data, tmp_path):
    records = Path(shutil.copytree(data, tmp_path / "data"))
    (records / "train.rec.preparation.json").write_text(json.dumps({"photo_preparation": "resize",
                                                                    "same_pixels_as": ["resize"]}))
    backbone = tmp_path / "trained"
    backbone.mkdir()
    torch.save(get_model(INFO["network"], num_features=INFO["embedding_size"], **INFO["network_kwargs"]).state_dict(),
               backbone / "backbone.pth")
    (backbone / "model.json").write_text(json.dumps({**INFO, "photo_preparation": "pad"}))
    assert run_here(records, tmp_path / "out", f"resume={backbone / 'backbone.pth'}", "max_steps=1",
                    "val_targets=()")[0] == 0
    log = (tmp_path / "out" / "training.log").read_text()
    assert (f"{records / 'train.rec'} holds photos prepared with --resize, but {backbone / 'model.json'} records --pad "
            "for the model's training photos, and on these photos the two give different faces, so fine-tuning shows "
            "the backbone faces unlike those it learned from; make it again with tools.pack_rec --pad") in log
