"""Fault injection for the non-finite guard: rank 0's loss becomes NaN at chosen global steps (1-based,
as logged), in the real training loop, which itself knows nothing of it.

    python -m tests.nan_injection 2,12 configs/X.py --set ...            # one process
    torchrun --nproc_per_node 2 -m tests.nan_injection 3 configs/X.py ...  # rank 0 of two

In a test process, ``with nan_at_steps({5, 6}): train.main(argv)`` does the same, and
``with overflow_at_steps({1, 2, 3}): ...`` gives rank 0 an infinite centre gradient under a finite loss
instead (what a float16 overflow in the backward looks like to the step).
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Collection, Iterator

import torch

import train
from training.state import TrainingState
from utils.distributed import is_main


def _nan_loss(module, inputs, output):
    loss, per_view = output
    return loss + float("nan"), per_view


def _overflow(grad):
    return grad.index_fill(0, torch.tensor([0], device=grad.device), float("inf"))


@contextlib.contextmanager
def _at_steps(steps: Collection[int], inject: Callable[[TrainingState], Callable[[], None]]) -> Iterator[None]:
    """While inside, train.py's steps numbered in `steps` run on rank 0 with `inject(state)` in place (it
    returns what takes it out again)."""
    real_step = train.train_step

    def injected_step(state: TrainingState, micro_batches, cfg):
        step = state.scheduler.last_epoch + 1  # the schedule moves once per step, skipped ones included
        remove = inject(state) if is_main() and step in steps else None
        try:
            return real_step(state, micro_batches, cfg)
        finally:
            if remove is not None:
                remove()

    train.train_step = injected_step
    try:
        yield
    finally:
        train.train_step = real_step


def nan_at_steps(steps: Collection[int]) -> contextlib.AbstractContextManager:
    """While inside, train.py's steps numbered in `steps` get a NaN loss on rank 0 (and so NaN gradients)."""
    return _at_steps(steps, lambda state: state.pfc.register_forward_hook(_nan_loss).remove)


def overflow_at_steps(steps: Collection[int]) -> contextlib.AbstractContextManager:
    """While inside, train.py's steps numbered in `steps` get an infinite centre gradient on rank 0, the loss
    finite: an overflow that an fp16 grad scaler backs off from."""
    return _at_steps(steps, lambda state: state.pfc.weight.register_hook(_overflow).remove)


def main(argv: list[str]) -> int:
    steps = {int(step) for step in argv[0].split(",")}
    with nan_at_steps(steps):
        return train.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
