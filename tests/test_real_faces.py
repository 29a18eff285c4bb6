"""experiments/real_faces.py's whole code path on a tiny LFW-shaped folder of synthetic faces (the real photos are not
part of the repository): preparation as LFW's protocol asks, training rows, the table and the picture."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import matplotlib.cbook
import numpy as np
import pytest
from PIL import Image
from sklearn.metrics import roc_curve

from dataset import render_faces
from eval import verification
from experiments import real_faces
from gpu_acceptance.runs import load_backbone_strict
from training.config import load_config

TRAIN_PEOPLE, TEST_PEOPLE, PHOTOS = 6, 6, 3


def person(index: int) -> str:
    return f"Person_{chr(ord('A') + index)}"


@pytest.fixture(scope="module")
def lfw(tmp_path_factory) -> Path:
    """LFW's layout: 250x250 JPEGs in images_deepfunneled/<Name>/<Name>_NNNN.jpg, peopleDevTrain.txt and
    pairsDevTest.txt (folds of same-person 'name n1 n2' and different-person 'name1 n1 name2 n2' lines); the raw
    photos in images/<Name>/<Name>_NNNN.jpg: a face the detector finds (Grace Hopper's, which matplotlib ships),
    moved about, and in the first DevTrain person's last photo none."""
    root = tmp_path_factory.mktemp("lfw")
    everyone = range(TRAIN_PEOPLE + TEST_PEOPLE)
    portrait = Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB")
    for index in everyone:
        folder = root / real_faces.IMAGES / person(index)
        folder.mkdir(parents=True)
        (root / real_faces.RAW_IMAGES / person(index)).mkdir(parents=True)
        for number, face in enumerate(render_faces([index] * PHOTOS, range(PHOTOS), seed=7), 1):
            canvas = Image.new("RGB", (250, 250), (90, 90, 90))
            canvas.paste(Image.fromarray(face).resize((130, 130)), (60, 51))  # where MEAN_LANDMARKS frame it
            canvas.save(folder / f"{person(index)}_{number:04d}.jpg", quality=95)
            raw = Image.new("RGB", (150, 150), (90, 90, 90))
            if (index, number) != (0, PHOTOS):
                raw.paste(portrait.resize((110, 129)), (3 * index, 2 * number))
            raw.save(root / real_faces.RAW_IMAGES / person(index) / f"{person(index)}_{number:04d}.jpg", quality=95)
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
                                "one_view", "two_view", "--seeds", "1", "2", "--workers", "1", "--set",
                                "embedding_size=32", "--set", "network_kwargs={'width_mult': 0.0625}"]) == 0
    return work, out.getvalue()


def test_only_devtrain_people_are_packed_and_the_held_out_set_is_pairs_dev_test(lfw, bench_run):
    work, _ = bench_run
    data = work / "lfw_devtrain"
    packed = json.loads((data / "train.rec.preparation.json").read_text())
    assert packed["people"] == [person(index) for index in range(TRAIN_PEOPLE)]
    assert packed["photo_preparation"] == "landmarks"
    _, issame = verification.load_bin(str(data / "lfw_devtest.bin"))
    # pairsDevTest's layout, laid out as pairs.txt's: TEST_PEOPLE folds of one same and one different pair.
    assert issame == [True, False] * TEST_PEOPLE


def test_every_run_trains_the_same_images_under_one_schedule_and_the_table_reports_its_models(bench_run):
    """18 records: 2 steps an epoch of 8 one-view samples, 4 of 4 two-view ones; 48 images asked for (6 steps):
    8 steps, 4 epochs of one view and 2 of two, for both seeds."""
    work, printed = bench_run
    # a folder of its own for the --set values: a run trained with others is never taken for one of these
    runs = work / "runs-64+embedding_size=32+network_kwargs=_width_mult_0.0625"
    table = (runs / "table.txt").read_text()
    assert table in printed
    summary, per_run = table.split("\n\n")
    rows = {fields[0]: fields for fields in (line.split() for line in summary.splitlines()[2:])}
    assert set(rows) == {"one_view", "two_view"}
    data_set = verification.load_bin(str(work / "lfw_devtrain" / "lfw_devtest.bin"))
    accuracies = {}
    for name, views, epochs in (("one_view", 1, 4), ("two_view", 2, 2)):
        for seed in (1, 2):
            log = (runs / f"{name}-seed{seed}" / "training.log").read_text()
            assert f"batch_size={8 // views}," in log and f"num_views={views}," in log
            assert f"num_epoch={epochs}," in log and "8 steps in all" in log
            model = load_backbone_strict(runs / f"{name}-seed{seed}" / "backbone.pth")
            accuracies[name, seed] = verification.test(data_set, model, 8)[2]
            line = next(line.split() for line in per_run.splitlines() if line.split()[:2] == [name, str(seed)])
            assert float(line[2]) == pytest.approx(accuracies[name, seed], abs=5e-5)
        mean = (accuracies[name, 1] + accuracies[name, 2]) / 2
        assert float(rows[name][2]) == pytest.approx(mean, abs=5e-5)
    assert "vs one_view" in summary.splitlines()[1]
    assert re.search(r"(better|worse|can't tell): [+-]\d+\.\dp \[[+-]\d+\.\d, [+-]\d+\.\d\] \(95%\)$",
                     summary.splitlines()[3])
    assert (runs / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_detected_faces_of_the_raw_photos_train_the_same_rows_and_are_judged_against_the_fixed_crop(lfw, bench_run):
    work, _ = bench_run
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert real_faces.main([str(lfw), "--work", str(work), "--prepare", "detect", "--against", "mean_points",
                                "--images", "64", "--batch", "8", "--rows", "one_view", "--seeds", "1", "2",
                                "--workers", "1", "--set", "embedding_size=32", "--set",
                                "network_kwargs={'width_mult': 0.0625}"]) == 0
    printed = out.getvalue()
    data = work / "lfw_devtrain_detect"
    packed = json.loads((data / "train.rec.preparation.json").read_text())
    assert packed["photo_preparation"] == "detect" and packed["people"] == [person(i) for i in range(TRAIN_PEOPLE)]
    assert f"the face detector found no face in {work / 'devtrain_people_images' / person(0)}" in printed
    _, issame = verification.load_bin(str(data / "lfw_devtest.bin"))
    assert issame == [True, False] * TEST_PEOPLE  # every pair kept: the same pairs as the fixed crop's set
    runs = work / "runs-64+prepare=detect+embedding_size=32+network_kwargs=_width_mult_0.0625"
    assert "training finished at global step 8:" in (runs / "one_view-seed2" / "training.log").read_text()
    table = (runs / "table.txt").read_text()
    assert table in printed
    against = table.split("\n\n")[-1].splitlines()
    assert against[0].startswith("--prepare detect against --prepare mean_points, row by row")
    assert re.fullmatch(r"one_view +[\d.]+ +[\d.]+  (better|worse|can't tell): [+-]\d+\.\dp .*", against[2])


def test_rows_whose_epochs_share_no_schedule_near_the_images_asked_for_are_one_error_line(lfw, bench_run):
    """An epoch of 2 and of 4 steps share a schedule every 4 steps: one step asked for would take 4."""
    work, _ = bench_run
    with pytest.raises(SystemExit) as stopped:
        real_faces.main([str(lfw), "--work", str(work), "--images", "8", "--batch", "8", "--rows", "one_view",
                         "two_view"])
    assert str(stopped.value) == ("error: the rows' epochs are 2, 4 steps long, so one schedule for all of them takes "
                                  "4 steps, more than twice the 1 asked for; pass --images 32 or a multiple of it")


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


def test_the_recipe_config_is_the_row_the_bench_measured():
    """configs/lfw_r18_recipe.py trains what the one_view_s32 row trained at 37,888 images: configs/lfw_r18_pair.py
    with the row's values, 128 photos a step, 4 passes over DevTrain's 9,525 photos (LFW's peopleDevTrain.txt)."""
    steps_per_epoch = 9_525 // 128
    assert 4 * steps_per_epoch * 128 == 37_888
    row = [f"{key}={value}" for key, value in real_faces.ROWS["one_view_s32"].items()]
    measured = vars(load_config(real_faces.ROOT / real_faces.CONFIG, [*row, "batch_size=128", "num_epoch=4"]))
    recipe = vars(load_config(real_faces.ROOT / "configs/lfw_r18_recipe.py"))
    # its run folder (named for the file), how often it logs and verifies, where a second view would come from (none)
    assert {key for key in measured if measured[key] != recipe[key]} <= {"output", "frequent", "verbose",
                                                                         "view_source"}
    assert recipe["num_views"] == 1 and recipe["margin_scale"] == 32.0


def test_a_pair_photo_missing_from_the_raw_folder_is_taken_from_the_deep_funneled_one_and_said(tmp_path, capsys):
    lfw = tmp_path / "lfw"
    for folder in (real_faces.IMAGES, real_faces.RAW_IMAGES):
        for name, numbers in (("Ann", (1, 2)), ("Bob", (1,))):
            (lfw / folder / name).mkdir(parents=True)
            for number in numbers:
                if (folder, name, number) != (real_faces.RAW_IMAGES, "Ann", 2):
                    (lfw / folder / name / f"{name}_{number:04d}.jpg").write_bytes(f"{folder}".encode())
    (lfw / "pairsDevTest.txt").write_text("1\nAnn\t1\t2\nAnn\t2\tBob\t1\n")
    linked = real_faces.raw_pair_photos(lfw, tmp_path / "work")
    assert {path.relative_to(linked).as_posix(): path.read_bytes().decode() for path in linked.glob("*/*.jpg")} == {
        "Ann/Ann_0001.jpg": "images", "Ann/Ann_0002.jpg": "images_deepfunneled", "Bob/Bob_0001.jpg": "images"}
    assert capsys.readouterr().out == (f"note: 1 photo(s) of pairsDevTest missing from {lfw / 'images'} (e.g. "
                                       "Ann/Ann_0002.jpg): their deep-funneled copies are used in their place\n")
