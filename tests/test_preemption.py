"""Preemption through the real command line: SIGTERM or SIGUSR1 to a run, to one rank of it or to
torchrun, and every process saves a checkpoint at the same step boundary and exits with status 75; the
checkpoint is at the step it stopped, and --resume goes on as the uninterrupted run would, bit for bit.

40 two-view records, batch 2: 20 steps per epoch on 1 process, 10 on 2; 12 steps in all, no save before
the end of the epoch but the preemption's. Each run is signalled once it has logged step 3.
  whole1:   1 process, 12 steps uninterrupted (in this process)
  term1:    `python train.py`, SIGTERM over and over until it logs its stop (signals during the save included);
            then resumed with resume="auto" to 12 (in this process)
  whole2:   torchrun, 2 processes, 12 steps uninterrupted
  usr1:     torchrun, 2 processes, SIGUSR1 to rank 1 alone; then --resume to 12 on 2 processes
  agent:    torchrun, 2 processes, SIGTERM to torchrun, which forwards it to both; then --resume to 12
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from checkpoint.pointer import POINTER_NAME
from tests.run_helpers import assert_same_run, descendants, finish, run_here, start_cli, wait_for_log

OVERRIDES = ["batch_size=2", "max_steps=12"]
PREEMPTED = re.compile(r"preempted at global step (\d+): checkpoint saved; continue with: .* --resume")
pytestmark = pytest.mark.slow  # five torchrun launches and a python train.py: 16 Python starts


def wait_for_step(output: Path, process: subprocess.Popen, step: int = 3) -> None:
    """Until `output`'s log shows global step `step` (the run is mid-epoch, saving nothing by itself)."""
    wait_for_log(output, f"Global Step: {step} ", lambda: process.poll() is None)


def worker_of_rank(agent: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker process of `rank`, read from the workers' environments."""
    for pid in descendants(agent.pid):
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return pid
    raise AssertionError(f"no worker of rank {rank} under torchrun {agent.pid}")


def signal_until_stopped(process: subprocess.Popen, output: Path, number: int, every: float = 0.05) -> None:
    """`number` to `process` again and again until it logs its stop: the later ones arrive while it saves."""
    while not PREEMPTED.search((output / "training.log").read_text()):
        assert process.poll() is None, process.communicate()[1][-3000:]
        os.kill(process.pid, number)
        time.sleep(every)


def stopped_step(output: Path) -> int:
    """The step of the one preemption line in the log; the checkpoint must be at that very step."""
    steps = [int(step) for step in PREEMPTED.findall((output / "training.log").read_text())]
    assert len(steps) == 1, steps
    assert json.loads((output / POINTER_NAME).read_text())["global_step"] == steps[0]
    return steps[0]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("preemption")
    whole2 = start_cli(data, root / "whole2", *OVERRIDES, nproc=2)
    # Each run to be signalled starts only when it is watched: 12 tiny steps take seconds, and one left
    # running while another is handled could finish before its signal.
    term1 = start_cli(data, root / "term1", *OVERRIDES, nproc=0)
    wait_for_step(root / "term1", term1)
    signal_until_stopped(term1, root / "term1", signal.SIGTERM)
    # The real command line: torchrun's report lists each worker process that failed (of forked workers, the first)
    usr1 = start_cli(data, root / "usr1", *OVERRIDES, nproc=2, real=True)
    wait_for_step(root / "usr1", usr1)
    os.kill(worker_of_rank(usr1, 1), signal.SIGUSR1)
    agent = start_cli(data, root / "agent", *OVERRIDES, nproc=2)
    wait_for_step(root / "agent", agent)
    agent.send_signal(signal.SIGTERM)
    assert run_here(data, root / "whole1", *OVERRIDES) == (0, "")
    outcome = SimpleNamespace(root=root)
    for name, process in (("term1", term1), ("usr1", usr1), ("agent", agent)):
        _, stderr = process.communicate(timeout=300)
        setattr(outcome, name, SimpleNamespace(status=process.returncode, stderr=stderr,
                                               step=stopped_step(root / name)))
    resumed = [start_cli(data, root / name, *OVERRIDES, nproc=2, resume=True) for name in ("usr1", "agent")]
    assert run_here(data, root / "term1", *OVERRIDES, "resume=auto") == (0, "")
    for process in (whole2, *resumed):
        finish(process)
    return outcome


def test_sigterm_to_a_single_process_saves_where_it_stopped_and_resumes_as_the_uninterrupted_run(runs):
    assert runs.term1.status == 75, runs.term1.stderr[-3000:]
    assert 3 <= runs.term1.step < 12
    assert "Traceback" not in runs.term1.stderr
    assert_same_run(runs.root / "term1", runs.root / "whole1")


def test_sigusr1_to_one_rank_stops_every_rank_at_the_same_step_with_status_75(runs):
    # torchrun lists each worker that exited non-zero with its status, then exits 1 itself.
    assert runs.usr1.status == 1
    statuses = re.findall(r"exitcode\s*: (-?\d+) \(pid", runs.usr1.stderr)
    assert sorted(statuses) == ["75", "75"], runs.usr1.stderr[-3000:]
    assert 3 <= runs.usr1.step < 12
    assert_same_run(runs.root / "usr1", runs.root / "whole2")


def test_sigterm_to_torchrun_is_forwarded_and_every_rank_saves_before_it_exits(runs):
    assert 3 <= runs.agent.step < 12
    log = (runs.root / "agent" / "training.log").read_text()
    log = log[:log.index("resumed from")]  # the preempted run's part (the resume to 12 finishes training)
    assert "SIGTERM: saving a checkpoint after this step, then stopping" in log
    assert "training finished" not in log
    assert runs.agent.status == 1 and "got signal: 15" in runs.agent.stderr  # torchrun's own report of the signal
    assert_same_run(runs.root / "agent", runs.root / "whole2")
