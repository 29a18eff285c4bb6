"""arcface_torch's learning-rate schedule: linear warmup, then polynomial decay to zero (config key lr_power).

The schedule is a pure function of the optimizer-step count, so a resumed run (whatever its
world size) lands on exactly the learning rate the uninterrupted run would have used.
"""
from __future__ import annotations

from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

POLY_POWER = 2.0  # configs/base.py's lr_power: arcface_torch's PolyScheduler; its train_v2 PolynomialLRWarmup uses 1


def poly_factor(step: int, warmup_steps: int, total_steps: int, power: float = POLY_POWER) -> float:
    """Multiplier of the base LR for the optimizer step numbered `step` (0-based).

    Upstream's PolyScheduler: `step / warmup_steps` during warmup, then
    `(1 - (step - warmup_steps) / (total_steps - warmup_steps)) ** power`, zero from total_steps on.
    A negative warmup_steps (arcface_torch's `warmup_epoch = -1`: train.py's `num_image // total_batch_size
    * warmup_epoch` is minus one epoch of steps) leaves no warmup, and the same formula then starts the
    decay below the base LR: `((total_steps - step) / (total_steps + |warmup_steps|)) ** power`.
    """
    if step < warmup_steps:
        return step / warmup_steps
    if step >= total_steps:
        return 0.0
    return (1.0 - (step - warmup_steps) / (total_steps - warmup_steps)) ** power


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    power: float = POLY_POWER) -> LambdaLR:
    """A scheduler stepped once per optimizer step; its state_dict is just the step count."""
    if total_steps < 1:
        raise ValueError(f"the LR schedule needs at least one step, got total_steps={total_steps}")
    return LambdaLR(optimizer, partial(poly_factor, warmup_steps=warmup_steps, total_steps=total_steps, power=power))


def schedule_power(scheduler: LambdaLR) -> float:
    """The decay power of a scheduler build_scheduler made."""
    return scheduler.lr_lambdas[0].keywords["power"]


def jump_to_step(scheduler: LambdaLR, step: int) -> None:
    """Put the schedule (and the optimizer's learning rates) at optimizer step `step`, as if it had
    been stepped that many times: a resumed run whose step was renumbered goes on from there."""
    scheduler.last_epoch = step
    lrs = [base_lr * factor(step) for base_lr, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
