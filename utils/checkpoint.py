"""Checkpoints: when a run saves, what a run folder holds, and how a run resumes.

A run folder holds:
- the training state (`checkpoint.json` naming a `checkpoint-<step>/` folder: utils/training_state.py),
  resumable exactly on the same world size and on any other;
- `backbone.pth`: the plain backbone state_dict (unwrapped, CPU tensors), as arcface_torch saves
  it, so either project loads the other's with strict=True;
- `model.json`: what network `backbone.pth` belongs to (network, network_kwargs, embedding_size,
  num_classes), so that tools given the run folder need no more options.

A run also resumes from a folder arcface_torch wrote (utils/arcface_checkpoint.py), on any world size.

Every file is written atomically (utils/atomic.py): a crash at any moment costs no earlier save.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backbones import load_backbone
from utils.arcface_checkpoint import MARKERS, MODEL_FILE, marker_for, restore_arcface
from utils.atomic import atomic_save, write_bytes
from utils.distributed import is_main, world
from utils.errors import CheckpointError
from utils.lr_scheduler import jump_to_step
from utils.training_state import (
    LEGACY_FORMAT,
    LEGACY_NAME,
    POINTER_NAME,
    Restored,
    read_legacy,
    restore_legacy,
    restore_state,
    save_state,
    set_rng_state,
)

BACKBONE_NAME = "backbone.pth"
MODEL_INFO_NAME = "model.json"
# What makes a folder a run worth guarding, in the order a resume prefers them: arcface_torch's rank
# files before its backbone alone (model.pt is all train_v2.py writes by default).
WEIGHTS_NAMES = (POINTER_NAME, LEGACY_NAME, *MARKERS, BACKBONE_NAME, MODEL_FILE)

log = logging.getLogger(__name__)


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """A (plain, not DDP-wrapped) module's state_dict with CPU tensors."""
    return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}


def save_backbone(backbone: nn.Module, output_dir: str | os.PathLike, model_info: Mapping) -> Path:
    """Write `output_dir/backbone.pth` and `model.json` (rank 0 only; other ranks return the path untouched)."""
    path = Path(output_dir) / BACKBONE_NAME
    if is_main():
        atomic_save(json.dumps(dict(model_info), indent=2).encode(), path.parent / MODEL_INFO_NAME, write=write_bytes)
        atomic_save(cpu_state_dict(backbone), path)
    return path


def find_resume_source(location: str | os.PathLike) -> tuple[str, Path]:
    """(kind, file) to resume from a run folder or a file: kind "checkpoint" (checkpoint.json),
    "legacy" (an earlier version's checkpoint.pt), "arcface_torch" (rank 0's file of an arcface_torch
    save, standing for every rank's) or "backbone" (a bare backbone .pth). CheckpointError if there is none."""
    location = Path(location)
    if location.is_file() and marker_for(location) is not None:  # one rank's file: the save it belongs to
        return "arcface_torch", marker_for(location)
    if location.is_dir():
        found = [location / name for name in WEIGHTS_NAMES if (location / name).is_file()]
        if not found:
            raise CheckpointError(f"nothing to resume in {location}: it holds neither {POINTER_NAME} nor "
                                  f"{BACKBONE_NAME}; start a new run without --resume, or point resume at a checkpoint")
        location = found[0]
    elif not location.is_file():
        raise CheckpointError(f"resume source {location} does not exist; point resume at a run folder, "
                              f"a {POINTER_NAME} or a backbone .pth file")
    if location.suffix == ".json":
        return "checkpoint", location
    if location.name in MARKERS:
        return "arcface_torch", location
    return ("legacy" if read_legacy(location).get("format") == LEGACY_FORMAT else "backbone"), location


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
        """Load `source` ((kind, file) from find_resume_source) into the run and `progress`."""
        kind, path = source
        if kind == "backbone":
            self._start_from_backbone(path)
            return
        restore = {"checkpoint": restore_state, "legacy": restore_legacy, "arcface_torch": restore_arcface}[kind]
        restored = restore(path, self.model_info, self.model)
        saved = restored.progress
        progress.nonfinite_total = saved["nonfinite_total"]
        if saved["steps_per_epoch"] == progress.steps_per_epoch and restored.rank_state is not None:
            progress.global_step = saved["global_step"]
            self.loader.load_state_dict(restored.rank_state["loader"])
            set_rng_state(restored.rank_state["rng"])
        elif saved["global_step"]:  # step 0 (arcface_torch's 2021 layout) is step 0 however an epoch is cut
            self._renumber(restored, progress)
        log.info("resumed from %s at global step %d (epoch %d), lr %.6f", path, progress.global_step, progress.epoch,
                 self.model.optimizer.param_groups[0]["lr"])
        _log_config_changes(restored.config, self.config)

    def _renumber(self, restored: Restored, progress: Progress) -> None:
        """Another world size, batch size or accumulation: keep the fraction of training done, so the LR
        schedule and the epoch go on where they were (the exact sample order cannot)."""
        saved = restored.progress
        progress.global_step = round(saved["global_step"] * progress.steps_per_epoch / saved["steps_per_epoch"])
        jump_to_step(self.model.scheduler, progress.global_step)
        self.loader.load_state_dict(restored.first_rank_state["loader"])
        log.warning("resuming a run of %d process(es) and %d steps per epoch with %d and %d: step %d becomes step "
                    "%d; the data order of this epoch differs from the original run", restored.world_size,
                    saved["steps_per_epoch"], world(), progress.steps_per_epoch, saved["global_step"],
                    progress.global_step)

    def _start_from_backbone(self, path: Path) -> None:
        info = self.model_info
        weights = load_backbone(info["network"], path, num_features=info["embedding_size"], **info["network_kwargs"])
        self.model.backbone.load_state_dict(weights.state_dict())
        log.info("initialised the backbone from %s (a bare backbone: class centres, optimizer and schedule "
                 "start fresh)", path)

    def after_step(self, progress: Progress, final: bool = False) -> bool:
        """Save if a save is due after this step (`final`: the last step of the run); whether it saved."""
        step = progress.global_step
        every = self.save_every_steps
        due = self._waiting or final or step % progress.steps_per_epoch == 0 or (every and step % every == 0)
        if not due or step == self._saved_at:
            return False
        self._waiting = progress.nonfinite_in_a_row > 0 and not final
        if not self._waiting:
            self.save(progress)
        return not self._waiting

    def save(self, progress: Progress) -> None:
        if self.save_all_states:
            folder = save_state(self.output, self.model, progress.saved(), self.loader.state_dict(), self.model_info,
                                self.config)
            log.info("saved %s at global step %d", folder, progress.global_step)
        save_backbone(self.model.backbone, self.output, self.model_info)
        self._saved_at = progress.global_step

    def last_good(self) -> str:
        """What a stopped run leaves to continue from, for its error message."""
        for name, advice in ((POINTER_NAME, " (continue with --resume)"), (BACKBONE_NAME, "")):
            if os.path.exists(os.path.join(self.output, name)):
                return f"the last good {name} in {self.output} is untouched{advice}"
        return "no checkpoint had been written yet"


def _log_config_changes(saved: Mapping, current: Mapping) -> None:
    changed = [f"{key}: {saved[key]!r} -> {current[key]!r}" for key in sorted(current)
               if key in saved and saved[key] != current[key] and key != "resume"]
    if changed:
        log.info("config differs from the checkpoint's: %s", "; ".join(changed))
