"""Fine-tuning a trained backbone on new classes, through the real CLI: `resume=<backbone.pth>` with
freeze_backbone_steps (the class centres alone at first: the backbone's weights and BatchNorm statistics
bitwise as loaded) and backbone_lr_mult (the backbone's lr that multiple of the schedule at every step,
also across a resume and when a resume changes the multiplier)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import train
from gpu_acceptance.runs import CONFIG, INFO, QUIET, load_run
from tests.run_helpers import ROOT, run_here, same_tensors
from training.state import build_networks
from utils.config import load_config

STEPS_PER_EPOCH, EPOCHS, WARMUP_EPOCHS, LR = 10, 4, 1, 0.1  # the data fixture's 40 records, batch 4 (QUIET)


def scheduled_lr(step: int) -> float:
    """arcface_torch's schedule written out for step `step` (0-based): linear warmup over the first epoch, then
    (1 - progress) ** 2 to zero."""
    warmup, total = STEPS_PER_EPOCH * WARMUP_EPOCHS, STEPS_PER_EPOCH * EPOCHS
    if step < warmup:
        return LR * step / warmup
    return LR * (1 - (step - warmup) / (total - warmup)) ** 2


def test_the_frozen_warm_up_leaves_the_backbone_and_its_batchnorm_statistics_bitwise_as_loaded(
        data, trained_backbone, tmp_path):
    frozen, control = tmp_path / "frozen", tmp_path / "control"
    assert run_here(data, frozen, f"resume={trained_backbone}", "freeze_backbone_steps=3", "max_steps=3") == (0, "")
    loaded = torch.load(trained_backbone, weights_only=True)
    saved = load_run(frozen)
    assert same_tensors(saved["backbone"], loaded)  # running_mean, running_var and num_batches_tracked included
    cfg = load_config(ROOT / CONFIG, [f"rec={data}", *QUIET])
    initial_centres = build_networks(cfg, INFO["num_classes"], torch.device("cpu"))[1].weight.detach()
    assert not torch.equal(saved["class_centres"], initial_centres)  # the centres did train
    assert "steps 1 to 3 of the LR schedule train the class centres alone" in (frozen / "training.log").read_text()

    # One step fewer frozen: the third step trains the backbone, weights and statistics.
    assert run_here(data, control, f"resume={trained_backbone}", "freeze_backbone_steps=2", "max_steps=3") == (0, "")
    trained = load_run(control)["backbone"]
    changed = {key for key in loaded if not torch.equal(trained[key], loaded[key])}
    assert {"conv1.weight", "bn1.running_mean", "bn1.num_batches_tracked"} <= changed


@contextlib.contextmanager
def recorded_lrs() -> Iterator[dict[int, list[float]]]:
    """Each step's learning rates ({0-based step: [backbone group's, centres group's]}), read from the
    optimizer's parameter groups just before train.py's step uses them."""
    seen: dict[int, list[float]] = {}
    real_step = train.train_step

    def recording_step(state, micro_batches, cfg):
        seen[state.scheduler.last_epoch] = [group["lr"] for group in state.optimizer.param_groups]
        return real_step(state, micro_batches, cfg)

    train.train_step = recording_step
    try:
        yield seen
    finally:
        train.train_step = real_step


def test_the_backbone_lr_multiplier_holds_at_every_step_and_across_resumes(data, tmp_path):
    """Steps 1-4 with backbone_lr_mult=0.25 (the warmup included), a resume to step 8 that keeps it, a resume
    to step 12 that changes it to 0.5: at every step the backbone's lr is the multiplier times the schedule's,
    the centres' the schedule's."""
    output = tmp_path / "run"
    phases = [((f"warmup_epoch={WARMUP_EPOCHS}", "backbone_lr_mult=0.25", "max_steps=4"), False, range(0, 4), 0.25),
              (("max_steps=8",), True, range(4, 8), 0.25),
              (("backbone_lr_mult=0.5", "max_steps=12"), True, range(8, 12), 0.5)]
    for overrides, resume, steps, multiplier in phases:
        with recorded_lrs() as seen:
            assert run_here(data, output, *overrides, resume=resume) == (0, "")
        assert sorted(seen) == list(steps)
        for step in steps:
            expected = [multiplier * scheduled_lr(step), scheduled_lr(step)]
            assert seen[step] == pytest.approx(expected, rel=1e-12, abs=1e-15), step
    groups = load_run(output)["optimizer"]["param_groups"]
    assert [group["lr"] for group in groups] == pytest.approx([0.5 * scheduled_lr(12), scheduled_lr(12)], rel=1e-12)
