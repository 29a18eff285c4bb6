"""When a run saves, and how it resumes: the training loop's one contact with checkpoints.

A run folder holds:
- the training state (`checkpoint.json` naming a `checkpoint-<step>/` folder: checkpoint/sharded.py),
  resumable exactly on the same world size and on any other;
- `backbone.pth` and `model.json` (backbones/trained.py): the plain backbone state_dict, as
  arcface_torch saves it, and the network it belongs to.

A run also resumes from a folder arcface_torch wrote (checkpoint/arcface.py), from an earlier
version's `checkpoint.pt` (checkpoint/legacy.py) or from a bare backbone .pth, on any world size.

Every file is written atomically (utils/atomic.py): a crash at any moment costs no earlier save.
With `async_save`, a save copies the state to host memory and a background thread writes it
(checkpoint/background.py): the step waits for the copy only.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from backbones import load_backbone
from backbones.trained import BACKBONE_NAME, save_backbone
from checkpoint.arcface import restore_arcface
from checkpoint.background import BackgroundSave, HostStaging
from checkpoint.legacy import restore_legacy
from checkpoint.pointer import POINTER_NAME
from checkpoint.restored import Restored
from checkpoint.rng import set_rng_state
from checkpoint.sharded import restore_state, stage_state, write_state
from dataset import FaceLoader
from training.state import StepCounter, TrainingState
from utils.distributed import agreed, checkpoint_group, world
from utils.lr_scheduler import jump_to_step

log = logging.getLogger(__name__)


class Checkpointer:
    """The training loop's one contact with checkpoints: the resume at the start, then every save.

    A save is due every `save_every_steps` steps, at each epoch end and at the end of the run; one
    that falls inside a streak of non-finite losses waits for the next step taken, so the last good
    checkpoint stays as it was (the end of the run saves in any case).

    With `async_save`, `save` returns once the state is copied to host memory and the files are written
    in the background; `wait_for_save()` waits until that save is published (the final save waits by
    itself, a new save waits for the one before: at most one is in flight). Collective: every rank
    builds it and calls the same methods at the same steps.
    """

    def __init__(self, output: str, state: TrainingState, loader: FaceLoader, architecture: Mapping,
                 config: Mapping, *, save_every_steps: int = 0, save_all_states: bool = True,
                 async_save: bool = False) -> None:
        self.output, self.state, self.loader = output, state, loader
        self.architecture, self.config = dict(architecture), dict(config)
        self.save_every_steps, self.save_all_states = save_every_steps, save_all_states
        self.saved_at = -1  # the global step of the last checkpoint, written or resumed from; -1: none yet
        self._waiting = False  # a save fell inside a non-finite streak
        self._staging = HostStaging() if async_save and save_all_states else None
        self._group = checkpoint_group() if self._staging else None  # the writer thread's own collectives
        self._in_flight: tuple[BackgroundSave, int] | None = None

    def resume(self, source: tuple[str, Path], counter: StepCounter) -> Restored | None:
        """Load `source` ((kind, file) from find_resume_source) into the run and `counter`; what was
        restored (None for a bare backbone)."""
        kind, path = source
        if kind == "backbone":
            self._start_from_backbone(path)
            return None
        if kind == "checkpoint" and path.is_dir() and not (path.parent / POINTER_NAME).is_file():
            log.warning("%s holds no %s: resuming from %s, its newest complete checkpoint folder, once every file "
                        "matches its checksum", path.parent, POINTER_NAME, path)
        restore = {"checkpoint": restore_state, "legacy": restore_legacy, "arcface_torch": restore_arcface}[kind]
        restored = restore(path, self.architecture, self.state)
        saved = restored.progress
        counter.nonfinite_total = saved["nonfinite_total"]
        if saved["steps_per_epoch"] == counter.steps_per_epoch and restored.rank_state is not None:
            counter.global_step = saved["global_step"]
            self.loader.load_state_dict(restored.rank_state["loader"])
            set_rng_state(restored.rank_state["rng"])
        elif saved["global_step"]:  # step 0 (arcface_torch's 2021 layout) is step 0 however an epoch is cut
            self._renumber(restored, counter)
        log.info("resumed from %s at global step %d (epoch %d), lr %.6f", path, counter.global_step, counter.epoch,
                 self.state.optimizer.param_groups[0]["lr"])
        _log_config_changes(restored.config, self.config)
        self.saved_at = counter.global_step
        return restored

    def _renumber(self, restored: Restored, counter: StepCounter) -> None:
        """Another world size, batch size or accumulation: keep the fraction of training done, so the LR
        schedule and the epoch go on where they were (the exact sample order cannot)."""
        saved = restored.progress
        counter.global_step = round(saved["global_step"] * counter.steps_per_epoch / saved["steps_per_epoch"])
        jump_to_step(self.state.scheduler, counter.global_step)
        self.loader.load_state_dict(restored.first_rank_state["loader"])
        log.warning("resuming a run of %d process(es) and %d steps per epoch with %d and %d: step %d becomes step "
                    "%d; the data order of this epoch differs from the original run", restored.world_size,
                    saved["steps_per_epoch"], world(), counter.steps_per_epoch, saved["global_step"],
                    counter.global_step)

    def _start_from_backbone(self, path: Path) -> None:
        architecture = self.architecture
        weights = load_backbone(architecture["network"], path, num_features=architecture["embedding_size"],
                                **architecture["network_kwargs"])
        self.state.backbone.load_state_dict(weights.state_dict())
        log.info("initialised the backbone from %s (a bare backbone: class centres, optimizer and schedule "
                 "start fresh)", path)

    def after_step(self, counter: StepCounter, final: bool = False) -> bool:
        """Save if a save is due after this step (`final`: the last step of the run); whether it saved."""
        step = counter.global_step
        every = self.save_every_steps
        due = self._waiting or final or step % counter.steps_per_epoch == 0 or (every and step % every == 0)
        if not due or step == self.saved_at:
            return False
        self._waiting = counter.nonfinite_in_a_row > 0 and not final
        if not self._waiting:
            self.save(counter, wait=final)  # the run's last save is published before the run ends
        return not self._waiting

    def save(self, counter: StepCounter, wait: bool = False) -> None:
        """Save the state at this step (`wait`: return only once it is published, e.g. before the
        process exits). A save still in flight is waited for first."""
        self.wait_for_save()
        step = counter.global_step
        if not self.save_all_states:
            agreed(lambda: save_backbone(self.state.backbone, self.output, self.architecture))
        else:
            staged = stage_state(self.state, counter.saved(), self.loader.state_dict(), self.architecture,
                                 self.config, self._staging.copy if self._staging else None)
            if self._staging:
                self._in_flight = BackgroundSave(lambda: write_state(self.output, staged, self._group)), step
            else:
                log.info("saved %s at global step %d", write_state(self.output, staged), step)
        self.saved_at = step
        if wait:
            self.wait_for_save()

    def wait_for_save(self) -> None:
        """Return once the save in flight (if any) is published; its CheckpointError (the same on every
        rank) if it failed, the previous checkpoint then still published. Collective."""
        if self._in_flight is None:
            return
        save, step = self._in_flight
        self._in_flight = None
        log.info("saved %s at global step %d", save.wait(), step)

    def settle(self) -> None:
        """For a run stopping on an error: let a save in flight publish or fail as it would (its
        collectives must not outlive the process group); its own error is logged, not raised, so
        that the error that stopped the run is the one reported."""
        try:
            self.wait_for_save()
        except Exception as error:
            log.warning("the save in flight failed too: %s", error)

    def save_for_exit(self, counter: StepCounter) -> None:
        """Save now, for a run about to exit (a preemption), unless this step is saved already: on
        return the checkpoint is complete and published on every rank."""
        if counter.global_step != self.saved_at:
            self.save(counter)
        self.wait_for_save()


def last_good(output: str) -> str:
    """What a stopped run leaves in `output` to continue from, for its last line."""
    for name, advice in ((POINTER_NAME, " (continue with --resume)"), (BACKBONE_NAME, "")):
        if os.path.exists(os.path.join(output, name)):
            return f"the last good {name} in {output} is untouched{advice}"
    return "no checkpoint had been written yet"


def _log_config_changes(saved: Mapping, current: Mapping) -> None:
    changed = [f"{key}: {saved[key]!r} -> {current[key]!r}" for key in sorted(current)
               if key in saved and _plain(saved[key]) != _plain(current[key]) and key != "resume"]
    if changed:
        log.info("config differs from the checkpoint's: %s", "; ".join(changed))


def _plain(value):
    """A config value as a checkpoint's JSON holds it (tuples as lists)."""
    return json.loads(json.dumps(value))
