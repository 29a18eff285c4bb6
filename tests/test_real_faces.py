"""bench/real_faces.py's whole code path on a tiny LFW-shaped folder of synthetic faces (the real photos are not
part of the repository): preparation as LFW's protocol asks, training rows, the table and the picture."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.metrics import roc_curve

from bench import real_faces
from eval import verification
from facedata.synthetic import render_faces
from tests.run_helpers import load_backbone_strict

TRAIN_PEOPLE, TEST_PEOPLE, PHOTOS = 6, 6, 3


def person(index: int) -> str:
    return f"Person_{chr(ord('A') + index)}"


@pytest.fixture(scope="module")
def lfw(tmp_path_factory) -> Path:
    """LFW's layout: 250x250 JPEGs in images_deepfunneled/<Name>/<Name>_NNNN.jpg, peopleDevTrain.txt and
    pairsDevTest.txt (folds of same-person 'name n1 n2' and different-person 'name1 n1 name2 n2' lines)."""
    root = tmp_path_factory.mktemp("lfw")
    everyone = range(TRAIN_PEOPLE + TEST_PEOPLE)
    for index in everyone:
        folder = root / real_faces.IMAGES / person(index)
        folder.mkdir(parents=True)
        for number, face in enumerate(render_faces([index] * PHOTOS, range(PHOTOS), seed=7), 1):
            canvas = Image.new("RGB", (250, 250), (90, 90, 90))
            canvas.paste(Image.fromarray(face).resize((130, 130)), (60, 51))  # where MEAN_LANDMARKS frame it
            canvas.save(folder / f"{person(index)}_{number:04d}.jpg", quality=95)
    (root / "peopleDevTrain.txt").write_text(f"{TRAIN_PEOPLE}\n" + "".join(
        f"{person(index)}\t{PHOTOS}\n" for index in range(TRAIN_PEOPLE)))
    tested = [person(TRAIN_PEOPLE + index) for index in range(TEST_PEOPLE)]
    same = [f"{name}\t1\t{2 + index % 2}\n" for index, name in enumerate(tested)]
    different = [f"{tested[index]}\t1\t{tested[(index + 1) % TEST_PEOPLE]}\t2\n" for index in range(TEST_PEOPLE)]
    (root / "pairsDevTest.txt").write_text(f"{TEST_PEOPLE}\n" + "".join(same + different))
    return root


@pytest.fixture(scope="module")
def bench_run(lfw, tmp_path_factory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("work")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert real_faces.main([str(lfw), "--work", str(work), "--images", "48", "--batch", "8", "--rows",
                                "one_view", "two_view", "--workers", "1", "--set", "embedding_size=32",
                                "--set", "network_kwargs={'width_mult': 0.0625}"]) == 0
    return work, out.getvalue()


def test_only_devtrain_people_are_packed_and_the_held_out_set_is_pairs_dev_test(lfw, bench_run):
    work, _ = bench_run
    data = work / "lfw_devtrain"
    packed = json.loads((data / "train.rec.preparation.json").read_text())
    assert packed["people"] == [person(index) for index in range(TRAIN_PEOPLE)]
    assert packed["photo_preparation"] == "landmarks"
    _, issame = verification.load_bin(str(data / "lfw_devtest.bin"))
    assert issame == [True] * TEST_PEOPLE + [False] * TEST_PEOPLE  # the file's pairs, in its order


def test_every_row_trains_the_same_images_and_the_table_reports_what_its_models_score(bench_run):
    work, printed = bench_run
    runs = work / "runs-48"
    table = (runs / "table.txt").read_text()
    assert table in printed
    rows = {fields[0]: fields for fields in (line.split() for line in table.splitlines()[2:])}
    assert set(rows) == {"one_view", "two_view"}
    for name, views in (("one_view", 1), ("two_view", 2)):
        log = (runs / f"{name}-seed2048" / "training.log").read_text()
        assert f"batch_size={8 // views}," in log and f"num_views={views}," in log
        assert re.search(r"6 steps in all|Global Step: 6\b", log), "48 images of 8 a step: 6 steps"
        for column, folder in ((2, runs / f"{name}-seed2048" / "best"), (6, runs / f"{name}-seed2048")):
            data_set = verification.load_bin(str(work / "lfw_devtrain" / "lfw_devtest.bin"))
            accuracy = verification.test(data_set, load_backbone_strict(folder / "backbone.pth"), 8)[2]
            assert float(rows[name][column]) == pytest.approx(accuracy, abs=5e-5)
    assert "vs one_view" in table.splitlines()[1] and "spread" in rows["two_view"][-1]
    assert (runs / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tar_at_far_equals_the_roc_curve_s_operating_point():
    rng = np.random.default_rng(0)
    issame = rng.random(400) < 0.5
    fused = rng.normal(size=(800, 16))
    fused[1::2][issame] = fused[0::2][issame] + rng.normal(scale=0.8, size=(int(issame.sum()), 16))
    fused /= np.linalg.norm(fused, axis=1, keepdims=True)
    similarity = np.sum(fused[0::2] * fused[1::2], axis=1)
    for far in (0.01, 0.05, 0.2):
        fpr, tpr, _ = roc_curve(issame, similarity)
        assert real_faces.tar_at_far(fused, issame, far) == pytest.approx(tpr[fpr <= far].max())


def test_a_folder_that_is_not_lfw_is_one_error_line(tmp_path):
    with pytest.raises(SystemExit) as stopped:
        real_faces.main([str(tmp_path), "--work", str(tmp_path / "work")])
    assert str(stopped.value).startswith(f"error: {tmp_path} is not an LFW folder: missing ")
    assert "\n" not in str(stopped.value)
