"""gpu_acceptance/gpu_throughput.sh, issue 44's GPU figures part by part, rehearsed with --tiny on this CPU: a part
runs its bench's real command and prints its table, the script ends saying every part finished; a part it does not
know is one line and exit status 2, before anything runs; the side-by-side part without its prepared arcface_torch
folder says so and fails. The tables themselves are tests/test_step_split.py's and tests/test_side_by_side.py's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.run_helpers import ROOT


def throughput(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "gpu_acceptance/gpu_throughput.sh", "--tiny", *arguments], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PY": sys.executable})


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
    assert done.stderr.strip() == ("gpu throughput: unknown part 'splt'; the parts are side_by_side, split, vit_b, "
                                   "compile, pfc")
    assert "==" not in done.stdout


@pytest.mark.skipif((ROOT / ".side-by-side" / "arcface_torch").exists(), reason="this checkout has the folder")
def test_the_side_by_side_part_without_its_arcface_torch_folder_says_how_to_prepare_it():
    done = throughput("side_by_side")
    assert done.returncode == 1
    assert ("== side_by_side: not run: no .side-by-side/arcface_torch here (docs/gpu.md says how to prepare it)"
            in done.stdout.splitlines())
    assert done.stdout.splitlines()[-1] == "gpu throughput: did not finish: side_by_side"
