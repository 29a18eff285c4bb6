"""The training state on disk: one torch.distributed.checkpoint (DCP) folder per save, published by a
small pointer file.

In the run folder:
- `checkpoint-<step>/`: a DCP checkpoint that every rank writes at once. The backbone is rank 0's
  (every rank loads it); the class centres and their optimizer state are shards of the global
  (num_classes, D) matrices: each rank writes and reads only its own rows, and a run on another world
  size reads its rows from whichever files hold them. Beside them: the rest of the optimizer state,
  schedule, grad scaler, progress, config and architecture ("run"), and each rank's loader state
  and random streams ("rank/<r>"). No process ever holds all centres, on saving or on loading.
- `checkpoint.json`: `{"format", "directory", "global_step", "world_size", "model"}`, naming the
  folder that is the checkpoint. It is replaced atomically only after the new folder is complete on
  every rank, so a crash at any moment leaves the previous checkpoint whole; older folders are
  removed after the switch, and a half-written one is removed by the next save.

DCP folders hold pickles: resume only from checkpoints you wrote yourself.
"""
from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.restored import Restored, check_architecture, is_centre_rows, optimizer_index
from checkpoint.rng import rng_state
from partial_fc import PartialFC
from training.state import TrainingState
from utils.atomic import atomic_save, fsync_dir, os_error_behind, write_bytes
from utils.distributed import agreed, barrier, is_initialized, is_main, rank, world
from utils.errors import CheckpointError

FORMAT = "pairface-checkpoint-2"
POINTER_NAME = "checkpoint.json"
FOLDER_PREFIX = "checkpoint-"


# --- saving ---------------------------------------------------------------------------------------

def save_state(output: str | Path, state: TrainingState, progress: Mapping, loader_state: Mapping,
               architecture: Mapping, config: Mapping) -> Path:
    """Write `state` as `output/checkpoint-<step>/` and switch
    `checkpoint.json` to it. Collective: every rank calls it. Returns the folder."""
    output = Path(output)
    folder = output / f"{FOLDER_PREFIX}{progress['global_step']:09d}"
    if is_main():
        shutil.rmtree(folder, ignore_errors=True)  # this step's save by a run killed while writing it
    barrier()
    content = _tensors(state)
    content["run"] = pickle.dumps({
        "model": dict(architecture), "config": dict(config), "world_size": world(), "progress": dict(progress),
        "param_groups": state.optimizer.state_dict()["param_groups"], "scheduler": state.scheduler.state_dict(),
        "grad_scaler": state.scaler.state_dict()})
    content[f"rank/{rank()}"] = pickle.dumps({"rng": rng_state(), "loader": dict(loader_state)})
    try:
        with _quiet_when_alone():
            dcp.save(content, checkpoint_id=folder, no_dist=not is_initialized())
    except CheckpointException as error:  # raised on every rank, whichever failed
        if is_main():
            shutil.rmtree(folder, ignore_errors=True)
        raise _failure("could not write", folder, error, "the previous checkpoint is untouched: free disk space "
                       "or choose another output folder") from None
    pointer = {"format": FORMAT, "directory": folder.name, "global_step": progress["global_step"],
               "world_size": world(), "model": dict(architecture)}
    agreed(lambda: _publish(output, folder, pointer))
    barrier()  # on return the checkpoint is published for every rank
    return folder


def _publish(output: Path, folder: Path, pointer: dict) -> None:
    """Rank 0, once every rank's files are complete: point checkpoint.json at `folder`, then drop older folders."""
    fsync_dir(folder)
    atomic_save(json.dumps(pointer, indent=2).encode(), output / POINTER_NAME, write=write_bytes)
    for old in output.glob(f"{FOLDER_PREFIX}*"):
        if old != folder and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _tensors(state: TrainingState) -> dict:
    """Backbone, centres and optimizer tensors, the centre-shaped ones marked as shards of the global matrix."""
    pfc = state.pfc
    centres_at = optimizer_index(state.optimizer, pfc.weight)
    optimizer_state = {index: {name: _shard(pfc, value) if index == centres_at and _is_rows(value, pfc) else value
                               for name, value in per_param.items()}
                       for index, per_param in state.optimizer.state_dict()["state"].items()}
    tensors = {"centres": _shard(pfc, pfc.weight), "optimizer": optimizer_state}
    if is_main():
        # Rank 0's backbone, as backbone.pth: DDP keeps the weights equal on every rank, but each rank's
        # BatchNorm statistics follow its own batches, and DCP would write any one rank's copy.
        tensors["backbone"] = state.backbone.state_dict()
    return tensors


def _shard(pfc: PartialFC, rows: torch.Tensor) -> torch.Tensor:
    """`rows` (this rank's, shaped like the centres) as DCP's CheckpointableTensor: a slice of the
    (num_classes, ...) matrix at this rank's first class. DTensor cannot say this: its uneven shards
    follow torch.chunk, not arcface_torch's split that PartialFC uses."""
    shard = rows.detach()  # a new tensor object on the same memory: the attributes stay off the parameter
    shard.global_shape = (pfc.num_classes, *rows.shape[1:])
    shard.global_offsets = ((pfc.class_start, *[0] * (rows.dim() - 1)),)
    shard.local_offsets = ((0,) * rows.dim(),)
    shard.local_sizes = (tuple(rows.shape),)
    return shard


def _is_rows(value, pfc: PartialFC) -> bool:
    return is_centre_rows(value, *pfc.weight.shape)


# --- loading --------------------------------------------------------------------------------------

def read_pointer(pointer: Path) -> dict:
    """checkpoint.json, with the optimizer tensors its folder holds ({fqn: (shape, dtype)})."""
    try:
        saved = json.loads(pointer.read_text())
        folder = pointer.parent / saved["directory"]
        metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except (OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError, EOFError) as error:
        raise CheckpointError(f"cannot read the checkpoint {pointer} names ({type(error).__name__}: {error}); it is "
                              "damaged or incomplete: resume from another run folder or start a new run") from None
    saved["optimizer_tensors"] = {fqn: (tuple(md.size), md.properties.dtype) for fqn, md in metadata.items()
                                  if fqn.startswith("optimizer.") and hasattr(md, "size")}
    return saved


def restore_state(pointer: Path, architecture: Mapping, state: TrainingState) -> Restored:
    """Load the checkpoint `pointer` names into `state`, each rank its own centre rows.
    Collective. A checkpoint that cannot be read on any rank stops every rank with the same CheckpointError."""
    saved = agreed(lambda: _checked_pointer(pointer, architecture))
    folder = pointer.parent / saved["directory"]
    own = f"rank/{rank()}" if saved["world_size"] == world() else None
    loaded = {**_template(state, saved["optimizer_tensors"]), "run": b"", "rank/0": b""}
    if own:
        loaded[own] = b""
    try:
        with _quiet_when_alone():
            dcp.load(loaded, checkpoint_id=folder, no_dist=not is_initialized())
    except CheckpointException as error:
        raise _failure("cannot read", folder, error, "it is damaged or incomplete: resume from another run folder "
                       "or start a new run") from None
    run = pickle.loads(loaded["run"])
    state.optimizer.load_state_dict({"state": loaded["optimizer"], "param_groups": run["param_groups"]})
    state.scheduler.load_state_dict(run["scheduler"])
    state.scaler.load_state_dict(run["grad_scaler"])
    return Restored(progress=run["progress"], world_size=run["world_size"], config=run["config"],
                    rank_state=pickle.loads(loaded[own]) if own else None,
                    first_rank_state=pickle.loads(loaded["rank/0"]))


def _checked_pointer(pointer: Path, architecture: Mapping) -> dict:
    saved = read_pointer(pointer)
    check_architecture(saved["model"], architecture, pointer)
    return saved


def _template(state: TrainingState, optimizer_tensors: Mapping[str, tuple]) -> dict:
    """Where the loaded tensors go: the backbone's and this rank's centres in place, the optimizer's
    into new tensors of the saved shapes (this rank's rows of the centre-shaped ones)."""
    pfc = state.pfc
    centres_at = optimizer_index(state.optimizer, pfc.weight)
    optimizer_state: dict[int, dict] = {}
    for fqn, (shape, dtype) in optimizer_tensors.items():
        _, index, name = fqn.split(".")
        if int(index) == centres_at and shape == (pfc.num_classes, *pfc.weight.shape[1:]):
            value = _shard(pfc, torch.empty(pfc.weight.shape, dtype=dtype))
        else:
            value = torch.empty(shape, dtype=dtype)
        optimizer_state.setdefault(int(index), {})[name] = value
    return {"backbone": state.backbone.state_dict(), "centres": _shard(pfc, pfc.weight), "optimizer": optimizer_state}


@contextlib.contextmanager
def _quiet_when_alone() -> Iterator[None]:
    """DCP warns at every save and load without a process group; one process is a supported setup here."""
    with warnings.catch_warnings():
        if not is_initialized():
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def _failure(what: str, folder: Path, error: CheckpointException, advice: str) -> CheckpointError:
    """One sentence for every rank from DCP's collected per-rank failures: the first failed rank's
    system error (disk full, file missing) if there is one behind it, else its exception."""
    failed_rank, (cause, _) = sorted(error.failures.items())[0]
    system = os_error_behind(cause)
    if system is not None and system.strerror:
        detail = system.strerror + (f": {system.filename}" if system.filename else "")
    else:
        detail = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
    return CheckpointError(f"{what} checkpoint {folder} (rank {failed_rank}: {detail}); {advice}")
