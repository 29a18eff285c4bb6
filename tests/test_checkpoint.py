"""Checkpoints: atomic writes, full class-centre matrix and its optimizer state across world sizes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from losses import CombinedMarginLoss
from partial_fc import PartialFC
from tests.distributed_helpers import run_world
from utils.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    atomic_save,
    find_resume_source,
    load_checkpoint,
    restore_training_state,
    save_checkpoint,
)
from utils.lr_scheduler import build_scheduler

NUM_CLASSES, DIM = 7, 3          # 7 classes over 2 ranks: rows 0..3 and 4..6 (uneven on purpose)
RANK_ROWS = {0: (0, 4), 1: (4, 7)}
INFO = {"network": "toy", "network_kwargs": {}, "embedding_size": DIM, "num_classes": NUM_CLASSES}
ROOT = Path(__file__).resolve().parent.parent


def full_centres() -> torch.Tensor:
    return torch.arange(NUM_CLASSES * DIM, dtype=torch.float32).reshape(NUM_CLASSES, DIM) / 10


def make_run(optimizer_name: str):
    torch.manual_seed(0)
    backbone = torch.nn.Linear(4, DIM)
    pfc = PartialFC(CombinedMarginLoss(), DIM, NUM_CLASSES)
    groups = [{"params": list(backbone.parameters())}, {"params": [pfc.weight]}]
    optimizer = (torch.optim.SGD(groups, lr=0.1, momentum=0.9) if optimizer_name == "sgd"
                 else torch.optim.AdamW(groups, lr=0.1))
    scheduler = build_scheduler(optimizer, 2, 20)
    return backbone, pfc, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False)


def take_steps(backbone, pfc, optimizer, scheduler, steps=2):
    """Steps with a known, row-dependent centre gradient, so optimizer state differs per row."""
    for step in range(steps):
        pfc.weight.grad = (torch.arange(pfc.weight.numel(), dtype=torch.float32).reshape(pfc.weight.shape)
                           + pfc.class_start * DIM + step)
        for p in backbone.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()


def save_from_world(rank: int, world_size: int, out_dir: str, optimizer_name: str):
    backbone, pfc, optimizer, scheduler, scaler = make_run(optimizer_name)
    start, stop = RANK_ROWS[rank] if world_size == 2 else (0, NUM_CLASSES)
    assert (pfc.class_start, pfc.num_local) == (start, stop - start)
    with torch.no_grad():
        pfc.weight.copy_(full_centres()[start:stop])
    take_steps(backbone, pfc, optimizer, scheduler)
    save_checkpoint(out_dir, backbone=backbone, pfc=pfc, optimizer=optimizer, scheduler=scheduler, grad_scaler=scaler,
                    progress={"global_step": 2}, loader_state={"rank": rank}, model_info=INFO, config={"lr": 0.1})
    index = len(list(backbone.parameters()))
    return {"weight": pfc.weight.detach().clone(),
            "state": {k: v.clone() for k, v in optimizer.state_dict()["state"][index].items()}}


def restore_in_world(rank: int, world_size: int, out_dir: str, optimizer_name: str):
    backbone, pfc, optimizer, scheduler, scaler = make_run(optimizer_name)
    checkpoint = load_checkpoint(Path(out_dir) / CHECKPOINT_NAME, INFO)
    restore_training_state(checkpoint, backbone=backbone, pfc=pfc, optimizer=optimizer, scheduler=scheduler,
                           grad_scaler=scaler)
    index = len(list(backbone.parameters()))
    return {"weight": pfc.weight.detach().clone(), "state": dict(optimizer.state_dict()["state"][index]),
            "lr": optimizer.param_groups[1]["lr"], "per_rank": checkpoint["per_rank"]}


OPTIMIZERS = ("sgd", "adamw")


def two_rank_round_trips(rank: int, world_size: int, root: str):
    """In one 2-process world (spawning is the slow part): save a 2-rank checkpoint per optimizer and
    restore it on 2 ranks; restore the 1-rank checkpoint the parent process wrote."""
    out = {}
    for name in OPTIMIZERS:
        out[name] = {"saved": save_from_world(rank, world_size, f"{root}/two_{name}", name)}
        out[name]["restored"] = restore_in_world(rank, world_size, f"{root}/two_{name}", name)
    out["split"] = restore_in_world(rank, world_size, f"{root}/one_sgd", "sgd")
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    single = save_from_world(0, 1, str(root / "one_sgd"), "sgd")  # no process group: world size 1
    return root, single, run_world(two_rank_round_trips, 2, str(root))


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_two_rank_checkpoint_holds_the_whole_matrix_and_resumes_on_one_and_two_ranks(worlds, optimizer_name):
    root, _, ranks = worlds
    folder = root / f"two_{optimizer_name}"
    saved = [r[optimizer_name]["saved"] for r in ranks]
    # reference: the two shards stacked by hand, rows 0..3 from rank 0, 4..6 from rank 1
    whole_weight = torch.cat([r["weight"] for r in saved])
    state_names = sorted(saved[0]["state"])
    checkpoint = load_checkpoint(folder / CHECKPOINT_NAME, INFO)
    assert torch.equal(checkpoint["class_centres"], whole_weight)
    assert [p["loader"] for p in checkpoint["per_rank"]] == [{"rank": 0}, {"rank": 1}]

    single = restore_in_world(0, 1, str(folder), optimizer_name)
    assert torch.equal(single["weight"], whole_weight)
    for name in state_names:
        per_rank = [r["state"][name] for r in saved]
        if per_rank[0].dim() == 2:
            assert torch.equal(single["state"][name], torch.cat(per_rank)), name
        else:
            assert torch.equal(single["state"][name], per_rank[0]), name
    assert single["lr"] == pytest.approx(0.1)  # warmup of 2 steps done: lr is back at the base

    for rank, (start, stop) in RANK_ROWS.items():
        again = ranks[rank][optimizer_name]["restored"]
        assert torch.equal(again["weight"], whole_weight[start:stop])
        for name in state_names:
            if saved[rank]["state"][name].dim() == 2:
                assert torch.equal(again["state"][name], saved[rank]["state"][name]), name


def test_one_rank_checkpoint_splits_over_two_ranks(worlds):
    _, single, ranks = worlds
    for rank, (start, stop) in RANK_ROWS.items():
        split = ranks[rank]["split"]
        assert torch.equal(split["weight"], single["weight"][start:stop])
        assert torch.equal(split["state"]["momentum_buffer"], single["state"]["momentum_buffer"][start:stop])


def test_mismatched_model_is_refused_with_the_difference(worlds):
    root, _, _ = worlds
    with pytest.raises(CheckpointError, match=r"another model \(network 'toy' there, 'r50' here; "
                                              r"embedding_size 3 there, 512 here\)"):
        load_checkpoint(root / "one_sgd" / CHECKPOINT_NAME, {**INFO, "embedding_size": 512, "network": "r50"})


def test_atomic_save_replaces_whole_files_and_clears_leftovers(tmp_path):
    path = tmp_path / CHECKPOINT_NAME
    stale = tmp_path / f".tmp-{CHECKPOINT_NAME}.12345"
    stale.write_bytes(b"half a checkpoint")
    atomic_save({"x": torch.ones(3)}, path)
    assert torch.equal(torch.load(path)["x"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]


def test_unreadable_or_foreign_files_are_not_taken_for_checkpoints(tmp_path):
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"\x00" * 100)  # e.g. truncated by a crash of something else
    with pytest.raises(CheckpointError, match="damaged or not a checkpoint"):
        find_resume_source(tmp_path)
    bare = tmp_path / "model.pt"
    torch.save({"conv1.weight": torch.zeros(1)}, bare)
    assert find_resume_source(bare) == ("backbone", bare)
    with pytest.raises(CheckpointError, match="resume source .*absent does not exist"):
        find_resume_source(tmp_path / "absent")
    (tmp_path / "run").mkdir()
    with pytest.raises(CheckpointError, match="nothing to resume in"):
        find_resume_source(tmp_path / "run")


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    """A real write failure: the file-size limit (as a full disk would) stops the write half-way."""
    path = tmp_path / CHECKPOINT_NAME
    atomic_save({"generation": 1}, path)
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from utils.checkpoint import CheckpointError, atomic_save
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            atomic_save({{"generation": 2, "big": torch.zeros(1 << 20)}}, {str(path)!r})
        except CheckpointError as error:
            print(error)
            sys.exit(3)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert "could not write" in result.stdout and "previous checkpoint.pt is untouched" in result.stdout
    assert torch.load(path) == {"generation": 1}
    assert os.listdir(tmp_path) == [CHECKPOINT_NAME]
