"""The training state on disk: one torch.distributed.checkpoint (DCP) folder per save, published by a
small pointer file.

In the run folder:
- `checkpoint-<step>/`: a DCP checkpoint that every rank writes at once. The backbone is rank 0's
  (every rank loads it); the class centres and their optimizer state are shards of the global
  (num_classes, D) matrices: each rank writes and reads only its own rows, and a run on another world
  size reads its rows from whichever files hold them. Beside them: the rest of the optimizer state,
  schedule, grad scaler, progress, config and model identity ("run"), and each rank's loader state
  and random streams ("rank/<r>"). No process ever holds all centres, on saving or on loading.
- `checkpoint.json`: `{"format", "directory", "global_step", "world_size", "model"}`, naming the
  folder that is the checkpoint. It is replaced atomically only after the new folder is complete on
  every rank, so a crash at any moment leaves the previous checkpoint whole; older folders are
  removed after the switch, and a half-written one is removed by the next save.
- `checkpoint.pt`: the single-file layout of earlier versions (every centre gathered on rank 0), still
  read: a resume from it writes the new layout at its first save.

DCP folders and `.pt` files hold pickles: resume only from checkpoints you wrote yourself.
"""
from __future__ import annotations

import contextlib
import json
import pickle
import random
import shutil
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from utils.atomic import atomic_save, fsync_dir, os_error_behind, write_bytes
from utils.distributed import barrier, is_initialized, is_main, rank, world
from utils.errors import CheckpointError, agreed

FORMAT = "pairface-checkpoint-2"
LEGACY_FORMAT = "pairface-checkpoint-1"
POINTER_NAME = "checkpoint.json"
LEGACY_NAME = "checkpoint.pt"
FOLDER_PREFIX = "checkpoint-"


@dataclass
class Restored:
    """What a checkpoint tells the loop beyond the state it put in place."""

    progress: dict
    world_size: int
    config: dict
    rank_state: dict | None  # this rank's loader state and random streams; None when the world size changed
    first_rank_state: dict   # rank 0's, whose loader state stands in on another world size


# --- saving ---------------------------------------------------------------------------------------

def save_state(output: str | Path, model, progress: Mapping, loader_state: Mapping, model_info: Mapping,
               config: Mapping) -> Path:
    """Write the training state of `model` (train.Model) as `output/checkpoint-<step>/` and switch
    `checkpoint.json` to it. Collective: every rank calls it. Returns the folder."""
    output = Path(output)
    folder = output / f"{FOLDER_PREFIX}{progress['global_step']:09d}"
    if is_main():
        shutil.rmtree(folder, ignore_errors=True)  # this step's save by a run killed while writing it
    barrier()
    state = _tensors(model)
    state["run"] = pickle.dumps({
        "model": dict(model_info), "config": dict(config), "world_size": world(), "progress": dict(progress),
        "param_groups": model.optimizer.state_dict()["param_groups"], "scheduler": model.scheduler.state_dict(),
        "grad_scaler": model.scaler.state_dict()})
    state[f"rank/{rank()}"] = pickle.dumps({"rng": rng_state(), "loader": dict(loader_state)})
    try:
        with _quiet_when_alone():
            dcp.save(state, checkpoint_id=folder, no_dist=not is_initialized())
    except CheckpointException as error:  # raised on every rank, whichever failed
        if is_main():
            shutil.rmtree(folder, ignore_errors=True)
        raise _failure("could not write", folder, error, "the previous checkpoint is untouched: free disk space "
                       "or choose another output folder") from None
    pointer = {"format": FORMAT, "directory": folder.name, "global_step": progress["global_step"],
               "world_size": world(), "model": dict(model_info)}
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


def _tensors(model) -> dict:
    """Backbone, centres and optimizer tensors, the centre-shaped ones marked as shards of the global matrix."""
    pfc = model.pfc
    centres_at = _state_index(model.optimizer, pfc.weight)
    optimizer_state = {index: {name: _shard(pfc, value) if index == centres_at and _is_rows(value, pfc) else value
                               for name, value in per_param.items()}
                       for index, per_param in model.optimizer.state_dict()["state"].items()}
    tensors = {"centres": _shard(pfc, pfc.weight), "optimizer": optimizer_state}
    if is_main():
        # Rank 0's backbone, as backbone.pth: DDP keeps the weights equal on every rank, but each rank's
        # BatchNorm statistics follow its own batches, and DCP would write any one rank's copy.
        tensors["backbone"] = model.backbone.state_dict()
    return tensors


def _shard(pfc, rows: torch.Tensor) -> torch.Tensor:
    """`rows` (this rank's, shaped like the centres) as DCP's CheckpointableTensor: a slice of the
    (num_classes, ...) matrix at this rank's first class. DTensor cannot say this: its uneven shards
    follow torch.chunk, not arcface_torch's split that PartialFC uses."""
    shard = rows.detach()  # a new tensor object on the same memory: the attributes stay off the parameter
    shard.global_shape = (pfc.num_classes, *rows.shape[1:])
    shard.global_offsets = ((pfc.class_start, *[0] * (rows.dim() - 1)),)
    shard.local_offsets = ((0,) * rows.dim(),)
    shard.local_sizes = (tuple(rows.shape),)
    return shard


def _is_rows(value, pfc) -> bool:
    return torch.is_tensor(value) and tuple(value.shape) == tuple(pfc.weight.shape)


def _state_index(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> int:
    """The number optimizer.state_dict() gives `param` (parameters counted in group order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return next(i for i, p in enumerate(params) if p is param)


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


def check_model(saved_model: Mapping, model_info: Mapping, where: Path) -> None:
    differences = [f"{key} {saved_model.get(key)!r} there, {value!r} here" for key, value in model_info.items()
                   if saved_model.get(key) != value]
    if differences:
        raise CheckpointError(f"{where} was written for another model ({'; '.join(differences)}); resume with the "
                              "config that wrote it, or start a new output folder")


def restore_state(pointer: Path, model_info: Mapping, model) -> Restored:
    """Load the checkpoint `pointer` names into `model` (train.Model), each rank its own centre rows.
    Collective. A checkpoint that cannot be read on any rank stops every rank with the same CheckpointError."""
    saved = agreed(lambda: _checked_pointer(pointer, model_info))
    folder = pointer.parent / saved["directory"]
    own = f"rank/{rank()}" if saved["world_size"] == world() else None
    state = {**_template(model, saved["optimizer_tensors"]), "run": b"", "rank/0": b""}
    if own:
        state[own] = b""
    try:
        with _quiet_when_alone():
            dcp.load(state, checkpoint_id=folder, no_dist=not is_initialized())
    except CheckpointException as error:
        raise _failure("cannot read", folder, error, "it is damaged or incomplete: resume from another run folder "
                       "or start a new run") from None
    run = pickle.loads(state["run"])
    model.optimizer.load_state_dict({"state": state["optimizer"], "param_groups": run["param_groups"]})
    model.scheduler.load_state_dict(run["scheduler"])
    model.scaler.load_state_dict(run["grad_scaler"])
    return Restored(progress=run["progress"], world_size=run["world_size"], config=run["config"],
                    rank_state=pickle.loads(state[own]) if own else None,
                    first_rank_state=pickle.loads(state["rank/0"]))


def _checked_pointer(pointer: Path, model_info: Mapping) -> dict:
    saved = read_pointer(pointer)
    check_model(saved["model"], model_info, pointer)
    return saved


def _template(model, optimizer_tensors: Mapping[str, tuple]) -> dict:
    """Where the loaded tensors go: the backbone's and this rank's centres in place, the optimizer's
    into new tensors of the saved shapes (this rank's rows of the centre-shaped ones)."""
    pfc = model.pfc
    centres_at = _state_index(model.optimizer, pfc.weight)
    optimizer_state: dict[int, dict] = {}
    for fqn, (shape, dtype) in optimizer_tensors.items():
        _, index, name = fqn.split(".")
        if int(index) == centres_at and shape == (pfc.num_classes, *pfc.weight.shape[1:]):
            value = _shard(pfc, torch.empty(pfc.weight.shape, dtype=dtype))
        else:
            value = torch.empty(shape, dtype=dtype)
        optimizer_state.setdefault(int(index), {})[name] = value
    return {"backbone": model.backbone.state_dict(), "centres": _shard(pfc, pfc.weight), "optimizer": optimizer_state}


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


# --- the single-file layout of earlier versions ---------------------------------------------------

def restore_legacy(path: Path, model_info: Mapping, model) -> Restored:
    """Load an earlier version's checkpoint.pt (memory-mapped: each rank touches only its own rows)."""
    checkpoint = read_legacy(path)
    check_model(checkpoint["model"], model_info, path)
    pfc = model.pfc
    model.backbone.load_state_dict(checkpoint["backbone"], strict=True)
    with torch.no_grad():
        pfc.weight.copy_(pfc.local_rows(checkpoint["class_centres"]))
    saved = checkpoint["optimizer"]
    centres_at = _state_index(model.optimizer, pfc.weight)
    state = {index: {name: pfc.local_rows(value) if index == centres_at and torch.is_tensor(value)
                     and value.shape[0] == pfc.num_classes and value.dim() == 2 else value
                     for name, value in per_param.items()}
             for index, per_param in saved["state"].items()}
    model.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    model.scheduler.load_state_dict(checkpoint["scheduler"])
    model.scaler.load_state_dict(checkpoint["grad_scaler"])
    same_world = checkpoint["world_size"] == world()
    return Restored(progress=checkpoint["progress"], world_size=checkpoint["world_size"], config=checkpoint["config"],
                    rank_state=checkpoint["per_rank"][rank()] if same_world else None,
                    first_rank_state=checkpoint["per_rank"][0])


def read_legacy(path: Path) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # truncated, not a torch file, or unpicklable content: all "unreadable"
        raise CheckpointError(f"cannot read {path} ({type(error).__name__}); it is damaged or not a "
                              "checkpoint: resume from another file or start a new run") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a checkpoint or a state_dict; resume "
                              "from a run folder or a backbone .pth file")
    return obj


# --- random streams -------------------------------------------------------------------------------

def rng_state() -> dict:
    """This process's random generators."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping) -> None:
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, (list, tuple)) and torch.is_tensor(numpy_state[0]):  # checkpoint.pt's encoding
        keys, position, has_gauss, cached_gauss = numpy_state
        numpy_state = ("MT19937", keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss)
    np.random.set_state(numpy_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
