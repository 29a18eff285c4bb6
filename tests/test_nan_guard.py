"""The non-finite loss guard, through the real CLI under tests.nan_injection (rank 0's loss becomes NaN
at the steps it is given): a skipped step changes no weight and no optimizer state
on any rank, is logged with its counters; too many in a row stop the run with one sentence and a
non-zero exit, leaving the last good checkpoint byte for byte (and mtime) as it was; fp16's routine
overflow skips are not counted, unless they push the grad scale below min_grad_scale (injected overflows)."""
from __future__ import annotations

from pathlib import Path

import torch

from gpu_acceptance.runs import CONFIG, QUIET, load_run, scalars
from tests.distributed_helpers import run_world
from tests.nan_injection import nan_at_steps, overflow_at_steps
from tests.run_helpers import ROOT, continue_command, file_states, finish, run_here, same_tensors, start_cli
from tests.test_train_errors import only_line
from training.state import build_training_state, wrap_for_the_step
from training.step import StepOutcome, train_step
from utils.config import load_config


def test_a_nonfinite_loss_on_rank_0_skips_the_step_on_both_ranks(data, tmp_path):
    """Two ranks: the run with a NaN at step 3 ends with the weights, centres (both shards) and
    momentum of the run that stopped after step 2; only the counters and the LR schedule moved on."""
    before, skipped = tmp_path / "two_steps", tmp_path / "nan_at_3"
    runs = [start_cli(data, before, "max_steps=2"),
            start_cli(data, skipped, "max_steps=3", nan_steps="3")]
    for run in runs:
        finish(run)
    good, guarded = load_run(before), load_run(skipped)
    for key in ("backbone", "class_centres"):  # BatchNorm statistics included
        assert same_tensors(guarded[key], good[key]), key
    assert same_tensors(guarded["optimizer"]["state"], good["optimizer"]["state"])  # momentum
    assert (guarded["progress"]["global_step"], guarded["progress"]["nonfinite_total"]) == (3, 1)
    assert guarded["scheduler"]["last_epoch"] == good["scheduler"]["last_epoch"] + 1  # the schedule moved on
    log = (skipped / "training.log").read_text()
    assert "Global Step 3: non-finite loss, step skipped (1 in a row, 1 in this run)" in log
    assert sorted(scalars(skipped, "loss")) == [1, 2]  # no loss line for the skipped step


def test_too_many_in_a_row_stop_the_run_and_leave_the_last_checkpoint_untouched(data, tmp_path):
    """A checkpoint after every step would overwrite the last good one inside the streak: it must not."""
    output = tmp_path / "run"
    assert run_here(data, output, "max_steps=4", "save_every_steps=1") == (0, "")
    saved = (".json", ".pth", ".distcp", ".metadata")
    good = {name: state for name, state in file_states(output).items() if name.endswith(saved)}
    with nan_at_steps({5, 6, 7}):
        status, stderr = run_here(data, output, "max_steps=20", "save_every_steps=1", "max_nonfinite_steps=3",
                                  resume=True)
    assert status == 1
    assert only_line(stderr) == (
        f"error: stopped at global step 7: 3 non-finite losses in a row (max_nonfinite_steps=3); the last good "
        f"checkpoint.json in {output} is untouched (continue with: "
        f"{continue_command(data, output, 'max_steps=20', 'save_every_steps=1', 'max_nonfinite_steps=3')}); lower "
        "lr, try bf16 instead of fp16, or check the data")
    assert {name: file_states(output)[name] for name in good} == good
    log = (output / "training.log").read_text()
    for step, count in ((5, 1), (6, 2), (7, 3)):
        assert f"Global Step {step}: non-finite loss, step skipped ({count} in a row, {count} in this run)" in log

    assert run_here(data, output, "max_steps=5", resume=True) == (0, "")  # the untouched checkpoint resumes
    assert f"resumed from {output / 'checkpoint.json'} at global step 4 " in (output / "training.log").read_text()
    assert load_run(output)["progress"]["global_step"] == 5


def test_fp16_overflow_backs_the_scale_off_without_counting_towards_the_stop(data, tmp_path: Path):
    """CPU fp16: the GradScaler starts at 2^16 and overflows for several steps in a row, more than
    max_nonfinite_steps=2; those skips are the scaler's routine, not a diverging loss."""
    output = tmp_path / "run"
    assert run_here(data, output, "fp16=True", "max_steps=10", "max_nonfinite_steps=2") == (0, "")
    saved = load_run(output)
    assert saved["grad_scaler"]["scale"] <= 2.0 ** 13  # at least three back-offs in a row
    assert saved["progress"]["nonfinite_total"] == 0
    log = (output / "training.log").read_text()
    assert "non-finite" not in log
    assert "fp16 on a CPU: float16 convolutions have no fast CPU kernel" in log  # and how to avoid it


def test_an_fp16_grad_scale_below_min_grad_scale_counts_towards_the_stop(data, tmp_path: Path):
    """An overflow at every step halves the scale from 2^16 each time: 2^11 after step 5, the first below
    min_grad_scale=2^12; steps 5, 6 and 7 are three in a row, and max_nonfinite_steps=3 stops the run at step 7
    with the scale (2^9) named, the last good checkpoint (step 4) untouched."""
    output = tmp_path / "run"
    overrides = ("fp16=True", "max_steps=20", "save_every_steps=4", f"min_grad_scale={2.0 ** 12}",
                 "max_nonfinite_steps=3")
    with overflow_at_steps(set(range(1, 21))):
        status, stderr = run_here(data, output, *overrides)
    assert status == 1
    assert only_line(stderr) == (
        f"error: stopped at global step 7: the fp16 grad scale fell to 512, below min_grad_scale=4096, for 3 steps "
        f"in a row (max_nonfinite_steps=3): float16 gradients overflow at every step and the loss no longer moves; "
        f"the last good checkpoint.json in {output} is untouched (continue with: "
        f"{continue_command(data, output, *overrides)}); set bf16=True instead of fp16, lower lr, or lower "
        "max_grad_norm")
    log = (output / "training.log").read_text()
    for step, scale, count in ((5, 2048, 1), (6, 1024, 2), (7, 512, 3)):
        assert (f"Global Step {step}: fp16 grad scale {scale}, below min_grad_scale=4096 ({count} in a row, "
                f"{count} in this run)") in log
    assert "Global Step 4: fp16 grad scale" not in log
    assert load_run(output)["progress"]["global_step"] == 4


def test_steps_taken_with_a_collapsed_grad_scale_count_until_it_grows_back(data, tmp_path: Path):
    """Overflows up to step 6 leave the scale at 2^10, below min_grad_scale=2^12; step 7 is taken (no overflow, the
    scale as it was) but the loss still cannot move, so it counts too: train.py reads the scale after a step taken
    while a streak is counted, although it skips the read (a host sync) after steps taken above the bound."""
    output = tmp_path / "run"
    overrides = ("fp16=True", "max_steps=20", f"min_grad_scale={2.0 ** 12}", "max_nonfinite_steps=3")
    with overflow_at_steps(set(range(1, 6))):
        status, stderr = run_here(data, output, *overrides)
    assert status == 1
    assert only_line(stderr).startswith("error: stopped at global step 7: the fp16 grad scale fell to 1024, below "
                                        "min_grad_scale=4096, for 3 steps in a row"), stderr
    log = (output / "training.log").read_text()
    for step, scale, count in ((5, 2048, 1), (6, 1024, 2), (7, 1024, 3)):
        assert (f"Global Step {step}: fp16 grad scale {scale}, below min_grad_scale=4096 ({count} in a row, "
                f"{count} in this run)") in log


def _centre_gradient_fault(rank: int, world_size: int) -> dict:
    """One float32 step on two ranks where rank 1's centre gradient alone is made non-finite (a gradient
    hook: the loss and the backbone gradient stay finite, as when only the classifier's backward overflows)."""
    cfg = load_config(ROOT / CONFIG, ["rec=synthetic", *QUIET, "num_views=1", "batch_size=2"])
    state = build_training_state(cfg, 4, torch.device("cpu"), steps_per_epoch=10)
    wrap_for_the_step(state, cfg, torch.device("cpu"))
    before = {**{f"backbone.{k}": v.clone() for k, v in state.backbone.state_dict().items()},
              "centres": state.pfc.weight.detach().clone()}
    if rank == 1:
        state.pfc.weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("inf")))
    generator = torch.Generator().manual_seed(rank)
    images = torch.randint(0, 256, (2, 1, 3, 112, 112), dtype=torch.uint8, generator=generator)
    losses, outcome = train_step(state, [(images, torch.tensor([0, 3]))], cfg)
    after = {**{f"backbone.{k}": v for k, v in state.backbone.state_dict().items()},
             "centres": state.pfc.weight.detach()}
    return {"outcome": int(outcome), "loss_finite": bool(torch.isfinite(losses).all()),
            "changed": [key for key in before if not torch.equal(before[key], after[key])],
            "optimizer_state": len(state.optimizer.state)}


def test_a_nonfinite_centre_gradient_alone_skips_the_step_on_every_rank():
    """Finite loss, finite backbone gradient, a non-finite centre gradient on rank 1 only: both ranks skip
    (nothing changes, not even BatchNorm statistics, and no optimizer state is created)."""
    for result in run_world(_centre_gradient_fault, 2):
        assert result["loss_finite"]
        assert result["outcome"] == StepOutcome.GRAD_NONFINITE
        assert result["changed"] == []
        assert result["optimizer_state"] == 0
