"""tests.distributed_helpers.run_world bounds every wait: a collective that a peer never joins fails its test
with gloo's error naming the collective, and a world that hangs elsewhere is killed and fails, naming the
function and the ranks still running, with where each of them was."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.distributed_helpers import run_world


def _rank0_waits_at_a_barrier_rank1_never_joins(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()
    else:
        threading.Event().wait()  # a hang: the test's deadline ends it


def _rank1_hangs_outside_any_collective(rank: int, world_size: int) -> int:
    if rank == 1:
        threading.Event().wait()
    return rank


def test_a_collective_a_peer_never_joins_fails_its_rank_with_gloo_s_timeout():
    with pytest.raises(AssertionError, match=r"(?s)rank 0 failed:.*barrier.*Timed out"):
        run_world(_rank0_waits_at_a_barrier_rank1_never_joins, 2, timeout=60,
                  collective_timeout=timedelta(seconds=2))


def test_a_world_still_running_at_its_deadline_is_killed_and_named_with_its_stacks():
    left = r"rank\(s\) \[1\] still running after 8 s, killed"
    where = r"[\s\S]*rank 1:[\s\S]*in wait[\s\S]*_rank1_hangs_outside_any_collective"
    with pytest.raises(AssertionError,
                       match=r"_rank1_hangs_outside_any_collective on 2 process\(es\): " + left + where):
        run_world(_rank1_hangs_outside_any_collective, 2, timeout=8)
