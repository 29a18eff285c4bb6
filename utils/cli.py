"""How every command line reports a user error: one line on stderr and exit status 1."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """For a command line's main(): a UserError ends it with its one sentence and exit status 1 (a torch
    older than pairface supports is one, found first)."""
    try:
        require_supported_torch()
        yield
    except UserError as error:
        report(error)
        raise SystemExit(1) from None
