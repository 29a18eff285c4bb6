"""The run folder: created for a new run, reopened for a resume, never overwritten by accident,
and held by one training process at a time; and what a resume starts from."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from backbones.trained import BACKBONE_NAME
from checkpoint.arcface import MARKERS, MODEL_FILE, marker_for
from checkpoint.legacy import LEGACY_FORMAT, LEGACY_NAME, read_legacy
from checkpoint.sharded import POINTER_NAME
from utils.errors import CheckpointError, RunDirError, located

LOCK_NAME = ".lock"
# What makes a folder a run worth guarding, in the order a resume prefers them: arcface_torch's rank
# files before its backbone alone (model.pt is all train_v2.py writes by default).
WEIGHTS_NAMES = (POINTER_NAME, LEGACY_NAME, *MARKERS, BACKBONE_NAME, MODEL_FILE)


def resolve_resume(output: str, resume: bool | str) -> tuple[str, Path] | None:
    """What to start from: None for a fresh run, else (kind, file) from find_resume_source.

    A fresh run (or one starting from another folder's weights) needs an empty or missing output
    folder; `resume=True` continues the run already in `output`.
    """
    if resume is True:
        if not Path(output).is_dir():
            raise CheckpointError(f"--resume continues the run in the output folder, but {located(output)} does not "
                                  "exist; start without --resume, or point output at the run's folder "
                                  "(--set output=<folder>)")
        return find_resume_source(output)
    held = _run_files(Path(output))
    source = find_resume_source(resume) if resume else None
    same_folder = source is not None and source[1].parent.resolve() == Path(output).resolve()
    if held and not same_folder:
        raise RunDirError(f"output folder {output} already holds a run ({', '.join(held[:3])}); pass --resume to "
                          "continue it, or choose a new folder with --set output=<folder>")
    return source


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
        raise CheckpointError(f"resume source {located(location)} does not exist; point resume at a run folder, "
                              f"a {POINTER_NAME} or a backbone .pth file")
    if location.suffix == ".json":
        return "checkpoint", location
    if location.name in MARKERS:
        return "arcface_torch", location
    return ("legacy" if read_legacy(location).get("format") == LEGACY_FORMAT else "backbone"), location


def _run_files(folder: Path) -> list[str]:
    """The folder's entries when it holds a run's saved weights, else []."""
    if not folder.is_dir():
        return []
    entries = sorted(entry.name for entry in folder.iterdir() if entry.name != LOCK_NAME)
    # Only saved weights make a run worth guarding: one that stopped before its first save (bad input,
    # a crash) left a log and TensorBoard files, which the next start appends to without loss.
    return entries if any(name in entries for name in WEIGHTS_NAMES) else []


def lock_run_dir(output: str) -> IO:
    """Create `output` and hold its lock for as long as the returned file stays open.

    The lock is an flock: it vanishes with the process however it ends (even SIGKILL), so a
    crashed run never blocks its own resume.
    """
    os.makedirs(output, exist_ok=True)
    handle = open(Path(output) / LOCK_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise RunDirError(f"output folder {output} is in use by another training process ({owner}); wait for it "
                          "to finish or choose another folder with --set output=<folder>") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    handle.flush()
    return handle
