"""What a resume starts from (checkpoint/sources.py): which importer takes a run folder or a file, and the
earlier versions' single-file checkpoint.pt resumed on two ranks, each reading its own rows."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from checkpoint.pointer import POINTER_NAME
from checkpoint.sharded import restore_state
from checkpoint.sources import (
    LEGACY_FORMAT,
    LEGACY_NAME,
    BareBackbone,
    EarlierCheckpoint,
    SavedCheckpoint,
    find_resume_source,
)
from tests.distributed_helpers import run_world
from tests.toy_state import DIM, INFO, NUM_CLASSES, make_model, take_steps
from utils.errors import CheckpointError


def legacy_checkpoint(path: Path, centres: torch.Tensor, momentum: torch.Tensor, world_size: int) -> None:
    """A checkpoint.pt as earlier versions wrote it: every centre row and its momentum in one file."""
    model = make_model("sgd")
    take_steps(model, steps=1)
    optimizer = model.optimizer.state_dict()
    optimizer["state"][len(list(model.backbone.parameters()))] = {"momentum_buffer": momentum}
    rng = {"python": (3, tuple(range(625)), None), "torch": torch.get_rng_state(),
           "numpy": (torch.zeros(624, dtype=torch.int64), 0, 0, 0.0)}
    torch.save({"format": LEGACY_FORMAT, "model": INFO, "config": {"lr": 0.1}, "world_size": world_size,
                "progress": {"global_step": 1, "steps_per_epoch": 10}, "backbone": model.backbone.state_dict(),
                "class_centres": centres, "optimizer": optimizer, "scheduler": model.scheduler.state_dict(),
                "grad_scaler": model.scaler.state_dict(),
                "per_rank": [{"rng": rng, "loader": {"skipped": r}} for r in range(world_size)]}, path)


def _legacy_in_world(rank: int, world_size: int, path: str) -> dict:
    model = make_model("sgd", seed=5)
    restored = EarlierCheckpoint().restore(Path(path), INFO, model)
    return {"weight": model.pfc.weight.detach().clone(),
            "momentum": model.optimizer.state[model.pfc.weight]["momentum_buffer"].clone(),
            "rank_state": restored.rank_state}


def test_an_earlier_single_file_checkpoint_still_resumes_on_two_ranks(tmp_path):
    centres = torch.arange(NUM_CLASSES * DIM, dtype=torch.float32).reshape(NUM_CLASSES, DIM)
    path = tmp_path / LEGACY_NAME
    legacy_checkpoint(path, centres, -centres, world_size=2)
    assert find_resume_source(tmp_path) == (EarlierCheckpoint(), path)
    ranks = run_world(_legacy_in_world, 2, str(path))
    assert torch.equal(torch.cat([r["weight"] for r in ranks]), centres)  # rows 0..3 and 4..6
    assert torch.equal(torch.cat([r["momentum"] for r in ranks]), -centres)
    assert [r["rank_state"]["loader"] for r in ranks] == [{"skipped": 0}, {"skipped": 1}]


def test_resume_sources_and_files_that_are_not_checkpoints(tmp_path):
    (tmp_path / LEGACY_NAME).write_bytes(b"\x00" * 100)  # e.g. truncated by a crash of something else
    with pytest.raises(CheckpointError, match="damaged or not a checkpoint"):
        find_resume_source(tmp_path)
    bare = tmp_path / "model.pt"
    torch.save({"conv1.weight": torch.zeros(1)}, bare)
    assert find_resume_source(bare) == (BareBackbone(), bare)
    with pytest.raises(CheckpointError, match="resume source .*absent does not exist"):
        find_resume_source(tmp_path / "absent")
    (tmp_path / "run").mkdir()
    with pytest.raises(CheckpointError, match="nothing to resume in"):
        find_resume_source(tmp_path / "run")
    (tmp_path / "run" / POINTER_NAME).write_text("{}")
    assert find_resume_source(tmp_path / "run") == (SavedCheckpoint(), tmp_path / "run" / POINTER_NAME)
    with pytest.raises(CheckpointError, match=f"{tmp_path}/run/{POINTER_NAME} is damaged .*carries no checksum"):
        restore_state(tmp_path / "run" / POINTER_NAME, INFO, make_model("sgd"))


def test_a_source_found_on_rank_0_is_the_same_source_on_every_rank(tmp_path):
    """train.py finds the source on rank 0 and broadcasts it (pickled) to the other ranks."""
    (tmp_path / POINTER_NAME).write_text("{}")
    source = find_resume_source(tmp_path)
    assert pickle.loads(pickle.dumps(source)) == source == (SavedCheckpoint(), tmp_path / POINTER_NAME)
    assert source != (BareBackbone(), tmp_path / POINTER_NAME)
