"""Checkpoints: everything a run needs to continue exactly, written so that a crash never costs
the previous one.

Layout of a run folder:
- `checkpoint.pt`: one file, written by rank 0: backbone, the FULL class-centre matrix (gathered
  from every rank's shard) and its optimizer state, the rest of the optimizer state, LR scheduler,
  grad scaler, step/epoch, every rank's loader position and RNG states, the config and the model
  identity (network, its kwargs, embedding size, class count). Because the centres are stored
  whole, a run can resume on any number of processes: each rank slices its own range again.
- `backbone.pth`: the plain backbone state_dict (unwrapped, CPU tensors), as arcface_torch saves
  it, so either project loads the other's with strict=True.
- `model.json`: what network `backbone.pth` belongs to (network, network_kwargs, embedding_size,
  num_classes), so that tools given the run folder need no more options.

Writes go to a hidden temporary file in the same folder, are fsynced, then renamed over the old
file (`os.replace` is atomic), and the folder is fsynced. A crash at any moment leaves either the
old or the new complete file; leftover temporaries start with "." and are never read, and are
removed by the next save.
"""
from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch
from torch import nn

from backbones import load_backbone
from utils.distributed import barrier, gather_objects, is_main, rank, world
from utils.errors import CheckpointError
from utils.lr_scheduler import jump_to_step

CHECKPOINT_NAME = "checkpoint.pt"
BACKBONE_NAME = "backbone.pth"
MODEL_INFO_NAME = "model.json"
FORMAT = "pairface-checkpoint-1"
_TMP_PREFIX = ".tmp-"

log = logging.getLogger(__name__)


def atomic_save(obj, path: str | os.PathLike, write: Callable[[object, IO[bytes]], object] = torch.save) -> None:
    """Write `obj` to `path` (with torch.save, or `write(obj, binary_file)`) so that `path` is always
    either the old or the new complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"{_TMP_PREFIX}{path.name}.*"):
        stale.unlink(missing_ok=True)  # left by a process killed mid-write
    tmp = path.parent / f"{_TMP_PREFIX}{path.name}.{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            write(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:  # including KeyboardInterrupt: never leave a half-written file behind
        tmp.unlink(missing_ok=True)
        cause = _os_error(error)
        if cause is None:
            raise
        raise CheckpointError(f"could not write {path} ({cause.strerror or cause}); the previous {path.name} "
                              "is untouched: free disk space or choose another output folder") from error
    _fsync_dir(path.parent)


def _os_error(error: BaseException | None) -> OSError | None:
    """The OSError behind `error`: torch.save reports a failed write (disk full, file too large) as a
    RuntimeError raised while handling it."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """A (plain, not DDP-wrapped) module's state_dict with CPU tensors."""
    return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}


def save_backbone(backbone: nn.Module, output_dir: str | os.PathLike, model_info: Mapping) -> Path:
    """Write `output_dir/backbone.pth` and `model.json` (rank 0 only; other ranks return the path untouched)."""
    path = Path(output_dir) / BACKBONE_NAME
    if is_main():
        atomic_save(json.dumps(dict(model_info), indent=2).encode(), path.parent / MODEL_INFO_NAME,
                    write=lambda data, handle: handle.write(data))
        atomic_save(cpu_state_dict(backbone), path)
    return path


def rng_state() -> dict:
    """This process's random generators, in types `torch.load(weights_only=True)` accepts."""
    _, keys, position, has_gauss, cached_gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping) -> None:
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    keys, position, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _state_index(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> int:
    """The number optimizer.state_dict() gives `param` (parameters counted in group order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return next(i for i, p in enumerate(params) if p is param)


def _is_class_rows(value, num_rows: int, width: int) -> bool:
    return torch.is_tensor(value) and tuple(value.shape) == (num_rows, width)


def _cpu(value):
    return value.detach().cpu() if torch.is_tensor(value) else value


def _optimizer_state_full(optimizer: torch.optim.Optimizer, pfc) -> dict | None:
    """optimizer.state_dict() with the centres' per-row state (momentum, Adam moments) made whole,
    on rank 0 (None elsewhere). Collective."""
    state = optimizer.state_dict()  # its per-parameter dicts are the live ones: build new dicts, never assign into them
    index = _state_index(optimizer, pfc.weight)
    shard_state = state["state"].get(index, {})
    whole = {}
    # the same gathers in the same order on every rank: every rank's centre state has the same keys
    for name in sorted(shard_state):
        value = shard_state[name]
        whole[name] = pfc.gather_rows(value) if _is_class_rows(value, *pfc.weight.shape) else _cpu(value)
    if not is_main():
        return None
    per_param = {i: whole if i == index else {k: _cpu(v) for k, v in s.items()} for i, s in state["state"].items()}
    return {"state": per_param, "param_groups": state["param_groups"]}


def _optimizer_state_mine(saved: Mapping, optimizer: torch.optim.Optimizer, pfc) -> dict:
    """A saved whole optimizer state cut down to this rank's centre rows."""
    index = _state_index(optimizer, pfc.weight)
    per_param = dict(saved["state"])
    if index in per_param:
        per_param[index] = {name: pfc.local_rows(value)
                            if _is_class_rows(value, pfc.num_classes, pfc.embedding_size) else value
                            for name, value in per_param[index].items()}
    return {"state": per_param, "param_groups": saved["param_groups"]}


def save_checkpoint(output_dir: str | os.PathLike, *, backbone: nn.Module, pfc: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler, grad_scaler, progress: Mapping,
                    loader_state, model_info: Mapping, config: Mapping) -> Path:
    """Write `output_dir/checkpoint.pt` (collective: every rank calls it, rank 0 writes).

    `progress` holds the loop's counters (global_step, epoch, ...); `loader_state` is this rank's
    data position; `model_info` identifies the model (network, network_kwargs, embedding_size,
    num_classes) so that a mismatched resume is refused with a clear message.
    """
    path = Path(output_dir) / CHECKPOINT_NAME
    centres = pfc.gather_rows(pfc.weight)
    optimizer_state = _optimizer_state_full(optimizer, pfc)
    per_rank = gather_objects({"rng": rng_state(), "loader": loader_state})
    if is_main():
        atomic_save({
            "format": FORMAT,
            "model": dict(model_info),
            "config": dict(config),
            "world_size": world(),
            "progress": dict(progress),
            "backbone": cpu_state_dict(backbone),
            "class_centres": centres,
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
            "grad_scaler": grad_scaler.state_dict(),
            "per_rank": per_rank,
        }, path)
    barrier()  # on return the file exists for every rank
    return path


def find_resume_source(location: str | os.PathLike) -> tuple[str, Path]:
    """("checkpoint" | "backbone", file) for a run folder or a file; CheckpointError if there is none."""
    location = Path(location)
    if location.is_dir():
        found = [location / name for name in (CHECKPOINT_NAME, BACKBONE_NAME) if (location / name).is_file()]
        if not found:
            raise CheckpointError(f"nothing to resume in {location}: it holds neither {CHECKPOINT_NAME} nor "
                                  f"{BACKBONE_NAME}; start a new run without --resume, or point resume at a checkpoint")
        location = found[0]
    elif not location.is_file():
        raise CheckpointError(f"resume source {location} does not exist; point resume at a run folder, "
                              f"a {CHECKPOINT_NAME} or a backbone .pth file")
    return ("checkpoint" if _read(location).get("format") == FORMAT else "backbone"), location


def _read(path: Path) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # truncated, not a torch file, or unpicklable content: all "unreadable"
        raise CheckpointError(f"cannot read {path} ({type(error).__name__}); it is damaged or not a "
                              "checkpoint: resume from another file or start a new run") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a checkpoint or a state_dict")
    return obj


def load_checkpoint(path: str | os.PathLike, model_info: Mapping) -> dict:
    """Read a full checkpoint and refuse one written for a different model."""
    path = Path(path)
    checkpoint = _read(path)
    if checkpoint.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a pairface checkpoint (format {checkpoint.get('format')!r}); "
                              "resume from a checkpoint.pt written by train.py")
    saved = checkpoint["model"]
    differences = [f"{key} {saved.get(key)!r} there, {value!r} here" for key, value in model_info.items()
                   if saved.get(key) != value]
    if differences:
        raise CheckpointError(f"{path} was written for another model ({'; '.join(differences)}); resume with the "
                              "config that wrote it, or start a new output folder")
    return checkpoint


def restore_training_state(checkpoint: Mapping, *, backbone: nn.Module, pfc: nn.Module,
                           optimizer: torch.optim.Optimizer, scheduler, grad_scaler) -> None:
    """Put a checkpoint's weights and optimizer/scheduler/scaler state into this run, re-slicing
    the class centres (and their optimizer state) for this run's world size."""
    backbone.load_state_dict(checkpoint["backbone"], strict=True)
    with torch.no_grad():
        pfc.weight.copy_(pfc.local_rows(checkpoint["class_centres"]))
    optimizer.load_state_dict(_optimizer_state_mine(checkpoint["optimizer"], optimizer, pfc))
    scheduler.load_state_dict(checkpoint["scheduler"])
    grad_scaler.load_state_dict(checkpoint["grad_scaler"])


def my_rank_state(checkpoint: Mapping) -> dict | None:
    """This rank's saved loader position and RNG states, when the world size is unchanged (else None:
    positions and random streams of a different split have no exact counterpart)."""
    if checkpoint["world_size"] != world():
        return None
    return checkpoint["per_rank"][rank()]


@dataclass
class Progress:
    """Where a run stands: optimizer steps taken (skipped ones included) and non-finite losses met."""

    global_step: int = 0
    steps_per_epoch: int = 1
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0

    @property
    def epoch(self) -> int:
        return self.global_step // self.steps_per_epoch

    def saved(self) -> dict:
        return {"global_step": self.global_step, "epoch": self.epoch, "steps_per_epoch": self.steps_per_epoch,
                "nonfinite_total": self.nonfinite_total}


class Checkpointer:
    """The training loop's one contact with checkpoints: the resume at the start, then every save.

    A save is due every `save_every_steps` steps, at each epoch end and at the end of the run; one
    that falls inside a streak of non-finite losses waits for the next step taken, so the last good
    checkpoint stays as it was (the end of the run saves in any case). `model` is train.Model: the
    backbone, the PartialFC, the optimizer over both, the LR scheduler and the grad scaler.
    """

    def __init__(self, output: str, model, loader, model_info: Mapping, config: Mapping, *,
                 save_every_steps: int = 0, save_all_states: bool = True) -> None:
        self.output, self.model, self.loader = output, model, loader
        self.model_info, self.config = dict(model_info), dict(config)
        self.save_every_steps, self.save_all_states = save_every_steps, save_all_states
        self._saved_at = -1
        self._waiting = False  # a save fell inside a non-finite streak

    def resume(self, source: tuple[str, Path], progress: Progress) -> None:
        """Load `source` (("checkpoint" | "backbone", file)) into the run and `progress`."""
        kind, path = source
        if kind == "backbone":
            self._start_from_backbone(path)
            return
        checkpoint = load_checkpoint(path, self.model_info)
        model = self.model
        restore_training_state(checkpoint, backbone=model.backbone, pfc=model.pfc, optimizer=model.optimizer,
                               scheduler=model.scheduler, grad_scaler=model.scaler)
        saved = checkpoint["progress"]
        progress.nonfinite_total = saved["nonfinite_total"]
        mine = my_rank_state(checkpoint)
        if saved["steps_per_epoch"] == progress.steps_per_epoch and mine is not None:
            progress.global_step = saved["global_step"]
            self.loader.load_state_dict(mine["loader"])
            set_rng_state(mine["rng"])
        else:
            self._renumber(checkpoint, progress)
        log.info("resumed from %s at global step %d (epoch %d), lr %.6f", path, progress.global_step, progress.epoch,
                 model.optimizer.param_groups[0]["lr"])
        _log_config_changes(checkpoint["config"], self.config)

    def _renumber(self, checkpoint: Mapping, progress: Progress) -> None:
        """Another world size, batch size or accumulation: keep the fraction of training done, so the LR
        schedule and the epoch go on where they were (the exact sample order cannot)."""
        saved = checkpoint["progress"]
        progress.global_step = round(saved["global_step"] * progress.steps_per_epoch / saved["steps_per_epoch"])
        jump_to_step(self.model.scheduler, progress.global_step)
        self.loader.load_state_dict(checkpoint["per_rank"][0]["loader"])
        log.warning("resuming a run of %d process(es) and %d steps per epoch with %d and %d: step %d becomes step "
                    "%d; the data order of this epoch differs from the original run", checkpoint["world_size"],
                    saved["steps_per_epoch"], world(), progress.steps_per_epoch, saved["global_step"],
                    progress.global_step)

    def _start_from_backbone(self, path: Path) -> None:
        info = self.model_info
        weights = load_backbone(info["network"], path, num_features=info["embedding_size"], **info["network_kwargs"])
        self.model.backbone.load_state_dict(weights.state_dict())
        log.info("initialised the backbone from %s (a bare backbone: class centres, optimizer and schedule "
                 "start fresh)", path)

    def after_step(self, progress: Progress, final: bool = False) -> None:
        """Save if a save is due after this step (`final`: the last step of the run)."""
        step = progress.global_step
        every = self.save_every_steps
        due = self._waiting or final or step % progress.steps_per_epoch == 0 or (every and step % every == 0)
        if not due or step == self._saved_at:
            return
        self._waiting = progress.nonfinite_in_a_row > 0 and not final
        if not self._waiting:
            self.save(progress)

    def save(self, progress: Progress) -> None:
        model = self.model
        if self.save_all_states:
            path = save_checkpoint(self.output, backbone=model.backbone, pfc=model.pfc, optimizer=model.optimizer,
                                   scheduler=model.scheduler, grad_scaler=model.scaler, progress=progress.saved(),
                                   loader_state=self.loader.state_dict(), model_info=self.model_info,
                                   config=self.config)
            log.info("saved %s at global step %d", path, progress.global_step)
        save_backbone(model.backbone, self.output, self.model_info)
        self._saved_at = progress.global_step

    def last_good(self) -> str:
        """What a stopped run leaves to continue from, for its error message."""
        for name, advice in ((CHECKPOINT_NAME, " (continue with --resume)"), (BACKBONE_NAME, "")):
            if os.path.exists(os.path.join(self.output, name)):
                return f"the last good {name} in {self.output} is untouched{advice}"
        return "no checkpoint had been written yet"


def _log_config_changes(saved: Mapping, current: Mapping) -> None:
    changed = [f"{key}: {saved[key]!r} -> {current[key]!r}" for key in sorted(current)
               if key in saved and saved[key] != current[key] and key != "resume"]
    if changed:
        log.info("config differs from the checkpoint's: %s", "; ".join(changed))
