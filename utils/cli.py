"""How every command line reports a user error (one line on stderr, exit status 1) and a Ctrl-C (one line,
exit status 130, as train.py)."""
from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

from utils.compat import require_supported_torch
from utils.errors import UserError
from utils.launcher import launched_rank


def report(error: UserError) -> None:
    """Print ``error: <message>`` on stderr, prefixed with the process's rank under torchrun."""
    process = launched_rank()
    prefix = f"[rank {process}] " if process else ""
    # One write: ranks share a terminal or pipe, and a line written in pieces interleaves with theirs.
    sys.stderr.write(f"error: {prefix}{error}\n")
    sys.stderr.flush()


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """For a command line's main(): a UserError ends it with its one sentence and exit status 1 (a torch
    older than pairface supports is one, found first); a Ctrl-C with one line and exit status 130, not a
    traceback (what the command had written is undone by its own context managers on the way out)."""
    try:
        require_supported_torch()
        yield
    except UserError as error:
        report(error)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        sys.stderr.write("stopped by Ctrl-C\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_INTERRUPTED) from None


def ignore_ctrl_c() -> None:
    """A worker pool's initializer: a terminal's Ctrl-C reaches every process of its job, and each worker would
    print a traceback of its own; the pool's owner reports it once and ends the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
