"""StopSignals.strongest_request() in two real gloo processes: a signal delivered to one rank alone stops both at
the same step boundary, with the same request, and the rank that received nothing is stopped as the signalled one is
(it too ignores the SIGTERMs that torchrun sends once a worker has exited)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from tests.distributed_helpers import run_world
from utils.stop import StopRequest, StopSignals

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGINT": signal.SIGINT}
EXPECTED = {"SIGTERM": StopRequest.PREEMPT, "SIGUSR1": StopRequest.PREEMPT, "SIGINT": StopRequest.INTERRUPT}


def _wait_for_handler(signals: StopSignals) -> None:
    """Python runs a handler in the main thread between two bytecodes after the signal arrives: poll for it."""
    deadline = time.monotonic() + 30
    while signals.requested == StopRequest.NONE:
        assert time.monotonic() < deadline, "the signal handler never ran"
        time.sleep(0.001)


def _one_rank_signalled(rank: int, world_size: int, signalled_rank: int) -> dict[str, dict]:
    """For each signal in turn: `signalled_rank` sends it to its own pid between two step boundaries; what
    every rank saw."""
    seen = {}
    for name, number in SIGNALS.items():
        sigint_before = signal.getsignal(signal.SIGINT)
        with StopSignals() as signals:
            signals.stepping = True
            first = signals.strongest_request()  # a step boundary with no signal anywhere
            if rank == signalled_rank:
                os.kill(os.getpid(), number)
                _wait_for_handler(signals)
            dist.barrier()  # the signal has been received before any rank reaches the next boundary
            own = signals.requested
            second = signals.strongest_request()
            after = signals.requested
            signals.stepping = False
        seen[name] = {"first": first, "own": own, "strongest": second, "after": after,
                      "sigterm": signal.getsignal(signal.SIGTERM), "sigusr1": signal.getsignal(signal.SIGUSR1),
                      "sigint_restored": signal.getsignal(signal.SIGINT) == sigint_before}
        dist.barrier()
    return seen


@pytest.fixture(scope="module")
def rounds() -> dict[int, list[dict]]:
    """Both ranks' observations, with the signal sent to rank 1 and then to rank 0: one spawn each."""
    return {signalled: run_world(_one_rank_signalled, 2, signalled) for signalled in (1, 0)}


@pytest.mark.parametrize("signalled", [1, 0])
@pytest.mark.parametrize("name", SIGNALS)
def test_a_signal_to_one_rank_is_the_strongest_request_of_both(rounds, signalled, name):
    quiet = 1 - signalled
    by_rank = [rank_seen[name] for rank_seen in rounds[signalled]]
    assert by_rank[quiet]["own"] == StopRequest.NONE  # this rank received nothing itself
    assert by_rank[signalled]["own"] == EXPECTED[name]
    for seen in by_rank:
        assert seen["first"] == StopRequest.NONE
        assert seen["strongest"] == EXPECTED[name]
        assert seen["after"] == EXPECTED[name]  # the quiet rank now stops as the signalled one does
    # leaving the block, every rank, the quiet one too, ignores later SIGTERMs and SIGUSR1s (a Ctrl-C acts again)
    for seen in by_rank:
        assert seen["sigterm"] == seen["sigusr1"] == signal.SIG_IGN
        assert seen["sigint_restored"]
