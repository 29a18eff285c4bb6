"""Work that rank 0 alone does, failing there: two processes started by hand, as srun starts them (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and SLURM_LOCALID set, no torchrun agent to end the others). In each
place every rank exits within seconds of the other, non-zero, printing rank 0's own error line (rank 1's
prefixed `[rank 1]`), never "lost contact with another process".
"""
from __future__ import annotations

import resource
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.run_helpers import arguments, start_command
from tests.test_multinode import free_port

STEPS = ["max_steps=2"]


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
def outcomes(data, tmp_path_factory) -> dict[str, list[tuple[int, float, str]]]:
    """Every place's pair of processes, run side by side: (exit status, exit time, stderr) per rank."""
    started = {}
    for place, (prepare, _) in PLACES.items():
        output = tmp_path_factory.mktemp("by_hand") / "run"
        overrides = prepare(output)
        started[place] = start_by_hand(data, output, overrides, free_port(), place == "writing backbone.pth")
    ended: dict[str, list] = {place: [None, None] for place in started}
    deadline = time.monotonic() + 300
    while any(None in times for times in ended.values()) and time.monotonic() < deadline:
        for place, processes in started.items():
            for rank, process in enumerate(processes):
                if ended[place][rank] is None and process.poll() is not None:
                    ended[place][rank] = time.monotonic()
        time.sleep(0.05)
    results = {}
    for place, processes in started.items():
        for process in processes:
            if process.poll() is None:
                process.kill()
        results[place] = [(process.wait(), ended[place][rank], process.communicate()[1])
                          for rank, process in enumerate(processes)]
    return results


@pytest.mark.parametrize("place", PLACES)
def test_a_rank0_failure_stops_every_rank_with_its_own_line(outcomes, place):
    (status0, end0, err0), (status1, end1, err1) = outcomes[place]
    assert end0 is not None and end1 is not None, (err0[-2000:], err1[-2000:])
    assert status0 == status1 == 1, (err0[-2000:], err1[-2000:])
    assert abs(end0 - end1) < 15  # no rank waits for a collective timeout
    line0 = [line for line in err0.splitlines() if line.startswith("error: ")]
    line1 = [line for line in err1.splitlines() if line.startswith("error: ")]
    assert len(line0) == len(line1) == 1, (err0[-2000:], err1[-2000:])
    assert PLACES[place][1] in line0[0] and "lost contact" not in line0[0] + line1[0]
    assert line1[0] == line0[0].replace("error: ", "error: [rank 1] ", 1)
