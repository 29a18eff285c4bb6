"""The one exception type for data problems a user can cause (and fix)."""
from __future__ import annotations

from utils.errors import DataError

__all__ = ["DataError"]
