"""What a resume keeps and what it says, through `python train.py` on a config file of the test's own:
the --set values the run was started with survive a resume that does not repeat them; a change that moves
the schedule is a warning naming its effect and the LR follows it; the log and TensorBoard count on across
a renumbering (another batch size) and say what max_steps means; a resume with nothing left to train says
so and why; Accuracy-Highest is the best of the whole run; saves do not crowd the log; the last
verification's threshold is recorded in model.json.

One run in five starts (1 process, 40 two-view records of 20 identities; batch 4: 10 steps per epoch,
batch 8: 5), every step logged and verified on the 20 held-out pairs:
  A  --set num_epoch=40 --set max_steps=3 --set save_every_steps=1    steps 1..3 (the file says num_epoch=80)
  B  --resume --set max_steps=5                                        steps 4..5, num_epoch still 40
  C  --resume --set max_steps=4 --set batch_size=8 --set lr=0.05       step 5 of 10/epoch is step 2 of 5:
                                                                       schedule steps 3..4, shown as 6..7
  D  --resume --set max_steps=3                                        at step 4 already: nothing to train
  E  --resume --set batch_size=4 --set max_steps=8                     step 4 of 5/epoch is 8 of 10: nothing
References: arcface_torch's schedule written out; the log's own Accuracy-Flip lines; the operating point
computed here from the saved backbone.pth, the .bin decoded by PIL, and a loop over the thresholds.
"""
from __future__ import annotations

import io
import json
import pickle
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from backbones import get_model
from gpu_acceptance.runs import scalars
from tests.run_helpers import run_command

pytestmark = pytest.mark.slow  # five starts of train.py, ~10 CPU seconds each

STARTS = {
    "A": ["--set", "num_epoch=40", "--set", "max_steps=3", "--set", "save_every_steps=1"],
    "B": ["--resume", "--set", "max_steps=5"],
    "C": ["--resume", "--set", "max_steps=4", "--set", "batch_size=8", "--set", "lr=0.05"],
    "D": ["--resume", "--set", "max_steps=3"],
    "E": ["--resume", "--set", "batch_size=4", "--set", "max_steps=8"],
}
LOG_PREFIX = re.compile(r"^Training: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}-", re.MULTILINE)


def scheduled_lr(lr: float, step: int, total_steps: int) -> float:
    """arcface_torch's PolyScheduler without warmup, for 0-based `step`."""
    return lr * (1 - step / total_steps) ** 2


@pytest.fixture(scope="module")
def run(data, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("said")
    config = root / "mine.py"
    config.write_text(f'rec = "{data}"\nnum_views = 2\nnetwork = "r18"\nnetwork_kwargs = {{"width_mult": 0.0625}}\n'
                      f'embedding_size = 32\nbatch_size = 4\nnum_workers = 0\nnum_epoch = 80\nfrequent = 1\n'
                      f'verbose = 1\nval_targets = ("synthetic_val",)\noutput = "{root / "run"}"\n')
    logs, results = {}, {}
    for name, args in STARTS.items():
        before = len((root / "run" / "training.log").read_text()) if (root / "run").exists() else 0
        results[name] = run_command([sys.executable, "train.py", str(config), *args])
        assert results[name].returncode == 0, results[name].stderr[-3000:]
        logs[name] = LOG_PREFIX.sub("", (root / "run" / "training.log").read_text()[before:])
    return SimpleNamespace(output=root / "run", logs=logs, results=results, data=data)


def test_a_resume_keeps_the_set_values_it_was_started_with(run):
    assert ("kept from the run's earlier start (config.json): --set num_epoch=40 --set save_every_steps=1; give "
            "--set again to change one") in run.logs["B"]
    lr = scalars(run.output, "learning_rate")
    for step in (4, 5):  # 10 steps per epoch over num_epoch=40 (the file's 80 would give other values)
        assert lr[step] == pytest.approx(scheduled_lr(0.1, step - 1, 400), rel=1e-6), step
    assert re.findall(r"config changed on resume: .*", run.logs["B"]) == ["config changed on resume: max_steps: 3 -> 5"]


def test_a_change_that_moves_the_schedule_is_a_warning_naming_its_effect_and_the_lr_follows(run):
    log = run.logs["C"]
    assert ("config changed on resume: batch_size 4 -> 8: an epoch has another number of steps: the step is "
            "renumbered (the same fraction of training), this epoch's data order differs") in log
    assert "config changed on resume: lr 0.1 -> 0.05: every LR from this step on is scaled by new / old = 0.5" in log
    lr = scalars(run.output, "learning_rate")
    for shown, step in ((6, 3), (7, 4)):  # 5 steps per epoch now, 200 in all, from lr 0.05
        assert lr[shown] == pytest.approx(scheduled_lr(0.05, step - 1, 200), rel=1e-6), shown


def test_steps_count_on_across_a_renumbering_and_max_steps_is_explained(run):
    log = run.logs["C"]
    assert ("resuming a run of 1 process(es) and 10 steps per epoch with 1 and 5: step 5 becomes step 2 of the LR "
            "schedule; the log and TensorBoard go on counting from step 5") in log
    assert ("max_steps=4 counts steps of the LR schedule (5 per epoch now): this run stops at its step 4, shown in "
            "the log and TensorBoard as step 7") in log
    assert sorted(scalars(run.output, "loss")) == [1, 2, 3, 4, 5, 6, 7]
    assert re.findall(r"Global Step: (\d+)", log) == ["6", "7"]
    assert re.findall(r"\[synthetic_val\]\[(\d+)\]XNorm", log) == ["6", "7"]
    # One count in what the user reads: the resume, the saves and the checkpoint folders say the shown step too.
    assert f"resumed from {run.output / 'checkpoint.json'} at global step 5 (epoch 0)" in log
    assert re.findall(r"saved (\S+) at global step (\d+)", log) == [
        (str(run.output / f"checkpoint-00000000{step}"), str(step)) for step in (6, 7)]


def test_a_resume_with_nothing_left_to_train_says_so_and_why(run):
    # Every step said is the shown one (C showed its schedule steps 3..4 as 6..7), the schedule's only beside it.
    assert ("nothing was trained: the run resumed at global step 7, already at or past the end of training (step "
            "3 of the LR schedule, shown as step 6: max_steps=3, num_epoch=40); raise max_steps or num_epoch to train "
            "on") in run.logs["D"]
    assert ("nothing was trained: the run resumed at global step 7 (step 4 of the saved run, which had 5 steps per "
            "epoch where this one has 10), already at or past the end of training (step 8 of the LR schedule, shown "
            "as step 7: max_steps=8, num_epoch=40)") in run.logs["E"]
    for name in "DE":
        assert f"resumed from {run.output / 'checkpoint.json'} at global step 7 (epoch 0)" in run.logs[name]
    for name in "DE":  # nothing verified again, nothing saved
        assert "Accuracy-" not in run.logs[name] and not re.search("saved .* at global step", run.logs[name])


def test_accuracy_highest_is_the_best_of_the_whole_run(run):
    """Each Accuracy-Highest line is the highest Accuracy-Flip logged so far, over every start."""
    log = "".join(run.logs[name] for name in "ABC")
    flips, best, dropped = [], 0.0, False
    for kind, value in re.findall(r"\[synthetic_val\]\[\d+\]Accuracy-(Flip|Highest): ([\d.]+)", log):
        if kind == "Flip":
            dropped |= bool(flips) and float(value) < max(flips)
            flips.append(float(value))
        else:
            best = max(flips)
            assert float(value) == pytest.approx(best, abs=1e-5)
    assert len(flips) == 7
    assert dropped, "no verification fell below an earlier one: this run cannot tell a kept best from a reset one"


def test_every_save_is_in_the_log(run):
    """Run A saves after each of its 3 steps: training.log says each (the terminal, its first and last)."""
    saved = re.findall(r"saved \S+ at global step (\d+)", run.logs["A"])
    assert saved == ["1", "2", "3"]


def decoded_bin(path: Path) -> tuple[torch.Tensor, np.ndarray]:
    bins, issame = pickle.loads(path.read_bytes())
    images = np.stack([np.asarray(Image.open(io.BytesIO(bytes(entry))).convert("RGB")) for entry in bins])
    return torch.from_numpy(images.astype(np.float32) / 127.5 - 1).permute(0, 3, 1, 2), np.asarray(issame, bool)


def test_the_last_verification_threshold_is_recorded_with_the_model(run):
    images, issame = decoded_bin(run.data / "synthetic_val.bin")
    model = get_model("r18", num_features=32, width_mult=0.0625)
    model.load_state_dict(torch.load(run.output / "backbone.pth", weights_only=True))
    with torch.no_grad():
        model.eval()
        fused = F.normalize((model(images) + model(images.flip(3))).double(), dim=1).numpy()
    similarity = np.sum(fused[0::2] * fused[1::2], axis=1)
    best = None
    for step in range(400):  # upstream's squared-distance thresholds 0, 0.01, ...: the first with the most right
        threshold = 1 - step * 0.01 / 2
        right = int(np.sum((similarity > threshold) == issame))
        if best is None or right > best[1]:
            best = (threshold, right, float(np.mean(similarity[~issame] > threshold)))
    recorded = json.loads((run.output / "model.json").read_text())["verification"]["synthetic_val"]
    assert recorded["threshold"] == pytest.approx(best[0], abs=1e-9)
    assert recorded["accuracy_at_threshold"] == pytest.approx(best[1] / len(issame))
    assert recorded["far"] == pytest.approx(best[2])
    assert recorded["pairs"] == len(issame) and recorded["by"] == "training, step 7"
