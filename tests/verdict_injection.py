"""Makes a config error under torchrun a worst case: rank 0 prints its line only once every other rank has
finished with the same error and is about to exit, the moment at which an exit of theirs would have torchrun
end rank 0 before its line.

    torchrun --nproc_per_node 2 -m tests.verdict_injection MARKERS configs/X.py --set typo=1 ...

Each rank other than 0 creates MARKERS/rank<N> when it has handled its config error (when it starts waiting
for rank 0's verdict); rank 0 holds its config error's line until every marker exists. Rank 0 never sees the
markers if the others exit without waiting: torchrun then ends it with its line unprinted. The training code
knows nothing of this.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import train
from utils.errors import ConfigError

MARKERS_TIMEOUT = 120.0  # seconds rank 0 waits for the markers: far longer than the others take to reach theirs


def hold_rank0_until_the_others_have_handled_theirs(markers: Path) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank != 0:
        real_wait = train.rank0_had_config_error

        def marked_wait(phase: str) -> bool:
            (markers / f"rank{rank}").touch()
            return real_wait(phase)

        train.rank0_had_config_error = marked_wait
        return
    real_report = train.report

    def held_report(error) -> None:
        if isinstance(error, ConfigError):
            deadline = time.monotonic() + MARKERS_TIMEOUT
            while not all((markers / f"rank{other}").exists() for other in range(1, world_size)):
                if time.monotonic() > deadline:
                    break  # the line is printed all the same; the test then sees that no marker came
                time.sleep(0.01)
        real_report(error)

    train.report = held_report


def main(argv: list[str]) -> int:
    hold_rank0_until_the_others_have_handled_theirs(Path(argv[0]))
    return train.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
