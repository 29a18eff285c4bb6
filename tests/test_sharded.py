"""The training state on disk (checkpoint/sharded.py): sharded through torch.distributed.checkpoint across
world sizes, damaged or foreign checkpoints.

The reference for every resharded tensor is the saving ranks' own shards stacked by hand in rank
order (rows 0..1 from rank 0, 2..3 from rank 1, ...): 7 classes over 4 ranks is 2, 2, 2, 1 rows.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import crc32c
import pytest
import torch

from checkpoint.pointer import POINTER_NAME
from checkpoint.sharded import restore_state, save_state
from tests.distributed_helpers import run_world
from tests.toy_state import INFO, PROGRESS, centre_state, make_model, take_steps
from training.components import SavedPosition
from utils.errors import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("sgd", "adamw")


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


