"""The network between nodes, on two torchrun launchers on 127.0.0.1 (`--nnodes=2`, one process each): a network
interface that does not exist (GLOO_SOCKET_IFNAME=nonexistent0) stops each rank before the first step with one
line naming its host, its interfaces, the interface it was told to use and the variables that fix it; --dry-run
prints what each rank sees of the network."""
from __future__ import annotations

import re
import socket
import sys

from gpu_acceptance.runs import CONFIG, arguments
from tests.run_helpers import free_port, start_command
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
