"""Rank 0's verdict on how a phase of the job ended, told to the other processes torchrun started.

A config error happens identically on every process: rank 0 alone prints it. torchrun ends every worker
as soon as one exits, so a rank that exited at once on the same error could cut rank 0 off before its
line. Instead the other ranks wait for rank 0's verdict (told once its line is written) and print their
own error only when rank 0 did not have it. The verdict travels through the TCPStore that torchrun's
agent serves its workers at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), which exists before
any process group and whoever exits first; its keys carry torchrun's restart count, so that a restarted
job never reads an earlier start's verdict.

Outside torchrun's agent store (one process, srun, processes started by hand) nothing ends a process
because another exited, and nothing waits.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

CONFIG_ERROR = "config error"
NO_CONFIG_ERROR = "no config error"
# How long a rank waits for rank 0's verdict. Rank 0 does the same work before it, so it normally comes at
# once; a rank 0 that died is noticed sooner by torchrun, which then ends the waiting rank.
VERDICT_TIMEOUT = timedelta(minutes=5)


def _agent_store(timeout: timedelta) -> dist.TCPStore | None:
    """A client of torchrun's agent store, or None outside one (or when it cannot be reached)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout)
    except (RuntimeError, ValueError):  # the agent is gone: torchrun is ending this worker too
        return None


def _key(phase: str) -> str:
    return f"pairface/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{phase}"


def announce_verdict(phase: str, verdict: str) -> None:
    """Rank 0: announce how `phase` ended (CONFIG_ERROR, NO_CONFIG_ERROR) to the ranks that wait for it."""
    store = _agent_store(VERDICT_TIMEOUT)
    if store is not None:
        store.set(_key(phase), verdict)


def rank0_had_config_error(phase: str, timeout: timedelta = VERDICT_TIMEOUT) -> bool:
    """Other ranks: whether rank 0 ended `phase` with a config error (and printed it), waited for. True
    outside torchrun's agent store, where no verdict travels: a config error is the same on every process.
    False when rank 0 says otherwise or says nothing within `timeout` (this rank then prints its own)."""
    store = _agent_store(timeout)
    if store is None:
        return True
    try:
        return store.get(_key(phase)).decode() == CONFIG_ERROR  # get waits for the key
    except (RuntimeError, dist.DistError):  # timed out, or the agent went away
        return False
