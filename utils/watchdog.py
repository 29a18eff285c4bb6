"""Bounds on waits that Python cannot interrupt, for a process that would otherwise wait timeout_minutes (30 by
default) in C++ with nothing printed: a thread watches the clock and ends the process itself, which works whatever
the main thread is blocked in (the store's, gloo's and NCCL's waits release the GIL).

- The start of a process group (`StartWatchdog`): joining it (init_process_group) and the first all-reduce together
  end within `network_check_seconds`, or the process stops with one line saying what it was waiting for.
  init_process_group waits for the other ranks in the store's and the backend's C++ code (NCCL's eager start with
  `device_id` as long), and NCCL's `wait(timeout)` returns at once and leaves the wait to the next read.
- The end of a process that lost a peer (`exit_within`): its line is written, and what is left (a save in flight,
  the process group's end) may wait on the lost process; it ends within the bound, so that torchrun can restart it.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from utils.cli import report
from utils.errors import NetworkError

EXIT_STATUS = 1  # a user error's, as the line is one (utils/cli.py)


def exit_within(seconds: float) -> None:
    """End this process with EXIT_STATUS in `seconds` unless it has ended by then (its error line written already)."""
    def end() -> None:
        time.sleep(seconds)
        os._exit(EXIT_STATUS)

    threading.Thread(target=end, name="exit-watchdog", daemon=True).start()


class StartWatchdog:
    """Started for `seconds`; the main thread names what it waits for (`phase`) as it goes and calls
    `stand_down()` when the start is over, either way. If it has not by then, this process writes
    `error: <line(phase)>` on stderr and exits with EXIT_STATUS."""

    def __init__(self, seconds: float, line: Callable[[str], str]) -> None:
        self.deadline = time.monotonic() + seconds
        self.phase = "the start"
        self._line = line
        self._stood_down = threading.Event()
        self._claim = threading.Lock()  # whoever takes it reports: the main thread's own error, or this watchdog
        self._thread = threading.Thread(target=self._watch, name="start-watchdog", daemon=True)
        self._thread.start()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def stand_down(self) -> None:
        """The start is over (it succeeded, or its error is about to be raised): the watchdog stands down. If it
        has already begun to report, this waits for the process to end, so that only its line is written."""
        if not self._claim.acquire(blocking=False):
            self._thread.join()  # the watchdog ends the process
        self._stood_down.set()

    def _watch(self) -> None:
        if self._stood_down.wait(self.remaining()) or not self._claim.acquire(blocking=False):
            return
        # Ending the process is the only way out of the C++ wait; the line goes to stderr here because no caller
        # above the blocked main thread will ever see an exception.
        report(NetworkError(self._line(self.phase)))
        os._exit(EXIT_STATUS)
