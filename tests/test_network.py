"""The network between nodes, on two torchrun launchers on 127.0.0.1 (`--nnodes=2`, one process each): a network
interface that does not exist (GLOO_SOCKET_IFNAME=nonexistent0) stops each rank before the first step with one
line naming its host, its interfaces, the interface it was told to use and the variables that fix it; --dry-run
prints what each rank sees of the network. A start that would hang (a rank that never comes; one that joins the
process group and never reaches the first all-reduce) ends with that line within network_check_seconds."""
from __future__ import annotations

import re
import socket
import sys
import time

from gpu_acceptance.runs import CONFIG, arguments
from tests.run_helpers import free_port, kill_node, start_command, wait_for_log
from utils.network import ADVICE, interfaces


def two_nodes(argv: list[str], env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each of two launchers of one process each, ranks 0 and 1 of a job."""
    port = free_port()
    nodes = [start_command([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
                            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "train.py",
                            *argv], env=env) for rank in (0, 1)]
    results = []
    for node in nodes:
        out, err = node.communicate(timeout=300)
        results.append((node.returncode, out, err))
    return results


def seen() -> str:
    return ", ".join(f"{name} {address or '(no IPv4 address)'}" for name, address in interfaces().items())


def test_a_missing_network_interface_stops_every_rank_with_its_network_named(data, tmp_path):
    results = two_nodes(arguments(data, tmp_path / "run", "max_steps=1"), env={"GLOO_SOCKET_IFNAME": "nonexistent0"})
    for rank, (status, _, stderr) in enumerate(results):
        assert status != 0
        lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, stderr[-3000:]
        prefix = "" if rank == 0 else f"[rank {rank}] "
        expected = (re.escape(f"error: {prefix}the network check before the first step failed (") +
                    r"[^()]*Unable to find address for: nonexistent0\) on host " +
                    re.escape(f"{socket.gethostname()} (rank {rank} of 2, node {rank} of 2), master 127.0.0.1:") +
                    r"\d+" + re.escape(f", GLOO_SOCKET_IFNAME=nonexistent0; interfaces: {seen()}; {ADVICE}"))
        assert re.fullmatch(expected, lines[0]), lines[0]
        assert "Traceback" not in stderr.split("error: ")[0]  # the line, not a traceback of the worker


def test_a_dry_run_on_two_nodes_prints_what_each_rank_sees_of_the_network(data, tmp_path):
    results = two_nodes([CONFIG, "--set", f"rec={data}", "--dry-run"])
    for rank, (status, stdout, stderr) in enumerate(results):
        assert status == 0, stderr[-3000:]
        line = next(line for line in stdout.splitlines() if line.startswith("network, as this process sees it: "))
        assert line.startswith(f"network, as this process sees it: host {socket.gethostname()} (rank {rank} of 2, "
                               f"node {rank} of 2), master 127.0.0.1:")
        assert line.endswith(f", GLOO_SOCKET_IFNAME unset: gloo chooses the interface itself; interfaces: {seen()}")


CHECK_SECONDS = 5  # network_check_seconds of the hanging starts
# What a start that hangs may take beyond network_check_seconds on a loaded 2-core machine: the watchdog's line (it
# lists the host's interfaces) and the process's end. Without the bound these starts waited timeout_minutes (30).
LATE_BY = 10


def rank_0_alone(data, output, peer: list[str] | None = None) -> tuple[int, str, float]:
    """Rank 0 of a job of 2 started as a launcher starts it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK
    set), with network_check_seconds=CHECK_SECONDS, and `peer` (a command line) as rank 1, if any: (exit status,
    stderr, seconds from its start to its end)."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    started = time.monotonic()
    process = start_command([sys.executable, "train.py",
                             *arguments(data, output, f"network_check_seconds={CHECK_SECONDS}")], env=env)
    other = start_command([sys.executable, *peer], env={**env, "RANK": "1"}) if peer else None
    try:
        _, stderr = process.communicate(timeout=CHECK_SECONDS + 120)
        return process.returncode, stderr, time.monotonic() - started
    finally:
        for running in (process, other):
            if running is not None and running.poll() is None:
                kill_node(running)


def network_line(stderr: str, reason: str, port: str) -> None:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    expected = (re.escape(f"error: the network check before the first step failed ({reason}) on host "
                          f"{socket.gethostname()} (rank 0 of 2, node 0 of 1), master 127.0.0.1:{port}, "
                          f"GLOO_SOCKET_IFNAME unset: gloo chooses the interface itself; interfaces: {seen()}; "
                          f"{ADVICE}"))
    assert re.fullmatch(expected, lines[0]), lines[0]


def test_a_rank_that_never_comes_ends_the_start_within_network_check_seconds(data, tmp_path):
    status, stderr, seconds = rank_0_alone(data, tmp_path / "run")
    port = re.search(r"master 127\.0\.0\.1:(\d+)", stderr).group(1)
    assert status == 1, stderr[-3000:]
    network_line(stderr, f"joining the process group of 2 processes: no answer within network_check_seconds="
                         f"{CHECK_SECONDS}; master 127.0.0.1:{port} accepts connections", port)
    assert CHECK_SECONDS <= seconds < CHECK_SECONDS + LATE_BY, seconds
    assert "Traceback" not in stderr


def test_a_rank_that_joins_late_and_never_reduces_ends_the_start_at_the_first_all_reduce(data, tmp_path):
    """Rank 1 joins the process group after 2 of the 5 seconds and then does nothing: rank 0's first all-reduce
    waits for what is left of the bound (gloo's own timeout ends it, with gloo's reason), not 5 s more."""
    status, stderr, seconds = rank_0_alone(data, tmp_path / "run", peer=["-m", "tests.silent_rank", "2"])
    port = re.search(r"master 127\.0\.0\.1:(\d+)", stderr).group(1)
    assert status == 1, stderr[-3000:]
    network_line(stderr, "the first all-reduce over 2 processes: Operation timed out!", port)  # gloo's words
    assert CHECK_SECONDS - 1 <= seconds < CHECK_SECONDS + LATE_BY, seconds
    assert "Traceback" not in stderr


def _process_group_end_hangs() -> None:
    """A `prepare`: this process's (and its forked workers') process group never ends, as one may wait on a lost
    peer (a gloo group's pending work, NCCL's communicator) for timeout_minutes."""
    import utils.distributed  # noqa: PLC0415 (the launcher's copy, which its forked workers inherit)

    utils.distributed.cleanup = lambda: time.sleep(3600)


def test_a_node_lost_mid_run_leaves_its_peer_one_line_and_an_end_within_network_check_seconds(data, tmp_path):
    """Node 0 is SIGKILLed at step 2; node 1's way out (here its process group's end) waits on it for good: node 1
    still prints its one line and ends within network_check_seconds, so that torchrun could restart it."""
    port, output = free_port(), tmp_path / "run"
    nodes = [start_command([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
                            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "train.py",
                            *arguments(data, output, f"network_check_seconds={CHECK_SECONDS}", "max_steps=40")],
                           prepare=_process_group_end_hangs if rank else None) for rank in (0, 1)]
    try:
        wait_for_log(output, "Global Step: 2 ", lambda: all(node.poll() is None for node in nodes))
        kill_node(nodes[0])
        lost = time.monotonic()
        _, stderr = nodes[1].communicate(timeout=CHECK_SECONDS + 120)
        seconds = time.monotonic() - lost
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
    assert nodes[1].returncode != 0
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: [rank 1] lost contact with another process ("), stderr
    assert CHECK_SECONDS <= seconds < CHECK_SECONDS + LATE_BY, seconds
