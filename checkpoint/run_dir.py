"""The run folder: created for a new run, reopened for a resume, never overwritten by accident,
and held by one training process at a time; what a resume starts from; and its `config.json`, the run's
record of its config: the config file and the `--set` overrides the run was started (or last resumed) with,
so that `--resume` keeps what was said without it being said again, and every key's resolved value, which
eval.compare reads back."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from checkpoint.last_start import killed_start
from checkpoint.manifest import IntegrityError, read_checked_json
from checkpoint.pointer import FOLDER_PREFIX, POINTER_NAME
from checkpoint.sources import WEIGHTS_NAMES, Source, find_resume_source
from checkpoint.state_file import STATE_NAME
from training.progress import SavedProgress
from utils.atomic import atomic_save, write_bytes
from utils.config import override_key
from utils.errors import CheckpointError, ConfigError, RunDirError, located
from utils.launcher import launch_words
from utils.log import LOG_NAME

LOCK_NAME = ".lock"
RUN_CONFIG_NAME = "config.json"
# Keys that say where a run is, not how it trains: never carried over from an earlier start.
WHERE_KEYS = ("output", "resume")
AUTO = "auto"  # resume = "auto": continue the run in the output folder if there is one, else start it


def resolve_resume(output: str, resume: bool | str,
                   continue_with: Callable[..., str] | None = None, start_over: bool = False) -> Source | None:
    """What to start from: None for a fresh run, else what find_resume_source finds.

    A fresh run (or one starting from another folder's weights) needs an empty or missing output
    folder; `resume=True` continues the run already in `output`; `resume="auto"` continues it if
    there is one, else starts a fresh run there. `continue_with(*KEY=VALUE)`: the command line that continues
    this run (with those overrides too), for the refusal to start over a run. A folder whose run was killed
    before it saved a whole checkpoint (checkpoint/last_start.py) is started over only with `start_over` (or
    resume="auto", which asks for a start when there is nothing to continue); nothing in it is deleted.
    """
    held = _run_files(Path(output))
    if held and (owner := lock_holder(output)) is not None:  # said first: --resume would be refused for it too
        raise RunDirError(_in_use(output, owner))
    if held and start_over:
        raise RunDirError(f"--start-over starts a run again in a folder whose run was killed before its first whole "
                          f"checkpoint, but {output} holds a run's checkpoint ({', '.join(held[:3])}); continue it "
                          "with --resume, or choose a new folder with --set output=<folder>")
    if not held and resume != AUTO and not start_over and lock_holder(output) is None and \
            (killed := killed_start(output)) is not None:
        how = "start it over there with --start-over (nothing is deleted: training.log and tensorboard/ go on)"
        raise RunDirError(f"output folder {output} holds a run without a whole checkpoint: {killed.describe()}; "
                          f"{how}, or choose another folder with --set output=<folder>")
    if resume == AUTO:
        return find_resume_source(output) if held else None
    if resume is True:
        if not Path(output).is_dir():
            raise CheckpointError(f"--resume continues the run in the output folder, but {located(output)} does not "
                                  "exist; start without --resume, or point output at the run's folder "
                                  "(--set output=<folder>)")
        return find_resume_source(output)
    source = find_resume_source(resume) if resume else None
    same_folder = source is not None and source.path.parent.resolve() == Path(output).resolve()
    if held and not same_folder:
        raise RunDirError(_held_run_problem(output, held, continue_with))
    return source


def _held_run_problem(output: str, held: list[str], continue_with: Callable[..., str] | None) -> str:
    """Why a new run cannot start in `output`, and what to do: continue the run there (one that finished
    trains on only with a larger num_epoch), or choose another folder."""
    elsewhere = "or choose a new folder with --set output=<folder>"
    finished = finished_run(Path(output))
    if finished is None:
        how = f"continue it with: {continue_with()}" if continue_with else "pass --resume to continue it"
        return f"output folder {output} already holds a run ({', '.join(held[:3])}); {how}, {elsewhere}"
    step, key, value = finished
    more = f"{key}={2 * value}"
    how = f"{continue_with(more)}" if continue_with else f"--set {more} --resume"
    return (f"output folder {output} holds a run that finished training at global step {step} ({key}={value}); "
            f"to train it on, raise {key} and continue it, e.g. with: {how}; {elsewhere}")


def finished_run(output: Path) -> tuple[int, str, int] | None:
    """(shown global step, the key that ended training, its value: num_epoch or max_steps) of the run in
    `output` when its checkpoint is at the end of its training, else None (also when that cannot be read: a
    resume then says what is wrong). The checkpoint's state.json is read here for these words alone."""
    try:
        pointer = read_checked_json(output / POINTER_NAME)
        run = read_checked_json(output / pointer["directory"] / STATE_NAME)["run"]
        progress, config = run["progress"], run["config"]
        total = progress["steps_per_epoch"] * config["num_epoch"]
        by_max_steps = bool(config.get("max_steps")) and config["max_steps"] < total
        step = progress["global_step"]
        if step < (config["max_steps"] if by_max_steps else total):
            return None
        key = "max_steps" if by_max_steps else "num_epoch"
        return SavedProgress(progress).shown_step, key, config[key]
    except (OSError, IntegrityError, KeyError, TypeError, ValueError):
        return None


def continues_torchrun_run(output: str, run_id: str | None) -> bool:
    """Whether this start is torchrun run `run_id` (its --rdzv-id) starting again in the run folder it
    trains in: after a lost process or node, or a node joining. True when `output` holds a run whose
    lock was last taken under that run id; such a start continues the run as resume="auto" does."""
    lock = Path(output) / LOCK_NAME
    if run_id is None or not lock.is_file() or not _run_files(Path(output)):
        return False
    match = re.search(r", torchrun run (\S+)$", lock.read_text().strip())
    return match is not None and match.group(1) == run_id


def _run_files(folder: Path) -> list[str]:
    """The folder's entries when it holds a run's saved weights, else []."""
    if not folder.is_dir():
        return []
    entries = sorted(entry.name for entry in folder.iterdir() if entry.name != LOCK_NAME)
    # Only saved weights make a run worth guarding: one that stopped before its first save (bad input,
    # a crash) left a log and TensorBoard files, which the next start appends to without loss.
    saved = any(name in WEIGHTS_NAMES or name.startswith(FOLDER_PREFIX) for name in entries)
    return entries if saved else []


def _in_use(output: str, owner: str) -> str:
    return (f"output folder {output} is in use by another training process ({owner}); wait for it to finish or "
            "choose another folder with --set output=<folder>")


def lock_holder(output: str) -> str | None:
    """Who holds `output`'s lock (its lock file's line) while a training process holds it, else None. Only
    tried (a shared lock, let go at once): taking it is lock_run_dir's."""
    try:
        with open(Path(output) / LOCK_NAME) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return handle.read().strip() or "unknown"
            except OSError:  # a filesystem without file locks: lock_run_dir says so
                return None
            fcntl.flock(handle, fcntl.LOCK_UN)
            return None
    except OSError:  # no lock file: never held
        return None


def lock_run_dir(output: str, torchrun_run: str | None = None) -> IO:
    """Create `output` and hold its lock for as long as the returned file stays open.

    The lock is an flock: it vanishes with the process however it ends (even SIGKILL), so a
    crashed run never blocks its own resume. The lock file names its holder, and the torchrun run
    the holder belongs to, so that torchrun's restarts of that run find their folder
    (continues_torchrun_run).
    """
    try:
        os.makedirs(output, exist_ok=True)
        handle = open(Path(output) / LOCK_NAME, "a+")
    except OSError as error:
        raise RunDirError(f"cannot use output folder {output} ({error.strerror or error}: {error.filename}); "
                          "choose a folder this process can write with --set output=<folder>") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise RunDirError(_in_use(output, owner)) from None
    except OSError as error:  # e.g. a network filesystem without file locks
        handle.close()
        raise RunDirError(f"cannot lock output folder {output} ({error.strerror or error}); the run folder needs a "
                          "filesystem with file locks (flock): choose another folder with --set output=<folder>") \
            from None
    handle.seek(0)
    handle.truncate()
    run = f", torchrun run {torchrun_run}" if torchrun_run else ""
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}{run}\n")
    handle.flush()
    return handle


def remove_started_folder(output: str) -> bool:
    """For a run that stopped on an error before it wrote anything but its lock and training.log, in an output
    folder it made itself: remove those two and the folder, so that a failed start leaves no empty run folder
    (whose training.log says only the error the terminal said). Anything else in it stays, and so does the
    folder; whether it was removed."""
    folder = Path(output)
    started = {LOCK_NAME, LOG_NAME}
    if not folder.is_dir() or {path.name for path in folder.iterdir()} - started:
        return False
    for name in started:
        (folder / name).unlink(missing_ok=True)
    folder.rmdir()
    return True


def resumed_overrides(output: str, resume: bool | str, said_now: Sequence[str]) -> list[str]:
    """The `--set` overrides (KEY=VALUE) a resumed run was started or last resumed with (its config.json)
    whose keys `said_now` does not set again: applied before those, they keep what was said. [] when the
    run has none (a bare backbone, arcface_torch's folder, an earlier version's run)."""
    location = Path(output if resume in (True, AUTO) else resume)
    if location.is_file() and location.name != POINTER_NAME:  # weights to start from, not a run to continue
        return []
    path = (location.parent if location.is_file() else location) / RUN_CONFIG_NAME
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


def kept_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides a later resume keeps: the last one of each key, where-keys left out."""
    last = {override_key(item): item for item in overrides}
    return [item for key, item in last.items() if key not in WHERE_KEYS]


@dataclass(frozen=True)
class ResumeCommand:
    """The command line that continues a run: its launcher, `script` and config file, every `--set` given
    (the last of each key; `output` included, since --resume looks the run up there), then `--resume`."""

    script: str
    config_file: str
    overrides: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.with_sets()

    def with_sets(self, *extra: str) -> str:
        """The command with `extra` KEY=VALUE overrides too (each replacing a --set of its key)."""
        last = {override_key(item): item for item in (*self.overrides, *extra)}
        sets = [f"--set {shlex.quote(item)}" for key, item in last.items() if key != "resume"]
        return " ".join([launch_words(), shlex.quote(self.script), shlex.quote(self.config_file), *sets, "--resume"])


def write_run_config(output: str, config_file: str, overrides: Sequence[str], config: Mapping) -> None:
    """Rank 0, once a checkpoint of this start is published (a failed save leaves the old config.json as it
    was): config.json, written only when it says something new. It is the run's one record of its config: how
    it was given (`config_file`, `set`: what --resume keeps) and what it resolved to (`config`: every key's
    value, which eval.compare reads back)."""
    record = {"config_file": str(config_file), "set": kept_overrides(overrides), "config": dict(config)}
    content = json.dumps(record, indent=2).encode()
    path = Path(output) / RUN_CONFIG_NAME
    if not path.is_file() or path.read_bytes() != content:
        atomic_save(content, path, write=write_bytes)
