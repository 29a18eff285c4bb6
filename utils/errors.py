"""The errors a user can cause, and how every command line reports them.

Each is a ``UserError``: its message is one sentence, ``<what is wrong>; <how to fix it>``, naming the
file, key or record at fault. The CLIs catch exactly ``UserError`` and print ``error: <message>``
with exit status 1 (utils/cli.py); anything else is a bug and keeps its traceback. The second base of each class
is the built-in a caller would expect to catch for it (a bad value, a failed run).
"""
from __future__ import annotations

import os


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


class NetworkError(UserError, RuntimeError):
    """The processes of a job cannot reach each other (the network check before the first step)."""


class WeightsError(UserError, ValueError):
    """A weights file is missing, unreadable or does not fit the requested network."""


class FaceImageError(UserError, ValueError):
    """A face photo cannot be read or prepared (tools.pack_rec, tools.make_bin, tools.inference)."""


def located(path: str | os.PathLike) -> str:
    """A path for an error message: a relative one also names the folder it was looked up from."""
    path = os.fspath(path)
    return path if os.path.isabs(path) else f"{path} (looked up from {os.getcwd()})"
