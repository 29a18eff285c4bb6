"""The errors a user can cause, and how every command line reports them.

Each is a ``UserError``: its message is one sentence, ``<what is wrong>; <how to fix it>``, naming the
file, key or record at fault. The CLIs catch exactly ``UserError`` and print ``error: <message>``
with exit status 1; anything else is a bug and keeps its traceback. The second base of each class
is the built-in a caller would expect to catch for it (a bad value, a failed run).
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from utils.distributed import broadcast_object, is_main, launched_rank


class UserError(Exception):
    """Something the user can fix (a config, a path, the data, a checkpoint); the message says how."""


class ConfigError(UserError, ValueError):
    """A configuration key, value or file cannot be used."""


class DataError(UserError, ValueError):
    """A dataset file, record, label or folder is unusable."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be written, read, or does not fit this run."""


class RunDirError(UserError, ValueError):
    """The output folder cannot be used as asked."""


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (e.g. too many non-finite losses in a row)."""


class WeightsError(UserError, ValueError):
    """A weights file is missing, unreadable or does not fit the requested network."""


class FaceImageError(UserError, ValueError):
    """A face image cannot be read or is not an aligned square crop."""


def report(error: UserError) -> None:
    """Print ``error: <message>`` on stderr, prefixed with the process's rank under torchrun."""
    process = launched_rank()
    prefix = f"[rank {process}] " if process else ""
    # One write: ranks share a terminal or pipe, and a line written in pieces interleaves with theirs.
    sys.stderr.write(f"error: {prefix}{error}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """For a command line's main(): a UserError ends it with its one sentence and exit status 1."""
    try:
        yield
    except UserError as error:
        report(error)
        raise SystemExit(1) from None


def agreed(decide, share: bool = True):
    """Run `decide()` on rank 0 and raise its user error on every rank, so that no process is left
    waiting at a collective for one that stopped. Returns the result on every rank (`share`), or
    on rank 0 only (None elsewhere) for results that cannot travel, such as an open file."""
    outcome, error = None, None
    if is_main():
        try:
            outcome = decide()
        except UserError as raised:
            error = raised
    error = broadcast_object(error)
    if error is not None:
        raise error
    return broadcast_object(outcome) if share else outcome
