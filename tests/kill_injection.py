"""Fault injection for crash safety: SIGKILL this process at the first call of a chosen function whose
first argument matches a pattern, before the call does anything, in the real training code, which
itself knows nothing of it.

    python -m tests.kill_injection os replace 'checkpoint\\.json' configs/X.py --set ...        # one process
    torchrun --nproc_per_node 2 -m tests.kill_injection os replace 'checkpoint\\.json' configs/X.py ...  # rank 0
    torchrun --nproc_per_node 2 -m tests.kill_injection --fsize 262144 configs/X.py ...  # every rank, a full disk
    python -m tests.kill_injection --kill-children checkpoint.sharded write_state configs/X.py ...  # its data workers

In a test, `KillSelfAt(...)`, `KillChildrenAt(...)` and `LimitFileSize(bytes)` are a `prepare` for
run_helpers.run_child.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import train


@dataclass(frozen=True)
class KillSelfAt:
    """SIGKILL this process (rank 0 of several: RANK unset or 0) at its first call of `owner.function`
    (`owner` an importable dotted name, `module:Class` for a class) whose first argument, as a string,
    matches the regular expression `pattern` (any call when None)."""

    owner: str
    function: str
    pattern: str | None = None

    def __call__(self) -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        module, _, attribute = self.owner.partition(":")
        owner = importlib.import_module(module)
        owner = getattr(owner, attribute) if attribute else owner
        real = getattr(owner, self.function)

        def fatal(*args, **kwargs):
            if self.pattern is None or re.search(self.pattern, str(args[0])):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(owner, self.function, fatal)


@dataclass(frozen=True)
class KillChildrenAt:
    """SIGKILL every child process of this one (its data workers) at its first call of `owner.function`, then
    wait `seconds` inside that call, so that their deaths are noticed there (as the OOM killer's pick would be)."""

    owner: str
    function: str
    seconds: float = 0.5

    def __call__(self) -> None:
        module = importlib.import_module(self.owner)
        real = getattr(module, self.function)

        def fatal(*args, **kwargs):
            for listing in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
                for child in listing.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(child), signal.SIGKILL)
            time.sleep(self.seconds)
            return real(*args, **kwargs)

        setattr(module, self.function, fatal)


@dataclass(frozen=True)
class LimitFileSize:
    """Writes past `size` bytes fail with EFBIG, as on a full disk."""

    size: int

    def __call__(self) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.size, self.size))


def main(argv: list[str]) -> int:
    if argv[0] == "--fsize":
        LimitFileSize(int(argv[1]))()
        return train.main(argv[2:])
    if argv[0] == "--kill-children":
        KillChildrenAt(argv[1], argv[2])()
        return train.main(argv[3:])
    owner, function, pattern, *rest = argv
    KillSelfAt(owner, function, pattern)()
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
