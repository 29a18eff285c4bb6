"""The process groups (utils/distributed.py) under torchrun: a group made beside the default one waits at a
collective as long as timeout_minutes says, not torch's own default of 30 minutes for a new gloo group.

Run as a script under torchrun, this file is the probe: rank 0 all-reduces on checkpoint_group() while rank 1,
alive, never joins; rank 0 prints how its collective ended."""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from tests.run_helpers import run_command
from utils.distributed import checkpoint_group, init_distributed, rank

TIMEOUT_MINUTES = 0.03  # 1.8 s
PEER_ALIVE_SECONDS = 20  # rank 1 stays this long: a collective still waiting then sees its peer leave instead


def probe() -> None:
    init_distributed(torch.device("cpu"), timeout_minutes=TIMEOUT_MINUTES)
    group = checkpoint_group()
    if rank() == 1:
        time.sleep(PEER_ALIVE_SECONDS)
        return
    try:
        dist.all_reduce(torch.ones(1), group=group)
        print("the collective completed")
    except RuntimeError as error:
        print("timed out" if "timed out" in str(error).lower() else f"other error: {error}")
    sys.stdout.flush()


def test_the_checkpoint_group_waits_at_a_collective_as_long_as_timeout_minutes_says():
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          __file__], timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "timed out", result.stdout + result.stderr[-2000:]


if __name__ == "__main__":
    probe()
