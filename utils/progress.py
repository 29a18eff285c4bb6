"""How far a long loop has got, for command lines: a tqdm bar on a terminal, a line per tenth elsewhere."""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

from tqdm import tqdm

Item = TypeVar("Item")


def progress(iterable: Iterable[Item], total: int | None, description: str,
             stream: TextIO | None = None) -> Iterator[Item]:
    """Yield the items of ``iterable``, reporting on ``stream`` how many of ``total`` are done.

    ``stream=None`` reports nothing: library functions pass through what their caller gave them, and
    only command lines give one (``sys.stderr``). A terminal gets a tqdm bar; a file or pipe (a log,
    a batch job) gets ``<description>: 30% (300/1000, 12 s)`` once per tenth, because a redrawn bar
    would fill it with carriage returns. ``total=None`` takes ``len(iterable)`` when it has one.
    """
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if stream is None:
        yield from iterable
    elif stream.isatty():
        yield from tqdm(iterable, total=total, desc=description, file=stream, dynamic_ncols=True)
    else:
        yield from _tenths(iterable, total, description, stream)


def _tenths(iterable: Iterable[Item], total: int | None, description: str, stream: TextIO) -> Iterator[Item]:
    start = time.monotonic()
    reported = 0  # tenths already printed
    done = 0
    for item in iterable:
        yield item
        done += 1
        tenths = 10 * done // total if total else 0
        if tenths > reported:
            reported = tenths
            print(f"{description}: {10 * tenths}% ({done}/{total}, {time.monotonic() - start:.0f} s)",
                  file=stream, flush=True)
    if not total:  # nothing to take tenths of: say once that it is over
        print(f"{description}: {done} done ({time.monotonic() - start:.0f} s)", file=stream, flush=True)
