"""bench/gpu_throughput.sh, issue 44's GPU figures in one call, rehearsed with --tiny on this CPU: a part runs its
bench's real command and prints its table, the script ends saying every part finished; a part it does not know is
one line and exit status 2, before anything runs. The tables themselves are tests/test_step_split.py's."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.run_helpers import ROOT


def throughput(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/gpu_throughput.sh", "--tiny", *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PY": sys.executable})


def test_a_part_runs_its_bench_and_the_script_says_every_part_finished():
    done = throughput("vit_b")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "gpu throughput: every part finished"
    assert any(line.startswith("== vit_b (limit ") and "--networks vit_b" in line for line in lines)
    assert sum(line.split()[:3] in (["vit_b", "1", "baseline"], ["vit_b", "2", "bf16"]) for line in lines) == 2


def test_an_unknown_part_is_one_line_and_nothing_runs():
    done = throughput("vit_b", "splt")
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu throughput: unknown part 'splt'; the parts are split, vit_b, compile, pfc"
    assert "==" not in done.stdout
