"""Amounts of memory as people write them: 80GiB, 80GB, 81920MiB, 1.5TiB, 4096B. Always with a unit: a bare
80 could mean bytes or GiB, and reading it either way silently plans for the wrong machine."""
from __future__ import annotations

import re

from utils.errors import ConfigError

_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str, what: str) -> int:
    """Bytes in `text` (a number and a unit: B, kB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB of 1024);
    a ConfigError naming `what` when it is not a positive amount."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if match is not None and not match[2]:
        raise ConfigError(f"{what} {text!r} has no unit; write it with one, e.g. {match[1]}GiB (or {match[1]}GB, "
                          f"{match[1]}B for bytes)")
    if match is None or match[2].lower() not in _UNITS or float(match[1]) <= 0:
        raise ConfigError(f"{what} {text!r} is not an amount of memory; write it like 80GiB, 80GB or 81920MiB")
    return int(float(match[1]) * _UNITS[match[2].lower()])
