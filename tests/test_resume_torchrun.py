"""Two processes through `torchrun --nproc_per_node 2 train.py`: exact resume on the same world
size, and resume on another one (2 -> 1 and 1 -> 2).

21 classes (the data's 20 labels plus one) split unevenly: rows 0..10 on rank 0, 11..20 on rank 1.
2 ranks x 20 records, batch 4: 5 steps per epoch; 1 process: 10.

Runs, started side by side where they do not depend on each other (each torchrun start is seconds
of imports on this CPU):
  whole:      2 processes, steps 1..6 uninterrupted
  split:      2 processes, steps 1..3, then --resume to 6 (across the epoch end at 5)
  two_to_one: a copy of split at step 3 (2 processes), resumed in 1 process: step 3 of 5 is step 6 of 10; on to 8
  one_to_two: 1 process, steps 1..4, resumed in 2 processes: step 4 of 10 is step 2 of 5; on to 4
(How the centre matrix and its optimizer state reassemble bit for bit across world sizes is
tests/test_sharded.py's business; here the runs say what they did and train on at the right LR.)
"""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_acceptance.runs import INFO, load_run, scalars
from tests.run_helpers import assert_same_run, finish, run_here, start_cli

# ema_decay: the EMA of the backbone (training/ema.py) is saved by 2 processes and resumed by 1, and the other way.
OVERRIDES = ["num_classes=21", "sample_rate=0.5", "warmup_epoch=1", "dropout=0.2", "ema_decay=0.9"]
INFO21 = {**INFO, "num_classes": 21}
LR, WARMUP_EPOCHS, EPOCHS = 0.1, 1, 4  # runs.QUIET's lr and num_epoch, OVERRIDES' warmup
pytestmark = pytest.mark.slow  # 4 torchrun launches: ~10 Python starts of ~4 CPU seconds each


def scheduled_lr(step: int, steps_per_epoch: int) -> float:
    """arcface_torch's schedule written out: linear warmup, then (1 - progress) ** 2, for 0-based `step`."""
    warmup, total = WARMUP_EPOCHS * steps_per_epoch, EPOCHS * steps_per_epoch
    if step < warmup:
        return LR * step / warmup
    return LR * (1 - (step - warmup) / (total - warmup)) ** 2


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("torchrun")
    whole = start_cli(data, root / "whole", *OVERRIDES, "max_steps=6")
    first_half = start_cli(data, root / "split", *OVERRIDES, "max_steps=3")
    assert run_here(data, root / "one_to_two", *OVERRIDES, "max_steps=4") == (0, "")
    finish(first_half)
    shutil.copytree(root / "split", root / "two_to_one")
    second_half = start_cli(data, root / "split", *OVERRIDES, "max_steps=6", resume=True)
    one_to_two = start_cli(data, root / "one_to_two", *OVERRIDES, "max_steps=4", resume=True)
    assert run_here(data, root / "two_to_one", *OVERRIDES, "max_steps=8", resume=True) == (0, "")
    for process in (whole, second_half, one_to_two):
        finish(process)
    return SimpleNamespace(root=root)


def test_two_process_resume_is_the_uninterrupted_run(runs):
    assert sorted(scalars(runs.root / "split", "loss")) == [1, 2, 3, 4, 5, 6]
    resumed = load_run(runs.root / "split", INFO21)
    assert resumed["world_size"] == 2 and resumed["progress"]["epoch"] == 1
    assert_same_run(runs.root / "split", runs.root / "whole", INFO21)


def assert_went_on(run: Path, saved_as: tuple[int, int, int], resumed_as: tuple[int, int, int],
                   final_step: int) -> None:
    """`run`, saved as (processes, steps per epoch, step) and resumed as (processes, steps per epoch,
    step), said so in its log, trained on to `final_step` of the schedule with finite losses, the first step
    after the resume used the schedule's LR at the renumbered step (not the LR saved with the old numbering),
    and TensorBoard's steps went on counting from the saved step: 1, 2, ... without a gap or a step back."""
    (world_before, epoch_before, step_before), (world_after, epoch_after, step_after) = saved_as, resumed_as
    log = (run / "training.log").read_text()
    assert (f"resuming a run of {world_before} process(es) and {epoch_before} steps per epoch with {world_after} and "
            f"{epoch_after}: step {step_before} becomes step {step_after} of the LR schedule; the log and TensorBoard "
            f"go on counting from step {step_before}; the data order of this epoch differs from the original "
            "run") in log
    assert f"resumed from {run / 'checkpoint.json'} at global step {step_before} (epoch 0)" in log
    continued = load_run(run, INFO21)
    assert continued["world_size"] == world_after and continued["progress"]["global_step"] == final_step
    shown_offset = step_before - step_after  # TensorBoard's step minus the schedule's, after the resume
    losses = scalars(run, "loss")
    assert sorted(losses) == list(range(1, final_step + shown_offset + 1))
    assert all(0 < losses[step] < 100 for step in range(step_before + 1, final_step + shown_offset + 1))
    lr_logged = scalars(run, "learning_rate")
    for step in range(step_after + 1, final_step + 1):  # logged at 1-based step s: the LR of 0-based step s - 1
        assert lr_logged[step + shown_offset] == pytest.approx(scheduled_lr(step - 1, epoch_after), rel=1e-6), step


def test_a_two_process_run_resumes_in_one_process_at_the_renumbered_step(runs):
    assert_went_on(runs.root / "two_to_one", saved_as=(2, 5, 3), resumed_as=(1, 10, 6), final_step=8)


def test_a_one_process_run_resumes_in_two_processes_at_the_renumbered_step(runs):
    assert_went_on(runs.root / "one_to_two", saved_as=(1, 10, 4), resumed_as=(2, 5, 2), final_step=4)
