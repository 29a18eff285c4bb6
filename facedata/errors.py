"""The one exception type for data problems a user can cause (and fix)."""
from __future__ import annotations


class DataError(ValueError):
    """A dataset file, record or folder is unusable; the message names it and says how to fix it."""
