"""What a run and its evaluation record say of themselves (issue 54, item 5): the accuracy model.json keeps with a
threshold is named apart from Accuracy-Flip and printed where it is recorded; every checkpoint save is in
training.log; the fine-tuning warm-up notice only while its steps are ahead; a start that fails leaves no empty run
folder behind (and never touches a folder that was there).

References: the accuracy at the best of the distance thresholds 0..4 step 0.01, computed here from the pair scores;
the steps the test asked to be saved; the folders the test made.
"""
from __future__ import annotations

import io
import json
import re

import numpy as np
import torch
from PIL import Image

from backbones import get_model
from eval import verification
from gpu_acceptance.runs import INFO
from tests.run_helpers import run_here
from tests.test_export_inference import trained_like
from tools import make_bin


def test_the_accuracy_recorded_with_a_threshold_is_named_apart_from_accuracy_flip_and_printed(tmp_path, capsys):
    rng = np.random.default_rng(3)
    photos = tmp_path / "photos"
    for person in ("ann", "bob", "cid", "dee"):
        (photos / person).mkdir(parents=True)
        for number in range(3):
            Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(photos / person / f"{number}.png")
    assert make_bin.main([str(photos), str(tmp_path / "val.bin"), "--random", "6"]) == 0
    run = tmp_path / "run"
    run.mkdir()
    torch.save(trained_like("r18", 0.25).state_dict(), run / "backbone.pth")
    (run / "model.json").write_text(json.dumps({"network": "r18", "network_kwargs": {"width_mult": 0.25},
                                                "embedding_size": 512, "num_classes": 10}))
    capsys.readouterr()
    assert verification.main(["--model", str(run), "--bins", str(tmp_path / "val.bin"), "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    point = json.loads((run / "model.json").read_text())["verification"]["val"]
    assert "accuracy" not in point  # one name per accuracy: Accuracy-Flip is the log's and eval's
    # The reference: the first of the squared-distance thresholds with the most pairs right, on every pair.
    scores = np.load(run / "backbone_val_scores.npy").astype(np.float64)
    issame = np.array([True, False] * 6)
    distance = 2 - 2 * scores
    right = [np.mean((distance < t) == issame) for t in np.arange(0, 4, 0.01)]
    assert point["accuracy_at_threshold"] == max(right)
    assert point["threshold"] == 1 - np.arange(0, 4, 0.01)[int(np.argmax(right))] / 2
    assert (f"[val]Accuracy-At-Threshold: {max(right):1.5f} at cosine similarity {point['threshold']:.4f}, chosen on "
            "all 12 pairs (recorded in model.json with it; Accuracy-Flip chooses each fold's threshold on the other "
            "folds)") in out.splitlines()
    assert re.search(r"^\[val\]Accuracy-Flip: [\d.]+\+-[\d.]+$", out, re.MULTILINE)


def test_every_save_is_in_training_log_and_the_terminal_shows_fewer(data, tmp_path):
    terminal = io.StringIO()
    assert run_here(data, tmp_path / "out", "save_every_steps=1", "max_steps=4", "frequent=10",
                    stdout=terminal)[0] == 0
    log = (tmp_path / "out" / "training.log").read_text()
    assert re.findall(r"saved \S+ at global step (\d+)", log) == ["1", "2", "3", "4"]
    assert re.findall(r"saved \S+ at global step (\d+)", terminal.getvalue()) == ["1", "4"]  # first and last


def test_the_warm_up_notice_names_only_the_frozen_steps_still_ahead(data, tmp_path):
    backbone = tmp_path / "trained.pth"
    torch.manual_seed(7)
    torch.save(get_model(INFO["network"], num_features=INFO["embedding_size"], **INFO["network_kwargs"]).state_dict(),
               backbone)
    out = tmp_path / "out"
    notice = re.compile(r"steps (\d+) to (\d+) of the LR schedule train the class centres alone")
    assert run_here(data, out, f"resume={backbone}", "freeze_backbone_steps=3", "max_steps=2")[0] == 0
    assert notice.findall((out / "training.log").read_text()) == [("1", "3")]
    before = len((out / "training.log").read_text())
    assert run_here(data, out, f"resume={backbone}", "freeze_backbone_steps=3", "max_steps=4", resume=True)[0] == 0
    assert notice.findall((out / "training.log").read_text()[before:]) == [("3", "3")]
    before = len((out / "training.log").read_text())
    assert run_here(data, out, f"resume={backbone}", "freeze_backbone_steps=3", "max_steps=5", resume=True)[0] == 0
    assert notice.findall((out / "training.log").read_text()[before:]) == []  # resumed at step 4: behind it


def test_a_start_that_fails_leaves_no_empty_run_folder_and_never_touches_one_that_was_there(data, tmp_path):
    failing = ["gradient_acc=1000"]  # fewer batches per epoch than that: a ConfigError after the folder is locked
    status, err = run_here(data, tmp_path / "new", *failing)
    assert status == 1 and "gradient_acc=1000" in err
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert run_here(data, mine, *failing)[0] == 1
    assert (mine / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_here(data, empty, *failing)[0] == 1
    assert empty.is_dir()  # made before the run: not the run's to remove
