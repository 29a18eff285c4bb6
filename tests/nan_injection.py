"""Fault injection for the non-finite guard: rank 0's loss becomes NaN at chosen global steps (1-based,
as logged), in the real training loop, which itself knows nothing of it.

    python -m tests.nan_injection 2,12 configs/X.py --set ...            # one process
    torchrun --nproc_per_node 2 -m tests.nan_injection 3 configs/X.py ...  # rank 0 of two

In a test process, ``with nan_at_steps({5, 6}): train.main(argv)`` does the same.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Collection, Iterator

import train
from training.state import TrainingState
from utils.distributed import is_main


def _nan_loss(module, inputs, output):
    loss, per_view = output
    return loss + float("nan"), per_view


@contextlib.contextmanager
def nan_at_steps(steps: Collection[int]) -> Iterator[None]:
    """While inside, train.py's steps numbered in `steps` get a NaN loss on rank 0 (and so NaN gradients)."""
    real_step = train.train_step

    def step_with_nan(state: TrainingState, micro_batches, cfg):
        step = state.scheduler.last_epoch + 1  # the schedule moves once per step, skipped ones included
        hook = state.pfc.register_forward_hook(_nan_loss) if is_main() and step in steps else None
        try:
            return real_step(state, micro_batches, cfg)
        finally:
            if hook is not None:
                hook.remove()

    train.train_step = step_with_nan
    try:
        yield
    finally:
        train.train_step = real_step


def main(argv: list[str]) -> int:
    steps = {int(step) for step in argv[0].split(",")}
    with nan_at_steps(steps):
        return train.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
