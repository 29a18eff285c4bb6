"""The tests' forked command lines start their scripts as a new interpreter would: a torchrun worker forked
from the agent has the default handlers of the signals, not the agent's (torch elastic's, which turns SIGTERM
into an exception inside training). The reference: the same script in a new interpreter, started as from a
terminal."""
from __future__ import annotations

import signal
import subprocess
import sys

from tests.forked_commands import SIGNALS
from tests.run_helpers import run_command

SCRIPT = """
import signal
print([str(signal.getsignal(number)) for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)])
"""


def _as_from_a_terminal() -> None:
    """The signal dispositions a shell in a terminal gives a command, whatever the tests' own (under nohup or
    in a background job SIGHUP and SIGINT are ignored, and exec keeps them ignored)."""
    for number in SIGNALS:
        signal.signal(number, signal.SIG_DFL)


def test_a_forked_torchrun_worker_starts_with_a_new_interpreters_signal_handlers(tmp_path):
    script = tmp_path / "handlers.py"
    script.write_text(SCRIPT)
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          str(script)])
    assert result.returncode == 0, result.stderr[-3000:]
    fresh = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True,
                           preexec_fn=_as_from_a_terminal)
    assert result.stdout.strip().splitlines()[-1] == fresh.stdout.strip()  # what a new interpreter has


THREAD_AND_EXIT_HANDLER = """
import atexit
import threading
go = threading.Event()
atexit.register(print, "exit handler")
threading.Thread(target=lambda: go.wait() and print("thread")).start()
print("main")
go.set()
"""


def test_a_forked_command_waits_for_its_threads_then_runs_its_exit_handlers_as_an_interpreter_does(tmp_path):
    """A thread that is not a daemon still running when the script ends: the interpreter waits for it before its
    exit handlers (a forked command that ran the handlers first, or ended without the thread, would pass a run
    whose real command line hangs at its exit)."""
    script = tmp_path / "exit_order.py"
    script.write_text(THREAD_AND_EXIT_HANDLER)
    forked = run_command([sys.executable, str(script)])
    fresh = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert fresh.stdout.split("\n") == ["main", "thread", "exit handler", ""]
    assert (forked.returncode, forked.stdout) == (0, fresh.stdout)
