"""A rank that joins its job's process group late and then never takes part in a collective, as a rank stalled
between its start and its first step (or one whose network carries no collective) looks to the others:

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python -m tests.silent_rank DELAY_SECONDS

It prints `joined` once in the group, then sleeps until it is killed.
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main(delay: float) -> None:
    time.sleep(delay)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(minutes=5))
    print("joined", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(float(sys.argv[1]))
