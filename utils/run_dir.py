"""The run folder: created for a new run, reopened for a resume, never overwritten by accident,
and held by one training process at a time."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from utils.checkpoint import WEIGHTS_NAMES, find_resume_source
from utils.errors import RunDirError

LOCK_NAME = ".lock"


def resolve_resume(output: str, resume: bool | str) -> tuple[str, Path] | None:
    """What to start from: None for a fresh run, else (kind, file) from find_resume_source.

    A fresh run (or one starting from another folder's weights) needs an empty or missing output
    folder; `resume=True` continues the run already in `output`.
    """
    if resume is True:
        return find_resume_source(output)
    held = _run_files(Path(output))
    source = find_resume_source(resume) if resume else None
    same_folder = source is not None and source[1].parent.resolve() == Path(output).resolve()
    if held and not same_folder:
        raise RunDirError(f"output folder {output} already holds a run ({', '.join(held[:3])}); pass --resume to "
                          "continue it, or choose a new folder with --set output=<folder>")
    return source


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
