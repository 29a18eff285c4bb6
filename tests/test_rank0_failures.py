"""Work that rank 0 alone does, failing there: two processes started by hand, as srun starts them (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and SLURM_LOCALID set, no torchrun agent to end the others). In each
place every rank exits, non-zero, printing rank 0's own error line (rank 1's prefixed `[rank 1]`: it learned
of rank 0's error), never "lost contact with another process" (it waited for rank 0 in a collective).
"""
from __future__ import annotations

import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_acceptance.runs import arguments
from tests.run_helpers import start_command
from tests.test_multinode import free_port

STEPS = ["max_steps=2"]
BOUND_SECONDS = 300  # for both ranks of every place, run side by side on a loaded 2-core machine


def _limit_rank0_file_size() -> None:
    """Rank 0 only: files past 256 KiB fail with EFBIG, as on a full disk (backbone.pth is ~1 MB)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))


def _lock_is_a_folder(output: Path) -> list[str]:
    (output / ".lock").mkdir(parents=True)
    return []


def _damaged_bin(output: Path) -> list[str]:
    damaged = output.parent / "lfw.bin"
    damaged.write_bytes(b"\x80\x04\x95")  # a pickle cut short after its header
    return [f"val_targets=('{damaged}',)"]


def _full_disk_on_rank0(output: Path) -> list[str]:
    return ["save_all_states=False"]


PLACES = {  # how rank 0 is made to fail, and what its line says
    "the run folder's lock": (_lock_is_a_folder, "cannot use output folder"),
    "reading a verification .bin": (_damaged_bin, "is not a verification .bin"),
    "writing backbone.pth": (_full_disk_on_rank0, "could not write"),
}


def start_by_hand(data: Path, output: Path, overrides: list[str], port: int, limit_rank0: bool) -> list:
    processes = []
    for rank in (0, 1):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        prepare = _limit_rank0_file_size if limit_rank0 and rank == 0 else None
        processes.append(start_command([sys.executable, "train.py", *arguments(data, output, *STEPS, *overrides)],
                                       env=env, prepare=prepare))
    return processes


@pytest.fixture(scope="module")
def outcomes(data, tmp_path_factory) -> dict[str, list[tuple[int | None, str]]]:
    """Every place's pair of processes, run side by side: (exit status, stderr) per rank; status None for a rank
    still running at the bound (killed then). A rank that waited for a collective instead of learning of rank 0's
    error would still be running: the collective timeout (timeout_minutes, 30 by default) is far past the bound."""
    started = {}
    for place, (prepare, _) in PLACES.items():
        output = tmp_path_factory.mktemp("by_hand") / "run"
        overrides = prepare(output)
        started[place] = start_by_hand(data, output, overrides, free_port(), place == "writing backbone.pth")
    deadline = time.monotonic() + BOUND_SECONDS
    results = {}
    for place, processes in started.items():
        results[place] = []
        for process in processes:
            try:
                status = process.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                status = None
                process.kill()
            results[place].append((status, process.communicate()[1]))
    return results


@pytest.mark.parametrize("place", PLACES)
def test_a_rank0_failure_stops_every_rank_with_its_own_line(outcomes, place):
    (status0, err0), (status1, err1) = outcomes[place]
    assert status0 == status1 == 1, (status0, status1, err0[-2000:], err1[-2000:])
    line0 = [line for line in err0.splitlines() if line.startswith("error: ")]
    line1 = [line for line in err1.splitlines() if line.startswith("error: ")]
    assert len(line0) == len(line1) == 1, (err0[-2000:], err1[-2000:])
    assert PLACES[place][1] in line0[0] and "lost contact" not in line0[0] + line1[0]
    assert line1[0] == line0[0].replace("error: ", "error: [rank 1] ", 1)
