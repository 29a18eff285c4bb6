"""When a run saves, and how it resumes: the training loop's one contact with checkpoints.

A run folder holds:
- the training state (`checkpoint.json` naming a `checkpoint-<step>/` folder: checkpoint/sharded.py),
  resumable exactly on the same world size and on any other;
- `backbone.pth` and `model.json` (backbones/trained.py): the plain backbone state_dict, as
  arcface_torch saves it, the network it belongs to and its last verification's operating points;
- `config.json`: the config file and the `--set` overrides the run was started (or last resumed) with,
  so that `--resume` keeps what was said without it being said again (`resumed_overrides`).

A run also resumes from a folder arcface_torch wrote (checkpoint/arcface.py), from an earlier
version's `checkpoint.pt` (checkpoint/legacy.py) or from a bare backbone .pth, on any world size.

Every file is written atomically (utils/atomic.py): a crash at any moment costs no earlier save.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from backbones import load_backbone
from backbones.trained import BACKBONE_NAME, save_backbone
from checkpoint.arcface import restore_arcface
from checkpoint.legacy import restore_legacy
from checkpoint.restored import Restored
from checkpoint.rng import set_rng_state
from checkpoint.sharded import POINTER_NAME, restore_state, save_state
from dataset import FaceLoader
from training.state import StepCounter, TrainingState
from utils.atomic import atomic_save, write_bytes
from utils.config import override_key
from utils.distributed import broadcast_object, is_main, world
from utils.errors import ConfigError
from utils.lr_scheduler import jump_to_step

log = logging.getLogger(__name__)

RUN_CONFIG_NAME = "config.json"
# Keys that say where a run is, not how it trains: never carried over from an earlier start.
_WHERE_KEYS = ("output", "resume")
# Changes on resume that move the LR schedule or the data order, and what each does.
_SCHEDULE_EFFECTS = {
    "num_epoch": "the LR schedule now spans another number of epochs: the LR from this step on differs from the "
                 "original plan",
    "warmup_epoch": "the warmup now ends at another epoch: the LR from this step on differs from the original plan",
    "lr": "every LR from this step on is scaled by new / old",
    **dict.fromkeys(("batch_size", "gradient_acc"), "an epoch has another number of steps: the step is renumbered "
                    "(the same fraction of training), this epoch's data order differs, and lr (for the global batch) "
                    "now spreads over another number of samples"),
}


@dataclass(frozen=True)
class Renumbering:
    """A resume on another world size, batch size or accumulation: the saved step and epoch length, and
    the step of this run's schedule it became."""

    saved_step: int
    saved_steps_per_epoch: int
    steps_per_epoch: int
    step: int

    def describe(self) -> str:
        return (f"step {self.saved_step} of the saved run, which had {self.saved_steps_per_epoch} steps per epoch "
                f"where this one has {self.steps_per_epoch}")


def resumed_overrides(output: str, resume: bool | str, said_now: Sequence[str]) -> list[str]:
    """The `--set` overrides (KEY=VALUE) a resumed run was started or last resumed with (its config.json)
    whose keys `said_now` does not set again: applied before those, they keep what was said. [] when the
    run has none (a bare backbone, arcface_torch's folder, an earlier version's run)."""
    location = Path(output if resume is True else resume)
    if location.is_file() and location.name != POINTER_NAME:  # weights to start from, not a run to continue
        return []
    path = (location if location.is_dir() else location.parent) / RUN_CONFIG_NAME
    if not path.is_file():
        return []
    try:
        overrides = json.loads(path.read_text())["set"]
        if not all(isinstance(item, str) for item in overrides):
            raise TypeError("'set' is not a list of KEY=VALUE strings")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"cannot read {path} ({type(error).__name__}: {error}), which keeps the --set overrides "
                          "the run was started with; remove it and give them again with --set") from None
    said = {override_key(item) for item in said_now}
    return [item for item in overrides if override_key(item) not in said]


def _kept(overrides: Sequence[str]) -> list[str]:
    """The overrides a later resume keeps: the last one of each key, where-keys left out."""
    last = {override_key(item): item for item in overrides}
    return [item for key, item in last.items() if key not in _WHERE_KEYS]


class Checkpointer:
    """The training loop's one contact with checkpoints: the resume at the start, then every save.

    A save is due every `save_every_steps` steps, at each epoch end and at the end of the run; one
    that falls inside a streak of non-finite losses waits for the next step taken, so the last good
    checkpoint stays as it was (the end of the run saves in any case).
    """

    def __init__(self, output: str, state: TrainingState, loader: FaceLoader, architecture: Mapping,
                 config: Mapping, *, save_every_steps: int = 0, save_all_states: bool = True,
                 config_file: str = "", overrides: Sequence[str] = ()) -> None:
        self.output, self.state, self.loader = output, state, loader
        self.architecture, self.config = dict(architecture), dict(config)
        self.save_every_steps, self.save_all_states = save_every_steps, save_all_states
        self.run_config = {"config_file": str(config_file), "set": _kept(overrides)}
        self._saved_at = -1
        self._waiting = False  # a save fell inside a non-finite streak
        self._logged_save_at = None  # the step of the last save logged at info level

    def resume(self, source: tuple[str, Path], counter: StepCounter) -> Renumbering | None:
        """Load `source` ((kind, file) from find_resume_source) into the run and `counter`; how its step
        was renumbered, if it was."""
        kind, path = source
        if kind == "backbone":
            self._start_from_backbone(path)
            return None
        restore = {"checkpoint": restore_state, "legacy": restore_legacy, "arcface_torch": restore_arcface}[kind]
        restored = restore(path, self.architecture, self.state)
        saved = restored.progress
        counter.resume(saved)
        renumbering = None
        if saved["steps_per_epoch"] == counter.steps_per_epoch and restored.rank_state is not None:
            counter.global_step = saved["global_step"]
            self.loader.load_state_dict(restored.rank_state["loader"])
            set_rng_state(restored.rank_state["rng"])
        elif saved["global_step"]:  # step 0 (arcface_torch's 2021 layout) is step 0 however an epoch is cut
            renumbering = self._renumber(restored, counter)
        self._follow_schedule_changes(restored.config, counter)
        log.info("resumed from %s at global step %d (epoch %d), lr %.6f", path, counter.global_step, counter.epoch,
                 self.state.optimizer.param_groups[0]["lr"])
        _log_config_changes(restored.config, self.config)
        return renumbering

    def _renumber(self, restored: Restored, counter: StepCounter) -> Renumbering:
        """Another world size, batch size or accumulation: keep the fraction of training done, so the LR
        schedule and the epoch go on where they were (the exact sample order cannot). The shown step goes
        on counting from where it was."""
        saved = restored.progress
        shown = saved["global_step"] + counter.shown_offset
        counter.global_step = round(saved["global_step"] * counter.steps_per_epoch / saved["steps_per_epoch"])
        counter.shown_offset = shown - counter.global_step
        jump_to_step(self.state.scheduler, counter.global_step)
        self.loader.load_state_dict(restored.first_rank_state["loader"])
        log.warning("resuming a run of %d process(es) and %d steps per epoch with %d and %d: step %d becomes step "
                    "%d of the LR schedule; the log and TensorBoard go on counting from step %d; the data order of "
                    "this epoch differs from the original run", restored.world_size, saved["steps_per_epoch"],
                    world(), counter.steps_per_epoch, saved["global_step"], counter.global_step, shown)
        return Renumbering(saved["global_step"], saved["steps_per_epoch"], counter.steps_per_epoch,
                           counter.global_step)

    def _follow_schedule_changes(self, saved_config: Mapping, counter: StepCounter) -> None:
        """A resume that changes lr, num_epoch or warmup_epoch goes on along the new schedule from this
        very step (the restored scheduler would keep the saved lr, and the restored LR is the old plan's)."""
        scheduler = self.state.scheduler
        if not any(_differs(saved_config, self.config, key) for key in ("lr", "num_epoch", "warmup_epoch")):
            return
        scheduler.base_lrs = [self.config["lr"]] * len(scheduler.base_lrs)
        jump_to_step(scheduler, counter.global_step)

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
        if not due or step == self._saved_at:
            return False
        self._waiting = counter.nonfinite_in_a_row > 0 and not final
        if not self._waiting:
            self.save(counter, final)
        return not self._waiting

    def save(self, counter: StepCounter, final: bool = False) -> None:
        if self.save_all_states:
            progress = broadcast_object(counter.saved())  # rank 0's: only it verifies
            folder = save_state(self.output, self.state, progress, self.loader.state_dict(), self.architecture,
                                self.config)
            if is_main():
                self._write_run_config()
            log.log(self._save_log_level(counter, final), "saved %s at global step %d", folder, counter.shown_step)
        save_backbone(self.state.backbone, self.output, self.architecture, counter.verification)
        self._saved_at = counter.global_step

    def _write_run_config(self) -> None:
        """config.json, once a checkpoint of this start is published (a failed save leaves the old one as it
        was), and only when it says something new."""
        path, content = Path(self.output) / RUN_CONFIG_NAME, json.dumps(self.run_config, indent=2).encode()
        if not path.is_file() or path.read_bytes() != content:
            atomic_save(content, path, write=write_bytes)

    def _save_log_level(self, counter: StepCounter, final: bool) -> int:
        """INFO for the last save and at most one save per ten log lines (`frequent` steps each); DEBUG for
        the others, which would otherwise crowd the log when epochs are short."""
        every = 10 * self.config["frequent"]
        if final or self._logged_save_at is None or counter.global_step - self._logged_save_at >= every:
            self._logged_save_at = counter.global_step
            return logging.INFO
        return logging.DEBUG

    def last_good(self) -> str:
        """What a stopped run leaves to continue from, for its error message."""
        for name, advice in ((POINTER_NAME, " (continue with --resume)"), (BACKBONE_NAME, "")):
            if os.path.exists(os.path.join(self.output, name)):
                return f"the last good {name} in {self.output} is untouched{advice}"
        return "no checkpoint had been written yet"


def _log_config_changes(saved: Mapping, current: Mapping) -> None:
    """Say what this start changes from the configuration the checkpoint was saved with: a warning naming
    the effect of each change that moves the LR schedule or the data order, one line for the rest."""
    changed = [key for key in sorted(current) if _differs(saved, current, key) and key not in _WHERE_KEYS]
    for key in changed:
        if key in _SCHEDULE_EFFECTS:
            effect = _SCHEDULE_EFFECTS[key]
            if key == "lr" and saved[key]:
                effect += f" = {current[key] / saved[key]:g}"
            log.warning("config changed on resume: %s %r -> %r: %s", key, saved[key], current[key], effect)
    others = [f"{key}: {saved[key]!r} -> {current[key]!r}" for key in changed if key not in _SCHEDULE_EFFECTS]
    if others:
        log.info("config changed on resume: %s", "; ".join(others))


def _differs(saved: Mapping, current: Mapping, key: str) -> bool:
    """Whether `key` has another value now than the checkpoint saved (compared as JSON: a tuple saved as a
    list is the same value)."""
    return key in saved and json.dumps(saved[key], default=repr) != json.dumps(current[key], default=repr)
