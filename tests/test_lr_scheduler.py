"""The LR schedule against arcface_torch's PolyScheduler arithmetic, written out independently."""
from __future__ import annotations

import pytest
import torch

from utils.lr_scheduler import build_scheduler, jump_to_step


def upstream_lr(last_epoch: int, base_lr: float, warmup_steps: int, max_steps: int) -> float:
    """arcface_torch lr_scheduler.PolyScheduler.get_lr for a given last_epoch (power 2)."""
    if last_epoch < warmup_steps:
        return base_lr * float(last_epoch) / float(warmup_steps)
    return base_lr * pow(1 - float(last_epoch - warmup_steps) / float(max_steps - warmup_steps), 2)


def lrs_seen_by_optimizer(base_lr: float, warmup: int, total: int, steps: int) -> list[float]:
    weight = torch.nn.Parameter(torch.zeros(2))
    centres = torch.nn.Parameter(torch.zeros(3, 2))
    optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [centres]}], lr=base_lr, momentum=0.9)
    scheduler = build_scheduler(optimizer, warmup, total)
    seen = []
    for _ in range(steps):
        assert optimizer.param_groups[0]["lr"] == optimizer.param_groups[1]["lr"]
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


# (-5, 50): arcface_torch's warmup_epoch = -1 at 5 steps an epoch, minus one epoch of warmup steps
@pytest.mark.parametrize("warmup, total", [(0, 50), (10, 50), (7, 7), (-5, 50)])
def test_lr_per_step_matches_upstream_formula(warmup, total):
    seen = lrs_seen_by_optimizer(0.1, warmup, total, total)
    expected = [upstream_lr(step, 0.1, warmup, total) for step in range(total)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if warmup > 0:
        assert seen[0] == 0.0 and seen[warmup - 1] == pytest.approx(0.1 * (warmup - 1) / warmup)
    if 0 <= warmup < total:
        assert seen[warmup] == pytest.approx(0.1)
    if warmup < 0:  # no warmup, and the decay starts below the base LR: (T / (T + |warmup|)) ** 2 of it
        assert seen[0] == pytest.approx(0.1 * (50 / 55) ** 2) and seen[1] == pytest.approx(0.1 * (49 / 55) ** 2)
    assert seen[-1] >= 0.0


def test_lr_after_the_last_step_is_zero_not_negative_or_growing():
    seen = lrs_seen_by_optimizer(0.1, 0, 10, 15)
    assert seen[10:] == [0.0] * 5


def test_state_dict_resumes_at_the_same_lr():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.2)
    scheduler = build_scheduler(optimizer, 5, 40)
    for _ in range(17):
        optimizer.step()
        scheduler.step()
    saved_opt, saved_sched = optimizer.state_dict(), scheduler.state_dict()

    fresh_weight = torch.nn.Parameter(torch.zeros(2))
    fresh_optimizer = torch.optim.SGD([fresh_weight], lr=0.2)
    fresh = build_scheduler(fresh_optimizer, 5, 40)
    fresh_optimizer.load_state_dict(saved_opt)
    fresh.load_state_dict(saved_sched)
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(upstream_lr(17, 0.2, 5, 40))
    fresh_optimizer.step()
    fresh.step()
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(upstream_lr(18, 0.2, 5, 40))


def test_empty_schedule_is_refused():
    with pytest.raises(ValueError, match="at least one step"):
        build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), 0, 0)


def test_a_one_step_schedule_is_allowed():
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = build_scheduler(optimizer, 0, 1)
    assert optimizer.param_groups[0]["lr"] == 0.1
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.0


@pytest.mark.parametrize("step", [0, 3, 5, 12, 40, 45])  # start, warmup, its end, decay, the end, past it
def test_jump_to_step_is_stepping_that_many_times(step):
    """A resume renumbered to another step (another world size) jumps there: the optimizer's LRs, the
    scheduler's count and every later LR are those of a schedule stepped `step` times."""
    def setup():
        weight, centres = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3, 2))
        optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [centres], "lr": 0.05}], lr=0.2)
        return optimizer, build_scheduler(optimizer, 5, 40)

    stepped_optimizer, stepped = setup()
    for _ in range(step):
        stepped_optimizer.step()
        stepped.step()
    optimizer, jumped = setup()
    jump_to_step(jumped, step)
    for _ in range(3):
        assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in stepped_optimizer.param_groups]
        assert jumped.last_epoch == stepped.last_epoch and jumped.get_last_lr() == stepped.get_last_lr()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(upstream_lr(jumped.last_epoch, 0.2, 5, 40)
                                                                 if jumped.last_epoch < 40 else 0.0, abs=1e-15)
        for opt, sched in ((optimizer, jumped), (stepped_optimizer, stepped)):
            opt.step()
            sched.step()
