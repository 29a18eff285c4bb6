"""Elastic runs: two localhost "nodes" (two torchrun launchers, one process each, `--nnodes=1:2`, c10d
rendezvous, `--max-restarts`) train one run; a node is SIGKILLed mid-run, and torchrun restarts the
survivor, which continues from the last checkpoint on its own (no --resume, no edited config); in the
second run the node comes back and the run grows to two processes again. Plus what decides that a start
continues a run: resume="auto", and the torchrun run id the run folder's lock remembers.

40 two-view records, batch 2: 10 steps per epoch on 2 processes, 20 on 1; 4 epochs; a save every 2 steps.
The rendezvous store is held by the test, as a real job's must be held by a machine that outlives the nodes.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from checkpoint.pointer import POINTER_NAME
from checkpoint.run_dir import AUTO, LOCK_NAME, continues_torchrun_run, lock_run_dir, resolve_resume
from checkpoint.sources import SavedCheckpoint
from gpu_acceptance.runs import arguments, load_run, scalars
from tests.run_helpers import descendants, free_port, kill_node, start_command

SAVE_EVERY, EPOCHS, LR = 2, 4, 0.1  # QUIET's lr; no warmup
# A node is dead for the rendezvous once it has missed keep_alive_interval x keep_alive_max_attempt seconds of
# heartbeats, and a survivor's restart waits that long for a lost node. 3 s was too short on a loaded machine: a
# starved agent of a live node missed them, and the node coming back, finding no live node in the run, started a run
# of its own (refused its folder four times, and failed). 10 s: each lost node costs 7 s more than 3 did.
KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=10"
# A worker that trains, saves or waits for its peers at a step uses some CPU every few seconds, however loaded the
# machine (rank 1 writes nothing while it trains: output is no sign of life). One that has used none for this long,
# not stopped by the test, is hung: blocked for good (a collective's own timeout is 30 minutes).
HUNG_AFTER = 120
# A worker's start (init_process_group and the first all-reduce) that waits for a node which will not come, or one
# that lost its peer and waits on it on its way out, ends at this bound with its line, and torchrun restarts it: well
# inside HUNG_AFTER, so that the product's bound, not the test's, is what such a wait meets.
CHECK_SECONDS = 60
OVERRIDES = ("batch_size=2", f"save_every_steps={SAVE_EVERY}", f"num_epoch={EPOCHS}",
             f"network_check_seconds={CHECK_SECONDS}")
pytestmark = pytest.mark.slow  # torchrun's rendezvous rounds and restarts: ~2 minutes of mostly waiting


class Node:
    """One torchrun launcher ("node") with one training process; its output goes to a file to read while it runs."""

    def __init__(self, name: str, job: SimpleNamespace) -> None:
        self.log = job.output.parent / f"{name}.out"
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
                   "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{job.port}",
                   f"--rdzv-id={job.run_id}", f"--rdzv-conf=last_call_timeout=10,{KEEP_ALIVE}", "train.py",
                   *arguments(job.data, job.output, *OVERRIDES, f"max_steps={job.max_steps}")]
        # A node that joins a run again needs torchrun's per-round store (docs/operations.md, "Elastic runs").
        self.process = start_command(command, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, output=self.log)

    def output(self) -> str:
        return self.log.read_text()

    def worker(self) -> int:
        (pid,) = descendants(self.process.pid)
        return pid

    def finished(self, timeout: float = 400) -> None:
        """Wait for the launcher's end, which must be a success; fail at once, with the workers' stacks, when its
        workers have stopped using the CPU for HUNG_AFTER seconds (hung), or after `timeout` seconds."""
        deadline, seen, since = time.monotonic() + timeout, None, time.monotonic()
        while self.process.poll() is None:
            workers = descendants(self.process.pid)
            if (now := (workers, cpu_ticks(workers))) != seen:
                seen, since = now, time.monotonic()
            elif workers and time.monotonic() - since > HUNG_AFTER:
                self.fail_with_stacks(f"its workers have used no CPU for {HUNG_AFTER} s: hung")
            if time.monotonic() > deadline:
                self.fail_with_stacks(f"the node did not end within {timeout} s")
            time.sleep(0.5)
        assert self.process.returncode == 0, self.output()[-4000:]

    def fail_with_stacks(self, what: str) -> None:
        """Fail with the end of the node's output and where its workers were: SIGABRT makes each write every
        thread's Python stack to the output before it ends (tests/forked_commands.py)."""
        written = len(self.output())
        for worker in descendants(self.process.pid):
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(worker, signal.SIGABRT)
        time.sleep(5)  # for the stacks to be written
        kill_node(self.process)
        output = self.output()
        stacks = output[written:]
        stacks = stacks[stacks.find("Fatal Python error"):stacks.find("\nExtension modules")]  # faulthandler's
        pytest.fail(f"{self.log.name}: {what}; the end of its output:\n{output[:written][-3000:]}\n"
                    f"its workers' stacks:\n{stacks[:6000]}")


def cpu_ticks(pids: list[int]) -> int:
    """The CPU time the processes `pids` have used, in clock ticks (/proc/PID/stat's utime + stime)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks


def published(output: Path) -> dict:
    try:
        return json.loads((output / POINTER_NAME).read_text())
    except (OSError, ValueError):
        return {}


def wait_until(condition, nodes: list[Node], what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert all(node.process.poll() is None for node in nodes), f"a node ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def start_job(data: Path, output: Path, max_steps: int, nodes: list[Node]) -> SimpleNamespace:
    """A job of two nodes, added to `nodes`, and the rendezvous store they meet at: held here, as a real job's
    is held by a machine that outlives any node (torchrun would host it in whichever launcher came first)."""
    port = free_port()
    job = SimpleNamespace(data=data, output=output, port=port, run_id=uuid.uuid4().hex, max_steps=max_steps,
                          store=TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False))
    nodes += [Node(f"{output.name}-a", job), Node(f"{output.name}-b", job)]
    return job


def saved_by(processes: int, job: SimpleNamespace) -> bool:
    return published(job.output).get("world_size") == processes and published(job.output)["global_step"] >= 2


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> SimpleNamespace:
    root, nodes = tmp_path_factory.mktemp("elastic"), []
    try:
        # One job at a time until its node is lost: a job left running while the other is watched could
        # train past the steps its survivor is meant to train alone.
        lost = start_job(data, root / "lost", 30, nodes)
        survivor, dead = nodes
        wait_until(lambda: saved_by(2, lost), [survivor, dead], "a checkpoint of two processes")
        kill_node(dead.process)
        grown = start_job(data, root / "grown", 24, nodes)
        first, gone = nodes[2:]
        wait_until(lambda: saved_by(2, grown), [first, gone], "a checkpoint of two processes")
        kill_node(gone.process)
        wait_until(lambda: saved_by(1, grown), [first], "a checkpoint of the survivor alone")
        # Hold the survivor still while the node comes back, so that the run has not ended before it joins;
        # torchrun stops the survivor for the new rendezvous with a SIGTERM, delivered once it runs again.
        os.kill(first.worker(), signal.SIGSTOP)
        # (torchrun logs "... closing signal SIGTERM" for a worker process, "... via signal SIGTERM" for a forked one)
        stops_before = first.output().count("signal SIGTERM")
        nodes.append(Node("grown-b2", grown))
        wait_until(lambda: first.output().count("signal SIGTERM") > stops_before, [first, nodes[-1]],
                   "the survivor stopped for the returning node")
        os.kill(first.worker(), signal.SIGCONT)
        for node in (survivor, first, nodes[-1]):
            node.finished()
    finally:
        for node in nodes:
            if node.process.poll() is None:
                kill_node(node.process)  # whatever a failure left running
    return SimpleNamespace(lost=lost.output, grown=grown.output)


def restart_line(before: str, after: int, step: int) -> str:
    return (f"torchrun restarted this run (a process or node was lost, or one joined): {before} -> {after} "
            f"process(es); it continues from its last checkpoint, at global step {step}; steps taken after that "
            f"checkpoint before the restart are trained again (at most save_every_steps={SAVE_EVERY})")


def renumbering(before: str, after: str) -> str:
    """The resume's line for a renumbering: (the saved step, the LR schedule's step, the shown step)."""
    return (rf"{before} steps per epoch with {after}: step (\d+) becomes step (\d+) of the LR schedule; the log and "
            r"TensorBoard go on counting from step (\d+);")


def test_the_survivor_of_a_lost_node_finishes_alone_from_the_last_checkpoint(runs):
    log = (runs.lost / "training.log").read_text()
    renumbered = re.search(r"resuming a run of 2 process\(es\) and " + renumbering("10", "1 and 20"), log)
    assert renumbered is not None, log[-3000:]
    saved, resumed, shown = map(int, renumbered.groups())
    assert resumed == 2 * saved and shown == saved
    two_processes = log[log.rindex("2 process(es), 10 steps per epoch", 0, renumbered.start()):renumbered.start()]
    assert "error: " in two_processes  # why the survivor's process stopped, in the log
    reached = max(int(step) for step in re.findall(r"Global Step: (\d+) ", two_processes))
    assert saved <= reached <= saved + SAVE_EVERY  # at most save_every_steps lost
    assert restart_line("2 process(es)", 1, shown) in log
    final = load_run(runs.lost)
    assert final["world_size"] == 1 and final["progress"]["global_step"] == 30
    # The LR schedule goes on at the renumbered step: logged at shown step s, 1-based, the LR of schedule step
    # s - 1 - (shown - resumed) of 20 x 4.
    lr_logged = scalars(runs.lost, "learning_rate")
    for step in range(resumed + 1, 31):
        assert lr_logged[step + shown - resumed] == pytest.approx(LR * (1 - (step - 1) / (20 * EPOCHS)) ** 2,
                                                                  rel=1e-6), step


def test_a_node_that_comes_back_grows_the_run_at_the_next_restart_losing_nothing(runs):
    log = (runs.grown / "training.log").read_text()
    lost = re.search(renumbering("10", "1 and 20"), log)
    assert lost is not None, log[-3000:]
    assert restart_line("2 process(es)", 1, int(lost.group(3))) in log
    preempted = re.findall(r"preempted at global step (\d+): checkpoint saved; continue with: .* --resume", log)
    assert preempted, log[-3000:]
    stopped = int(preempted[-1])  # torchrun stopped the survivor with a SIGTERM for the new rendezvous
    grown = re.search(r"resuming a run of 1 process\(es\) and " + renumbering("20", "2 and 10"), log)
    assert grown is not None, log[-3000:]
    saved, resumed, shown = map(int, grown.groups())
    assert resumed == round(saved / 2) and shown == stopped
    assert restart_line("1 process(es)", 2, stopped) in log
    final = load_run(runs.grown)
    assert final["world_size"] == 2 and final["progress"]["global_step"] == 24


def test_resume_auto_starts_a_fresh_folder_and_continues_a_run(tmp_path):
    assert resolve_resume(str(tmp_path / "new"), AUTO) is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "training.log").write_text("a run that stopped before its first save\n")
    assert resolve_resume(str(tmp_path / "run"), AUTO) is None
    (tmp_path / "run" / POINTER_NAME).write_text("{}")
    assert resolve_resume(str(tmp_path / "run"), AUTO) == (SavedCheckpoint(), tmp_path / "run" / POINTER_NAME)


def test_only_the_torchrun_run_that_last_held_a_run_folder_continues_it(tmp_path):
    output = str(tmp_path / "run")
    lock_run_dir(output, "job-7").close()
    assert not continues_torchrun_run(output, "job-7")  # nothing saved yet: a restart starts the run afresh
    (tmp_path / "run" / POINTER_NAME).write_text("{}")
    assert continues_torchrun_run(output, "job-7")
    assert not continues_torchrun_run(output, "job-8")  # another launch into a run folder is refused as ever
    assert not continues_torchrun_run(output, None)
    lock_run_dir(output).close()  # taken over by a run outside torchrun
    assert (tmp_path / "run" / LOCK_NAME).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    assert not continues_torchrun_run(output, "job-7")
