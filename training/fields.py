"""Checks of the values a checkpoint's `state.json` holds, for the components that load them.

The file matches its checksum when it gets here, so whatever it holds was written so: by pairface, by
another program, or forged with its checksum recomputed. Each component checks the fields it reads for the
type and shape pairface writes (training/components.py), so that a file that does not hold them is one
line naming the field (`StateFieldError`), before anything is loaded.
"""
from __future__ import annotations

import math
from collections.abc import Mapping


class StateFieldError(ValueError):
    """A field of state.json that is not what pairface writes: the field's path and what it must be."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field {field!r} {problem}")
        self.field, self.problem = field, problem


def field(parent: Mapping, key: str, where: str):
    if key not in parent:
        raise StateFieldError(f"{where}.{key}" if where else key, "is missing")
    return parent[key]


def json_object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise StateFieldError(where, f"must be a JSON object, not {kind(value)}")
    return value


def json_list(value, where: str, length: int | None = None) -> list:
    if not isinstance(value, list):
        raise StateFieldError(where, f"must be a list, not {kind(value)}")
    if length is not None and len(value) != length:
        raise StateFieldError(where, f"must hold {length} entries, not {len(value)}")
    return value


def integer(value, where: str, low: int | None = None) -> int:
    if not is_integer(value):
        raise StateFieldError(where, f"must be an integer, not {kind(value)}")
    if low is not None and value < low:
        raise StateFieldError(where, f"must be at least {low}, not {value}")
    return value


def number(value, where: str, low: float | None = None) -> float:
    if not is_number(value):
        raise StateFieldError(where, f"must be a finite number, not {kind(value)}")
    if low is not None and value < low:
        raise StateFieldError(where, f"must be at least {low:g}, not {value}")
    return value


def boolean(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise StateFieldError(where, f"must be true or false, not {kind(value)}")
    return value


def setting(value, where: str) -> None:
    """An optimizer setting: null, true/false, a finite number, or a list of finite numbers (AdamW's betas)."""
    if not (is_plain(value) or (isinstance(value, list) and all(is_number(item) for item in value))):
        raise StateFieldError(where, f"must be null, true/false, a number or a list of numbers, not {kind(value)}")


def is_plain(value) -> bool:
    return value is None or isinstance(value, bool) or is_number(value)


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def kind(value) -> str:
    """How a JSON value reads in a message: its JSON type and a short excerpt."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    text = repr(value)
    return f"{names.get(type(value), 'the number')} {text[:40]}{'...' if len(text) > 40 else ''}"
