"""When a run saves, and how it resumes: the training loop's one contact with checkpoints.

A run folder holds:
- the training state (`checkpoint.json` naming a `checkpoint-<step>/` folder: checkpoint/sharded.py),
  resumable exactly on the same world size and on any other;
- `backbone.pth` and `model.json` (backbones/trained.py): the plain backbone state_dict, as
  arcface_torch saves it, the network it belongs to and its last verification's operating points;
- `config.json` (checkpoint/run_dir.py): the run's record of its config, the config file and the `--set`
  overrides the run was started (or last resumed) with, so that `--resume` keeps what was said without it
  being said again, and the values they resolved to, which eval.compare reads.

A run also resumes from a folder arcface_torch wrote, from an earlier version's `checkpoint.pt` or from a
bare backbone .pth, on any world size: checkpoint/sources.py has one importer per kind.

Every file is written atomically (utils/atomic.py): a crash at any moment costs no earlier save.
With `async_save`, a save copies the state to host memory and a background thread writes it
(HostStaging, BackgroundSave below): the step waits for the copy only. The host buffers are kept from one
save to the next (the memory plan counts them as `host_checkpoint_staging`); at most one save is in flight, so
one set of buffers serves every save. A save due while the one before is still being written waits for it
(the step stalls, and the log says so): no due save is ever skipped. The last save of a run, and the save of a
run stopping on a signal, are waited for anyway: they are written from the live tensors, with no host copy (a
process about to exit needs no more memory for its last save, nor a thread it could leave behind).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from backbones.trained import BACKBONE_NAME, save_backbone
from checkpoint.pointer import POINTER_NAME
from checkpoint.restored import Restored
from checkpoint.run_dir import WHERE_KEYS, write_run_config
from checkpoint.sources import Source
from dataset import FaceLoader
from training.components import Component, exported_backbone
from training.state import CENTRES_GROUP, StepCounter, TrainingState, group_lrs, registry
from utils.device import use_device_in_this_thread
from utils.distributed import checkpoint_group, run_on_rank0, world
from utils.log import FILE_ONLY
from utils.lr_scheduler import jump_to_step

log = logging.getLogger(__name__)

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
                 async_save: bool = False, config_file: str = "", overrides: Sequence[str] = (),
                 continue_with: str = "--resume") -> None:
        self.output, self.state, self.loader = output, state, loader
        self.architecture, self.config = dict(architecture), dict(config)
        self.save_every_steps, self.save_all_states = save_every_steps, save_all_states
        self.saved_at = -1  # the global step of the last checkpoint, written or resumed from; -1: none yet
        self._waiting = False  # a save fell inside a non-finite streak
        self._staging = HostStaging() if async_save and save_all_states else None
        self._group = checkpoint_group() if self._staging else None  # the writer thread's own collectives
        self._in_flight: tuple[BackgroundSave, int, str | None] | None = None  # the save, its shown step, its note
        self.config_file, self.overrides = str(config_file), list(overrides)
        self.continue_with = continue_with  # the command line that continues the run, for its stop lines
        self._logged_save_at: int | None = None  # the step of the last save said on the terminal
        self._unsaid: list[int] = []  # the shown steps of saves said in training.log alone since then
        self._said_waiting = False  # a save waiting for the one before is said on the terminal once
        self.renumbering: Renumbering | None = None  # how resume() renumbered the saved step, if it did
        # Imported now, not at the first save: a checkout updated under a running process would otherwise give
        # that save a newer checkpoint module against the older training modules it imported (an ImportError).
        _sharded()

    def resume(self, source: Source, counter: StepCounter) -> Restored | None:
        """Load `source` (from find_resume_source) into the run and `counter`; what was restored (None for a
        bare backbone)."""
        restored = source.importer.restore(source.path, self.architecture, self.state)
        if restored is None:
            return None
        saved = restored.progress
        counter.load_state_dict({"progress": saved})
        if saved["steps_per_epoch"] == counter.steps_per_epoch and restored.rank_state is not None:
            for component in self._per_rank(counter):
                component.load_state_dict(restored.rank_state)
        elif saved["global_step"]:  # step 0 (arcface_torch's 2021 layout) is step 0 however an epoch is cut
            self.renumbering = self._renumber(restored, counter)
        self._follow_schedule_changes(restored.config, counter)
        log.info("resumed from %s at global step %d (epoch %d), lr %.6f", source.path, counter.shown_step,
                 counter.epoch, self.state.optimizer.param_groups[CENTRES_GROUP]["lr"])
        _log_config_changes(restored.config, self.config)
        self.saved_at = counter.global_step
        return restored

    def _renumber(self, restored: Restored, counter: StepCounter) -> Renumbering:
        """Another world size, batch size or accumulation: keep the fraction of training done, so the LR
        schedule and the epoch go on where they were (the exact sample order cannot). The shown step goes
        on counting from where it was."""
        saved = restored.progress
        counter.renumber(saved["steps_per_epoch"])
        jump_to_step(self.state.scheduler, counter.global_step)
        for component in self._per_rank(counter):
            if component.rank_0_stands_in:
                component.load_state_dict(restored.first_rank_state)
        log.warning("resuming a run of %d process(es) and %d steps per epoch with %d and %d: step %d becomes step "
                    "%d of the LR schedule; the log and TensorBoard go on counting from step %d; the data order of "
                    "this epoch differs from the original run", restored.world_size, saved["steps_per_epoch"],
                    world(), counter.steps_per_epoch, saved["global_step"], counter.global_step,
                    counter.shown_step)
        return Renumbering(saved["global_step"], saved["steps_per_epoch"], counter.steps_per_epoch,
                           counter.global_step)

    def _per_rank(self, counter: StepCounter) -> list[Component]:
        """The run's components that every process saves for itself (its random streams, its loader's position)."""
        return [component for component in registry(self.state, counter, self.loader) if component.per_rank]

    def _follow_schedule_changes(self, saved_config: Mapping, counter: StepCounter) -> None:
        """A resume that changes lr, backbone_lr_mult, num_epoch or warmup_epoch goes on along the new schedule
        from this very step (the restored scheduler would keep the saved lr, and the restored LR is the old plan's).
        The base lrs are compared too: a checkpoint that predates backbone_lr_mult (or arcface_torch's) has one lr
        for both groups."""
        scheduler = self.state.scheduler
        if scheduler.base_lrs == group_lrs(self.config) and not any(
                _differs(saved_config, self.config, key) for key in ("num_epoch", "warmup_epoch")):
            return
        scheduler.base_lrs = group_lrs(self.config)
        jump_to_step(scheduler, counter.global_step)

    def after_step(self, counter: StepCounter, final: bool = False) -> bool:
        """Save if a save is due after this step (`final`: the last step of the run); whether it saved."""
        step = counter.global_step
        every = self.save_every_steps
        due = self._waiting or final or step % counter.steps_per_epoch == 0 or (every and step % every == 0)
        if not due or step == self.saved_at:
            return False
        self._waiting = counter.nonfinite_in_a_row > 0 and not final
        if not self._waiting:
            self.save(counter, final)
        return not self._waiting

    def save(self, counter: StepCounter, final: bool = False) -> None:
        """Save the state at this step (`final`: the run's last save, written from the live tensors and published
        before this returns). A save still in flight is waited for first."""
        self._wait_before(counter)
        step, note = counter.global_step, self._terminal_note(counter, final)
        if not self.save_all_states:
            path = run_on_rank0(lambda: save_backbone(exported_backbone(self.state), self.output, self.architecture,
                                                counter.verification))
            log.info("saved %s at global step %d (save_all_states=False: the backbone alone)%s", path,
                     counter.shown_step, note or "", extra=FILE_ONLY if note is None else None)
        else:
            sharded = _sharded()
            staging = None if final else self._staging
            staged = sharded.stage_state(self.state, counter, self.loader, self.architecture,
                                         self.config, staging.copy if staging else None)
            if staging:
                self._in_flight = (BackgroundSave(lambda: sharded.write_state(self.output, staged, self._group),
                                                  self.state.pfc.weight.device),
                                   counter.shown_step, note)
            else:
                self._published(sharded.write_state(self.output, staged), counter.shown_step, note)
        self.saved_at = step

    def _wait_before(self, counter: StepCounter) -> None:
        """Wait for the save in flight before another; when it is still being written, say so: the step waits
        for it, and saves that come faster than the disk takes them stall training."""
        if self._in_flight is None:
            return
        save, shown_step, _ = self._in_flight
        if save.done():
            self.wait_for_save()
            return
        started = time.monotonic()
        self.wait_for_save()
        every = f"save_every_steps={self.save_every_steps} steps" if self.save_every_steps else "an epoch"
        log.warning("the save at global step %d waited %.1f s for the save of global step %d, still being written: "
                    "a save takes longer than %s; every due save is written, the steps wait for it (raise "
                    "save_every_steps to keep them from waiting)", counter.shown_step, time.monotonic() - started,
                    shown_step, every, extra=FILE_ONLY if self._said_waiting else None)
        self._said_waiting = True

    def wait_for_save(self) -> None:
        """Return once the save in flight (if any) is published; its CheckpointError (the same on every
        rank) if it failed, the previous checkpoint then still published. Collective.

        An exception that interrupts the wait (a signal handler's: DataLoader's for a data worker that died, a
        second Ctrl-C) leaves the save in flight, for finish_save_before_stop to wait for: a daemon thread still
        writing when the process exits is cut off, and its save lost."""
        if self._in_flight is None:
            return
        save, shown_step, note = self._in_flight
        try:
            folder = save.wait()
        finally:
            if save.done():
                self._in_flight = None
        self._published(folder, shown_step, note)

    def _published(self, folder: Path, shown_step: int, note: str | None) -> None:
        log.info("saved %s at global step %d%s", folder, shown_step, note or "",
                 extra=FILE_ONLY if note is None else None)
        run_on_rank0(lambda: write_run_config(self.output, self.config_file, self.overrides, self.config), share=False)

    def _terminal_note(self, counter: StepCounter, final: bool) -> str | None:
        """Every save is said in training.log (a stopped run's last line names the last one, and the log must
        show it); on the terminal, the last save and at most one per ten log lines (`frequent` steps each): the
        others would crowd it when epochs are short. None for a save said in training.log alone; for one said
        on the terminal, what its line adds: the saves since the one said there before, which went to
        training.log alone (so that the terminal never seems to skip a save)."""
        every = 10 * self.config["frequent"]
        if not (final or self._logged_save_at is None or counter.global_step - self._logged_save_at >= every):
            self._unsaid.append(counter.shown_step)
            return None
        self._logged_save_at = counter.global_step
        unsaid, self._unsaid = self._unsaid, []
        if not unsaid:
            return ""
        steps = ", ".join(map(str, unsaid)) if len(unsaid) <= 4 else f"{unsaid[0]} to {unsaid[-1]}"
        return f" (after {len(unsaid)} save(s) said in training.log alone, at global step(s) {steps})"

    def finish_save_before_stop(self) -> None:
        """For a run stopping (on an error, a Ctrl-C): let a save in flight publish or fail as it would (its
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
            self.save(counter, final=True)
        self.wait_for_save()


def last_good(output: str, continue_with: str = "--resume") -> str:
    """What a stopped run leaves in `output` to continue from, for its last line; `continue_with`: the command
    that continues it (run_config.resume_command)."""
    for name, advice in ((POINTER_NAME, f" (continue with: {continue_with})"), (BACKBONE_NAME, "")):
        if os.path.exists(os.path.join(output, name)):
            return f"the last good {name} in {output} is untouched{advice}"
    return "no checkpoint had been written yet"


def _log_config_changes(saved: Mapping, current: Mapping) -> None:
    """Say what this start changes from the configuration the checkpoint was saved with: a warning naming
    the effect of each change that moves the LR schedule or the data order, one line for the rest."""
    changed = [key for key in sorted(current) if _differs(saved, current, key) and key not in WHERE_KEYS]
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


def _sharded():
    """checkpoint.sharded, imported by the first save or resume: torch.distributed.checkpoint and DTensor behind it
    take about a second to import, which a start refused before its steps (and --help) need not pay."""
    from checkpoint import sharded  # noqa: PLC0415 (a second of imports, only for runs that save or resume)

    return sharded


class HostStaging:
    """Host copies of one save's tensors, in buffers reused by every save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values now, in this staging's buffer for `name` (pinned when the tensor is on a GPU)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[name] = buffer
        buffer.copy_(tensor.detach())
        return buffer


class BackgroundSave:
    """`write()` running in a thread with `device` as its current device; wait() returns its result or
    raises its error."""

    def __init__(self, write: Callable[[], Path], device: torch.device) -> None:
        self._result: Path | None = None
        self._error: BaseException | None = None
        # A daemon: a process that stops on an error does not wait for the write, which leaves the
        # previous checkpoint published (the write publishes only at its very end).
        self._thread = threading.Thread(target=self._run, args=(write, device), name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], Path], device: torch.device) -> None:
        try:
            use_device_in_this_thread(device)
            self._result = write()
        except BaseException as error:  # handed to the training thread, which reports it
            self._error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
