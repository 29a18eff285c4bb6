"""Fine-tuning on two processes (gloo): the frozen warm-up's steps run the backbone outside DistributedDataParallel,
and the steps after it must all-reduce its gradients as any step does.

- train_step on 2 ranks (DDP) and on 1 process, each step's global batch the same 4 records (2 per rank), 2 frozen
  steps then 2 unfrozen: at every step every rank's backbone is the same, bit for bit, and equal to the
  1-process run's and to a dense float64 computation of the same steps (tests/test_train_step.py's); the frozen
  steps leave it as it was.
- Through `torchrun --nproc_per_node 2 train.py`, from a trained backbone.pth: a resume inside the frozen span
  lands on the uninterrupted run bit for bit; `freeze_backbone=True` keeps the whole backbone as loaded, its
  BatchNorm statistics included, where `backbone_lr_mult=0` (1 process) leaves the weights and moves them.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpu_acceptance.runs import load_run
from tests.distributed_helpers import run_world
from tests.run_helpers import assert_same_run, finish, run_here, same_tensors, start_cli
from tests.test_train_step import LR, MOMENTUM, WD, B, black_and_white_batch, dense_updates, make_float64_state
from training.state import wrap_for_the_step
from training.step import StepOutcome, train_step
from utils.config import load_config

FROZEN, STEPS, MAX_NORM = 2, 4, 5.0
pytestmark = pytest.mark.slow  # 3 torchrun launches beside two 2-process worlds


def fine_tune_config(folder: Path) -> SimpleNamespace:
    (folder / "c.py").write_text("")
    return load_config(folder / "c.py", [f"lr={LR}", f"weight_decay={WD}", f"momentum={MOMENTUM}",
                                         f"max_grad_norm={MAX_NORM}", f"freeze_backbone_steps={FROZEN}"])


def _fine_tune_steps(rank: int, world_size: int, folder: str) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """STEPS float64 steps on this rank's share of each global batch: after each, (the backbone's weights as one
    vector, this rank's centre rows, the first class they hold)."""
    cfg = fine_tune_config(Path(folder))
    state = make_float64_state(cfg)
    wrap_for_the_step(state, cfg, torch.device("cpu"))  # DDP on 2 ranks
    share = B // world_size
    after = []
    for step in range(STEPS):
        images, labels = black_and_white_batch(step + 1)
        rows = slice(rank * share, (rank + 1) * share)
        _, outcome = train_step(state, [(images[rows], labels[rows])], cfg)
        assert outcome == StepOutcome.TAKEN
        weights = torch.cat([p.detach().reshape(-1) for p in state.backbone.parameters()])
        after.append((weights, state.pfc.weight.detach().clone(), state.pfc.class_start))
    return after


def test_frozen_then_unfrozen_steps_keep_every_rank_on_the_one_process_and_dense_steps(tmp_path):
    two, (one,) = run_world(_fine_tune_steps, 2, str(tmp_path)), run_world(_fine_tune_steps, 1, str(tmp_path))
    state = make_float64_state(fine_tune_config(tmp_path))
    initial = torch.cat([p.detach().reshape(-1) for p in state.backbone.parameters()])
    batches = [black_and_white_batch(step + 1) for step in range(STEPS)]
    updates = dense_updates(state.backbone, state.pfc.weight, batches, MAX_NORM, frozen_steps=FROZEN)
    dense_backbone, dense_centres = initial.clone(), state.pfc.weight.detach().clone()
    for step in range(STEPS):
        dense_backbone += torch.cat([update.reshape(-1) for update in updates[step][:-1]])
        dense_centres += updates[step][-1]
        (backbone, *_), (other_rank, *_) = two[0][step], two[1][step]
        assert torch.equal(backbone, other_rank), step  # DDP's all-reduce gave both ranks one gradient
        if step < FROZEN:
            assert torch.equal(backbone, initial), step
        else:
            assert not torch.equal(backbone, two[0][step - 1][0]), step  # the backbone trains again
        centres = torch.cat([two[rank][step][1] for rank in sorted(range(2), key=lambda r: two[r][step][2])])
        # DDP's mean of two half-batch gradients against one process's whole batch: float64 rounding apart
        torch.testing.assert_close(backbone, one[step][0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(centres, one[step][1], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(backbone, dense_backbone, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(centres, dense_centres, rtol=1e-10, atol=1e-12)


FINE_TUNE = ("freeze_backbone_steps=3", "max_steps=5")  # 2 ranks x 20 records, batch 4: 5 steps in the first epoch


@pytest.fixture(scope="module")
def runs(data, trained_backbone, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("fine_tune_ddp")
    loaded = f"resume={trained_backbone}"
    whole = start_cli(data, root / "whole", loaded, *FINE_TUNE)
    first_half = start_cli(data, root / "split", loaded, "freeze_backbone_steps=3", "max_steps=2")
    assert run_here(data, root / "lr_mult_0", loaded, "backbone_lr_mult=0", "max_steps=2") == (0, "")
    finish(first_half)
    frozen = start_cli(data, root / "frozen", loaded, "freeze_backbone=True", "max_steps=3")
    second_half = start_cli(data, root / "split", *FINE_TUNE, resume=True)
    for process in (whole, frozen, second_half):
        finish(process)
    return SimpleNamespace(root=root, loaded=torch.load(trained_backbone, weights_only=True))


def test_a_resume_inside_the_frozen_span_lands_on_the_uninterrupted_run(runs):
    assert_same_run(runs.root / "split", runs.root / "whole")
    trained = load_run(runs.root / "whole")["backbone"]
    assert not torch.equal(trained["conv1.weight"], runs.loaded["conv1.weight"])  # steps 4 and 5 trained it


def test_freeze_backbone_keeps_every_weight_and_batchnorm_statistic_as_loaded(runs):
    frozen = load_run(runs.root / "frozen")
    assert frozen["world_size"] == 2 and frozen["progress"]["global_step"] == 3
    assert same_tensors(frozen["backbone"], runs.loaded)  # running_mean, running_var, num_batches_tracked included
    assert "every step trains the class centres alone (freeze_backbone)" in (
        runs.root / "frozen" / "training.log").read_text()
    # backbone_lr_mult=0 is no freeze: the weights stay, but train mode moves the BatchNorm statistics
    weights_only = load_run(runs.root / "lr_mult_0")["backbone"]
    assert torch.equal(weights_only["conv1.weight"], runs.loaded["conv1.weight"])
    assert not torch.equal(weights_only["bn1.running_mean"], runs.loaded["bn1.running_mean"])
