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
"""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train
from backbones import get_model
from tests.distributed_helpers import run_world
from tests.run_helpers import (
    CONFIG,
    INFO,
    QUIET,
    ROOT,
    assert_same_run,
    finish,
    load_run,
    run_here,
    same_tensors,
    scalars,
    start_cli,
)
from utils.checkpoint import CHECKPOINT_NAME, load_checkpoint, restore_training_state, save_checkpoint
from utils.config import load_config

OVERRIDES = ["num_classes=21", "sample_rate=0.5", "warmup_epoch=1", "dropout=0.2"]
INFO21 = {**INFO, "num_classes": 21}
RANK_ROWS = {0: (0, 11), 1: (11, 21)}
pytestmark = pytest.mark.slow  # 4 torchrun launches and a 2-process spawn: 14 Python starts of ~4 CPU seconds each
# what must reassemble identically; the rest (world size, per-rank loader/RNG) belongs to the world
WHOLE_STATE = ("backbone", "class_centres", "optimizer", "scheduler", "grad_scaler", "progress", "model")


def centre_momentum(checkpoint: dict) -> torch.Tensor:
    # the optimizer numbers parameters in group order: the backbone's, then the centres
    index = len(list(get_model("r18", num_features=32, width_mult=0.125).parameters()))
    return checkpoint["optimizer"]["state"][index]["momentum_buffer"]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("torchrun")
    whole = start_cli(data, root / "whole", *OVERRIDES, "max_steps=6")
    first_half = start_cli(data, root / "split", *OVERRIDES, "max_steps=3")
    assert run_here(data, root / "one_to_two", *OVERRIDES, "max_steps=4") == (0, "")
    finish(first_half)
    shutil.copytree(root / "split", root / "two_to_one")
    shutil.copy(root / "split" / CHECKPOINT_NAME, root / "written_by_two.pt")
    shutil.copy(root / "one_to_two" / CHECKPOINT_NAME, root / "written_by_one.pt")
    with ThreadPoolExecutor(1) as pool:
        split_by_two = pool.submit(run_world, restore_and_save, 2, str(root / "written_by_one.pt"),
                                   str(root / "rewritten_by_two"))
        second_half = start_cli(data, root / "split", *OVERRIDES, "max_steps=6", resume=True)
        one_to_two = start_cli(data, root / "one_to_two", *OVERRIDES, "max_steps=4", resume=True)
        assert run_here(data, root / "two_to_one", *OVERRIDES, "max_steps=8", resume=True) == (0, "")
        for process in (whole, second_half, one_to_two):
            finish(process)
        return SimpleNamespace(root=root, split_by_two=split_by_two.result())


def test_two_process_resume_is_the_uninterrupted_run(runs):
    assert sorted(scalars(runs.root / "split", "loss")) == [1, 2, 3, 4, 5, 6]
    resumed = load_run(runs.root / "split", INFO21)
    assert resumed["world_size"] == 2 and resumed["progress"]["epoch"] == 1
    assert_same_run(runs.root / "split", runs.root / "whole", INFO21)


def restore_and_save(rank: int, world_size: int, source: str, target: str) -> dict:
    """What a resuming rank holds after restoring `source`, then the checkpoint it writes back."""
    cfg = load_config(ROOT / CONFIG, [*QUIET, *OVERRIDES])
    model = train.build_training(cfg, 21, torch.device("cpu"), steps_per_epoch=1)
    checkpoint = load_checkpoint(source, INFO21)
    restore_training_state(checkpoint, backbone=model.backbone, pfc=model.pfc, optimizer=model.optimizer,
                           scheduler=model.scheduler, grad_scaler=model.scaler)
    save_checkpoint(target, backbone=model.backbone, pfc=model.pfc, optimizer=model.optimizer,
                    scheduler=model.scheduler, grad_scaler=model.scaler, progress=checkpoint["progress"],
                    loader_state=None, model_info=checkpoint["model"], config=checkpoint["config"])
    return {"centres": model.pfc.weight.detach().clone(),
            "momentum": model.optimizer.state[model.pfc.weight]["momentum_buffer"].clone()}


def assert_reassembled(rewritten: Path, original: Path) -> None:
    again, saved = torch.load(rewritten, weights_only=True), torch.load(original, weights_only=True)
    for key in WHOLE_STATE:
        assert same_tensors(again[key], saved[key]), key


def assert_went_on(run: Path, saved_as: tuple[int, int, int], resumed_as: tuple[int, int, int],
                   final_step: int) -> None:
    """`run`, saved as (processes, steps per epoch, step) and resumed as (processes, steps per epoch,
    step), said so in its log and trained on to `final_step` with finite losses."""
    (world_before, epoch_before, step_before), (world_after, epoch_after, step_after) = saved_as, resumed_as
    log = (run / "training.log").read_text()
    assert (f"resuming a run of {world_before} process(es) and {epoch_before} steps per epoch with {world_after} and "
            f"{epoch_after}: step {step_before} becomes step {step_after}") in log
    assert f"resumed from {run / CHECKPOINT_NAME} at global step {step_after} (epoch 0)" in log
    continued = load_run(run, INFO21)
    assert continued["world_size"] == world_after and continued["progress"]["global_step"] == final_step
    after_resume = {step: loss for step, loss in scalars(run, "loss").items() if step > step_after}
    assert sorted(after_resume) == list(range(step_after + 1, final_step + 1))
    assert all(0 < loss < 100 for loss in after_resume.values())


def test_a_two_process_checkpoint_reassembles_in_one_process_and_training_goes_on(runs, tmp_path):
    saved = load_checkpoint(runs.root / "written_by_two.pt", INFO21)
    assert saved["world_size"] == 2 and tuple(saved["class_centres"].shape) == (21, 32)
    assert tuple(centre_momentum(saved).shape) == (21, 32)
    alone = restore_and_save(0, 1, str(runs.root / "written_by_two.pt"), str(tmp_path))
    assert torch.equal(alone["centres"], saved["class_centres"])
    assert torch.equal(alone["momentum"], centre_momentum(saved))
    assert_reassembled(tmp_path / CHECKPOINT_NAME, runs.root / "written_by_two.pt")
    assert_went_on(runs.root / "two_to_one", saved_as=(2, 5, 3), resumed_as=(1, 10, 6), final_step=8)


def test_a_one_process_checkpoint_splits_over_two_processes_and_training_goes_on(runs):
    ranks = runs.split_by_two
    saved = load_checkpoint(runs.root / "written_by_one.pt", INFO21)
    for rank, (start, stop) in RANK_ROWS.items():
        assert torch.equal(ranks[rank]["centres"], saved["class_centres"][start:stop])
        assert torch.equal(ranks[rank]["momentum"], centre_momentum(saved)[start:stop])
    assert_reassembled(runs.root / "rewritten_by_two" / CHECKPOINT_NAME, runs.root / "written_by_one.pt")
    assert_went_on(runs.root / "one_to_two", saved_as=(1, 10, 4), resumed_as=(2, 5, 2), final_step=4)
