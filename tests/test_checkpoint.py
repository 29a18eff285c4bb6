"""Checkpoints: sharded through torch.distributed.checkpoint across world sizes, the single-file
layout of earlier versions, atomic writes, damaged or foreign checkpoints.

The reference for every resharded tensor is the saving ranks' own shards stacked by hand in rank
order (rows 0..1 from rank 0, 2..3 from rank 1, ...): 7 classes over 4 ranks is 2, 2, 2, 1 rows.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import crc32c
import pytest
import torch

from checkpoint.checkpointer import HostStaging
from checkpoint.pointer import POINTER_NAME
from checkpoint.run_dir import find_resume_source
from checkpoint.sharded import restore_state, save_state, stage_state
from checkpoint.sources import LEGACY_FORMAT, LEGACY_NAME, BareBackbone, EarlierCheckpoint, SavedCheckpoint
from losses import CombinedMarginLoss
from partial_fc import PartialFC
from tests.distributed_helpers import run_world
from training.components import SavedPosition
from training.memory_plan import memory_plan
from training.state import build_components, build_training_state
from training.step import train_step
from utils.atomic import atomic_save
from utils.config import load_config
from utils.errors import CheckpointError
from utils.lr_scheduler import build_scheduler

NUM_CLASSES, DIM = 7, 3
INFO = {"network": "toy", "network_kwargs": {}, "embedding_size": DIM, "num_classes": NUM_CLASSES}
ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("sgd", "adamw")


def make_model(optimizer_name: str, seed: int = 0) -> SimpleNamespace:
    torch.manual_seed(seed)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, DIM), torch.nn.BatchNorm1d(DIM))
    pfc = PartialFC(CombinedMarginLoss(), DIM, NUM_CLASSES, seed=seed)
    groups = [{"params": list(backbone.parameters())}, {"params": [pfc.weight]}]
    optimizer = (torch.optim.SGD(groups, lr=0.1, momentum=0.9) if optimizer_name == "sgd"
                 else torch.optim.AdamW(groups, lr=0.1))
    model = SimpleNamespace(backbone=backbone, pfc=pfc, optimizer=optimizer,
                            scheduler=build_scheduler(optimizer, 2, 20),
                            scaler=torch.amp.GradScaler("cpu", enabled=False))
    model.components = build_components(model, {})
    return model


def take_steps(model: SimpleNamespace, steps: int = 2) -> None:
    """Steps with a known, row-dependent centre gradient, so optimizer state differs per row."""
    pfc = model.pfc
    for step in range(steps):
        rows = torch.arange(pfc.class_start, pfc.class_start + pfc.num_local, dtype=torch.float32)
        pfc.weight.grad = rows[:, None] * 10 + torch.arange(DIM) + step
        for p in model.backbone.parameters():
            p.grad = torch.ones_like(p)
        model.optimizer.step()
        model.scheduler.step()
    model.backbone(torch.randn(5, 4))  # BatchNorm statistics move too


def centre_state(model: SimpleNamespace) -> dict:
    """The centres and their optimizer state (momentum or Adam moments and step), cloned."""
    state = model.optimizer.state[model.pfc.weight]
    return {"weight": model.pfc.weight.detach().clone(), **{k: v.clone() for k, v in state.items()}}


# What a run saves beside the tensors (training.state.StepCounter.saved()), a resume reads back.
PROGRESS = {"global_step": 2, "steps_per_epoch": 10, "nonfinite_total": 0}


def save_in_world(rank: int, world_size: int, folder: str, optimizer_name: str) -> dict:
    model = make_model(optimizer_name, seed=1)
    take_steps(model)
    save_state(folder, model, PROGRESS, SavedPosition({"skipped": rank}), INFO, {"lr": 0.1})
    return {"centres": centre_state(model), "backbone": {k: v.clone() for k, v in model.backbone.state_dict().items()}}


def restore_in_world(rank: int, world_size: int, folder: str, optimizer_name: str) -> dict:
    model = make_model(optimizer_name, seed=2)  # other weights: everything must come from the checkpoint
    restored = restore_state(Path(folder) / POINTER_NAME, INFO, model)
    return {"centres": centre_state(model), "backbone": model.backbone.state_dict(), "restored": restored,
            "lr": model.optimizer.param_groups[1]["lr"]}


@pytest.fixture(scope="module")
def written_by_four(tmp_path_factory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("dcp")
    return root, run_world(_save_both, 4, str(root))


def _save_both(rank: int, world_size: int, root: str) -> dict:
    return {name: save_in_world(rank, world_size, f"{root}/{name}", name) for name in OPTIMIZERS}


def _restore_both(rank: int, world_size: int, root: str) -> dict:
    return {name: restore_in_world(rank, world_size, f"{root}/{name}", name) for name in OPTIMIZERS}


@pytest.fixture(scope="module")
def restored(written_by_four) -> dict[int, list]:
    root, _ = written_by_four
    return {1: [_restore_both(0, 1, str(root))],  # no process group at all
            2: run_world(_restore_both, 2, str(root)), 3: run_world(_restore_both, 3, str(root))}


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_written_by_four_resumes_on_one_two_and_three_bit_for_bit(written_by_four, restored, world_size,
                                                                   optimizer_name):
    _, saved = written_by_four
    names = sorted(saved[0][optimizer_name]["centres"])
    assert set(names) >= {"weight", "momentum_buffer"} if optimizer_name == "sgd" else {"weight", "exp_avg"}
    for name in names:
        pieces = [rank[optimizer_name]["centres"][name] for rank in saved]
        whole = torch.cat(pieces) if pieces[0].dim() == 2 else pieces[0]  # Adam's step is one scalar
        assert [p.shape[0] for p in pieces if p.dim() == 2] in ([], [2, 2, 2, 1])
        again = torch.cat([rank[optimizer_name]["centres"][name] for rank in restored[world_size]]) \
            if whole.dim() == 2 else restored[world_size][0][optimizer_name]["centres"][name]
        assert again.dtype == whole.dtype and torch.equal(again, whole), name
    for rank in restored[world_size]:
        mine = rank[optimizer_name]
        for key, value in saved[0][optimizer_name]["backbone"].items():  # BatchNorm buffers included
            assert torch.equal(mine["backbone"][key], value), key
        assert mine["lr"] == pytest.approx(0.1)  # the schedule came back at step 2: warmup done
        assert mine["restored"].progress == PROGRESS
        assert mine["restored"].world_size == 4 and mine["restored"].first_rank_state["loader"] == {"skipped": 0}
        assert mine["restored"].rank_state is None  # another world size: no rank has its own streams back


def test_each_rank_writes_only_its_own_rows(written_by_four):
    """Four files, one per rank, the centre rows of rank r only in rank r's file; beside them rank 0's
    backbone, the state as JSON and the manifest."""
    root, _ = written_by_four
    folder = root / "sgd" / json.loads((root / "sgd" / POINTER_NAME).read_text())["directory"]
    assert sorted(p.name for p in folder.iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)] + [
        "backbone.pth", "manifest.json", "model.json", "state.json"]
    metadata = torch.distributed.checkpoint.FileSystemReader(folder).read_metadata()
    chunks = metadata.state_dict_metadata["centres"].chunks
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [
        ((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (2, 3)), ((6, 0), (1, 3))]


def _missing_shard_in_world(rank: int, world_size: int, folder: str) -> str:
    try:
        restore_in_world(rank, world_size, folder, "sgd")
    except CheckpointError as error:
        return str(error)
    return "restored"


def test_a_missing_shard_stops_every_rank_with_the_same_error(tmp_path):
    run_world(_save_both, 2, str(tmp_path))
    folder = tmp_path / "sgd" / json.loads((tmp_path / "sgd" / POINTER_NAME).read_text())["directory"]
    (folder / "__1_0.distcp").unlink()
    messages = run_world(_missing_shard_in_world, 2, str(tmp_path / "sgd"))
    assert messages[0] == messages[1] == (
        f"checkpoint {folder} is damaged ({folder / '__1_0.distcp'} is missing); no other checkpoint is left in the "
        "run folder: copy the folder again from a backup, or start a new run")


def test_another_model_is_refused_with_the_difference(written_by_four):
    root, _ = written_by_four
    with pytest.raises(CheckpointError, match=r"another model \(network 'toy' there, 'r50' here; "
                                              r"embedding_size 3 there, 512 here\)"):
        restore_state(root / "sgd" / POINTER_NAME, {**INFO, "embedding_size": 512, "network": "r50"},
                      make_model("sgd"))


def test_a_new_save_switches_atomically_and_removes_the_old_folder(tmp_path):
    model = make_model("sgd")
    take_steps(model)
    save_state(tmp_path, model, {"global_step": 2}, SavedPosition({}), INFO, {})
    (tmp_path / ".tmp-checkpoint-000000003").mkdir()  # a save that a killed run left half-written
    take_steps(model)
    save_state(tmp_path, model, {"global_step": 4}, SavedPosition({}), INFO, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backbone.pth", "checkpoint-000000004", POINTER_NAME,
                                                          "model.json"]
    assert json.loads((tmp_path / POINTER_NAME).read_text())["global_step"] == 4


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


def test_atomic_save_replaces_whole_files_and_clears_leftovers(tmp_path):
    path = tmp_path / POINTER_NAME
    stale = tmp_path / f".tmp-{POINTER_NAME}.12345"
    stale.write_bytes(b"half a file")
    atomic_save({"x": torch.ones(3)}, path)
    assert torch.equal(torch.load(path)["x"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [POINTER_NAME]


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    """A real write failure: the file-size limit (as a full disk would) stops the write half-way."""
    path = tmp_path / "backbone.pth"
    atomic_save({"generation": 1}, path)
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from utils.atomic import atomic_save
        from utils.errors import CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            atomic_save({{"generation": 2, "big": torch.zeros(1 << 20)}}, {str(path)!r})
        except CheckpointError as error:
            print(error)
            sys.exit(3)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 3, result.stderr
    assert "could not write" in result.stdout and "previous backbone.pth is untouched" in result.stdout
    assert torch.load(path) == {"generation": 1}
    assert os.listdir(tmp_path) == ["backbone.pth"]


def _rewrite_pointer(pointer: Path, **changes) -> None:
    """checkpoint.json with `changes` (None: the field removed) and a checksum that matches them, as a hostile
    or careless hand would write it; the checksum is computed here with crc32c and plain json."""
    content = json.loads(pointer.read_text())
    del content["crc32c"]
    for key, value in changes.items():
        if value is None:
            del content[key]
        else:
            content[key] = value
    content["crc32c"] = crc32c.crc32c(json.dumps(content, sort_keys=True).encode())
    pointer.write_text(json.dumps(content))


@pytest.mark.parametrize("changes, reason", [
    ({"directory": "../elsewhere/checkpoint-000000002"}, "its directory '../elsewhere/checkpoint-000000002' is not a "
                                                         "checkpoint folder beside it"),
    ({"directory": "/tmp"}, "its directory '/tmp' is not a checkpoint folder beside it"),
    ({"model": None}, "its 'model' is missing or not a dict"),
    ({"world_size": None}, "its 'world_size' is missing or not a int"),
    ({"global_step": "2"}, "its 'global_step' is missing or not a int"),
])
def test_a_pointer_that_leaves_the_run_folder_or_lacks_a_field_is_one_line(tmp_path, changes, reason):
    """A copy of a good checkpoint waits where `../elsewhere` points: it must not be followed."""
    run = tmp_path / "run"
    model = make_model("sgd")
    save_state(run, model, PROGRESS, SavedPosition({"skipped": 0}), INFO, {})
    (tmp_path / "elsewhere").mkdir()
    shutil.copytree(run / "checkpoint-000000002", tmp_path / "elsewhere" / "checkpoint-000000002")
    _rewrite_pointer(run / POINTER_NAME, **changes)
    with pytest.raises(CheckpointError) as raised:
        restore_state(run / POINTER_NAME, INFO, make_model("sgd", seed=3))
    assert str(raised.value) == (f"{run / POINTER_NAME} is damaged ({reason}); resume from one of the "
                                 f"checkpoint-<step> folders beside it with --set resume={run}/checkpoint-<step>, or "
                                 "start a new run")


@pytest.mark.parametrize("ema", ["ema_decay=0.0", "ema_decay=0.9"])
def test_the_memory_plan_counts_the_async_staging_copy(ema):
    """`host_checkpoint_staging` is what HostStaging holds after a real step's save: the centres, the backbone's
    state_dict and the momentum of both (none for arcface_torch's frozen `features.weight`); with the backbone's
    EMA, its trained parameters too."""
    cfg = load_config(ROOT / "configs" / "synthetic_pair.py", [
        "rec=synthetic", "network=r18", "network_kwargs={'width_mult': 0.0625}", "embedding_size=16",
        "num_views=1", "batch_size=2", "optimizer=sgd", "momentum=0.9", ema])
    state = build_training_state(cfg, 10, torch.device("cpu"), steps_per_epoch=5)
    images = torch.randint(0, 256, (2, 1, 3, 112, 112), dtype=torch.uint8)
    train_step(state, [(images, torch.tensor([1, 7]))], cfg)
    staging = HostStaging()
    stage_state(state, {"global_step": 1}, SavedPosition({}), {}, {}, staging.copy)
    staged = sum(t.numel() * t.element_size() for t in staging._buffers.values())
    assert memory_plan(cfg, 10, 1)["host_checkpoint_staging"] == staged
    assert memory_plan(load_config(ROOT / "configs" / "synthetic_pair.py", ["async_save=False"]), 10, 1)[
        "host_checkpoint_staging"] == 0
