"""conftest.leaves_nothing_behind, in a pytest session of its own (pytester): what one test starts and leaves
(a running process, an environment variable, an ignored SIGTERM, torch's numerics switches as a run or tool sets
them) is gone when the next test runs.

The session runs in a process of its own: an in-process one has every module it imported dropped when it ends,
and modules with native parts (torch.distributed's operator registrations, triton, which
torch.use_deterministic_algorithms imports) cannot be imported again by a later test."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ("pytester",)

INNER = '''
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.conftest import leaves_nothing_behind  # noqa: F401 (the autouse fixture under test)
from utils.device import configure_numerics

PID_FILE = Path(__file__).with_name("pid")
DEFAULT_NUMERICS = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
                    torch.are_deterministic_algorithms_enabled())


def test_leaves_a_process_a_variable_an_ignored_sigterm_and_numerics():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    PID_FILE.write_text(str(process.pid))
    os.environ["LEFT_BY_A_TEST"] = "1"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_numerics(torch.device("cpu"), tf32=not DEFAULT_NUMERICS[0], deterministic=not DEFAULT_NUMERICS[2])


def _running(stat: Path) -> bool:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is killed, not yet reaped
    except OSError:
        return False


def test_finds_none_of_them():
    stat = Path(f"/proc/{PID_FILE.read_text()}/stat")
    deadline = time.monotonic() + 10  # SIGKILLed: on a busy machine it may run on for a moment before it ends
    while _running(stat) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _running(stat)
    assert "LEFT_BY_A_TEST" not in os.environ
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
            torch.are_deterministic_algorithms_enabled()) == DEFAULT_NUMERICS
'''


def test_a_test_s_process_variable_signal_handler_and_numerics_end_with_it(pytester, monkeypatch):
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the inner file imports tests.conftest
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=2)


def test_a_quiet_run_ends_with_the_random_order_seed(pytester, monkeypatch):
    pytester.makeconftest("from tests.conftest import pytest_terminal_summary  # noqa: F401 (the hook under test)\n")
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-q", "-p", "randomly", "--randomly-seed=1234", "-p", "no:cacheprovider",
                                           timeout=300)
    result.assert_outcomes(passed=1)
    assert "random order seed 1234: replay this order with pytest -p randomly --randomly-seed=1234" in result.outlines
    assert not any("Using --randomly-seed" in line for line in result.outlines)  # -q: the header is not shown
