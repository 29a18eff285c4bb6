"""Writing files so that a crash at any moment leaves either the old or the new complete file.

A write goes to a hidden temporary file in the same folder, is fsynced, then renamed over the old
file (`os.replace` is atomic on POSIX filesystems), and the folder is fsynced so that the rename
itself survives a power cut. Leftover temporaries start with ".tmp-", are never read, and are
removed by the next write of the same file.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch

from utils.errors import CheckpointError

TMP_PREFIX = ".tmp-"


def atomic_save(obj, path: str | os.PathLike, write: Callable[[object, IO[bytes]], object] = torch.save) -> None:
    """Write `obj` to `path` (with torch.save, or `write(obj, binary_file)`) so that `path` is always
    either the old or the new complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"{TMP_PREFIX}{path.name}.*"):
        stale.unlink(missing_ok=True)  # left by a process killed mid-write
    tmp = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            write(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:  # including KeyboardInterrupt: never leave a half-written file behind
        tmp.unlink(missing_ok=True)
        raise_if_disk_error(error, path)
        raise
    fsync_dir(path.parent)


def write_bytes(data: bytes, handle: IO[bytes]) -> None:
    """A `write` for atomic_save of ready bytes (JSON, text)."""
    handle.write(data)


def os_error_behind(error: BaseException | None) -> OSError | None:
    """The OSError (disk full, file too large, file missing) behind `error`, if any: torch reports a
    failed write as a RuntimeError raised while handling one, DCP as a per-rank failure."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def raise_if_disk_error(error: BaseException, path: Path) -> None:
    """A CheckpointError naming `path` if an OSError is behind `error`."""
    cause = os_error_behind(error)
    if cause is not None:
        raise CheckpointError(f"could not write {path} ({cause.strerror or cause}); the previous {path.name} "
                              "is untouched: free disk space or choose another output folder") from error


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
