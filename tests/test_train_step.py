"""training.step.train_step, the optimizer step, against a dense float64 computation written out here: views taken
from each record, CosFace softmax over all centres, gradient accumulation, clipping, SGD with
weight decay and momentum, one LR step per optimizer step."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from losses import CombinedMarginLoss
from partial_fc import PartialFC
from training.state import TrainingState, build_optimizer
from training.step import StepOutcome, train_step
from utils.config import load_config
from utils.lr_scheduler import build_scheduler

B, V, D, C, S, M3 = 4, 2, 8, 5, 32.0, 0.35
LR, WD, MOMENTUM = 0.2, 5e-4, 0.9


def make_state(cfg, backbone: nn.Module | None = None) -> TrainingState:
    torch.manual_seed(3)
    if backbone is None:
        backbone = nn.Sequential(nn.AvgPool2d(8), nn.Flatten(), nn.Linear(3 * 14 * 14, D))  # no BatchNorm: exact
    pfc = PartialFC(CombinedMarginLoss(S, 1.0, 0.0, M3), D, C)
    optimizer = build_optimizer(cfg, backbone, pfc)
    return TrainingState(backbone=backbone, ddp_backbone=backbone, pfc=pfc, optimizer=optimizer,
                         scheduler=build_scheduler(optimizer, 0, 10), scaler=torch.amp.GradScaler("cpu", enabled=False),
                 precision=None)


def dense_reference(state: TrainingState, images: torch.Tensor, labels: torch.Tensor, max_norm: float):
    """Backbone and centres after one SGD step, in float64, from the formulas alone."""
    backbone = copy.deepcopy(state.backbone).double()
    centres = state.pfc.weight.detach().double().clone().requires_grad_(True)
    loss = 0.0
    for v in range(V):  # view v of record b is images[b, v]
        x = (images[:, v].double() / 255 - 0.5) / 0.5
        cos = F.normalize(backbone(x)) @ F.normalize(centres).t()
        logits = S * (cos - M3 * F.one_hot(labels, C).double())
        loss = loss + F.cross_entropy(logits, labels) / V
    loss.backward()
    params = list(backbone.parameters())
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    with torch.no_grad():
        for p in params:
            p -= LR * (p.grad * scale + WD * p)  # first SGD step: the momentum buffer is the gradient itself
        centres -= LR * (centres.grad + WD * centres)
    return backbone, centres.detach(), float(loss.detach())


@pytest.mark.parametrize("accumulate, max_norm", [(1, 5.0), (2, 5.0), (2, 1e-3)])
def test_one_step_equals_the_dense_float64_step(tmp_path, accumulate, max_norm):
    (tmp_path / "c.py").write_text("")
    cfg = load_config(tmp_path / "c.py", [f"lr={LR}", f"weight_decay={WD}", f"momentum={MOMENTUM}",
                                          f"gradient_acc={accumulate}", f"max_grad_norm={max_norm}"])
    state = make_state(cfg)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (B, V, 3, 112, 112), dtype=torch.uint8, generator=generator)
    labels = torch.tensor([0, 3, 3, 1])
    reference_backbone, reference_centres, reference_loss = dense_reference(state, images, labels, max_norm)

    size = B // accumulate
    micro = [(images[i:i + size], labels[i:i + size]) for i in range(0, B, size)]
    losses, outcome = train_step(state, micro, cfg)

    assert outcome == StepOutcome.TAKEN
    assert losses[0].item() == pytest.approx(reference_loss, rel=1e-5)
    for mine, theirs in zip(state.backbone.parameters(), reference_backbone.parameters()):
        torch.testing.assert_close(mine.detach().double(), theirs.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(state.pfc.weight.detach().double(), reference_centres, rtol=1e-4, atol=1e-6)
    assert state.scheduler.last_epoch == 1  # one LR step per optimizer step, however many micro-batches
    assert all(p.grad is None for p in state.backbone.parameters())


def test_a_nonfinite_loss_leaves_weights_and_optimizer_untouched(tmp_path):
    (tmp_path / "c.py").write_text("")
    cfg = load_config(tmp_path / "c.py", [f"lr={LR}"])
    state = make_state(cfg)
    before = [p.detach().clone() for p in [*state.backbone.parameters(), state.pfc.weight]]
    images = torch.zeros((B, V, 3, 112, 112), dtype=torch.uint8)
    state.pfc.register_forward_hook(lambda module, inputs, output: (output[0] + float("nan"), output[1]))
    losses, outcome = train_step(state, [(images, torch.tensor([0, 1, 2, 3]))], cfg)
    assert outcome == StepOutcome.LOSS_NONFINITE and torch.isnan(losses[0])
    after = [*state.backbone.parameters(), state.pfc.weight]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert state.optimizer.state_dict()["state"] == {}  # no momentum was started from a bad gradient


class Float64(nn.Module):
    """Puts the step's float32 pixels into float64, so that the whole step runs in float64."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


def make_float64_state(cfg) -> TrainingState:
    state = make_state(cfg)
    state.backbone = state.ddp_backbone = nn.Sequential(Float64(), *state.backbone).double()
    state.pfc.double()
    state.optimizer = build_optimizer(cfg, state.backbone, state.pfc)
    state.scheduler = build_scheduler(state.optimizer, 0, 10)
    return state


def dense_updates(backbone: nn.Module, centres: torch.Tensor, batches, max_norm: float, momentum: float = MOMENTUM,
                  backbone_decay: float = WD, centre_decay: float = WD, frozen_steps: int = 0
                  ) -> list[list[torch.Tensor]]:
    """What each SGD step adds to every backbone parameter and to the centres, in float64, from the
    formulas alone: CosFace softmax of both views, the backbone's gradient clipped to `max_norm`, then
    d = g + decay * p, buffer = momentum * buffer + d (d on the first step), p -= lr * buffer, with
    lr = LR * (1 - step / 10) ** 2 (no warmup, 10 steps in all). The first `frozen_steps` steps leave the
    backbone alone: no gradient, so no weight decay and no momentum buffer either (its first step starts it)."""
    backbone = copy.deepcopy(backbone).double()
    centres = centres.detach().double().clone().requires_grad_(True)
    params = [*backbone.parameters(), centres]
    decays = [backbone_decay] * (len(params) - 1) + [centre_decay]
    buffers, updates = [None] * len(params), []
    for step, (images, labels) in enumerate(batches):
        loss = 0.0
        for v in range(V):  # view v of record b is images[b, v]
            x = (images[:, v].double() / 255 - 0.5) / 0.5
            cos = F.normalize(backbone(x)) @ F.normalize(centres).t()
            loss = loss + F.cross_entropy(S * (cos - M3 * F.one_hot(labels, C).double()), labels) / V
        grads = list(torch.autograd.grad(loss, params))
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads[:-1]))
        clip = min(1.0, max_norm / (float(norm) + 1e-6))
        lr = LR * (1 - step / 10) ** 2
        step_updates = []
        with torch.no_grad():
            for i, (p, g, decay) in enumerate(zip(params, grads, decays)):
                if step < frozen_steps and i < len(params) - 1:
                    step_updates.append(torch.zeros_like(p))
                    continue
                d = (g * clip if i < len(params) - 1 else g) + decay * p
                buffers[i] = d.clone() if buffers[i] is None else momentum * buffers[i] + d
                p -= lr * buffers[i]
                step_updates.append(-lr * buffers[i])
        updates.append(step_updates)
    return updates


def black_and_white_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels 0 and 255 only: normalised to exactly -1 and 1 in float32 as in float64, so the float64
    step can be compared with the float64 reference at float64 precision."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 2, (B, V, 3, 112, 112), generator=generator).to(torch.uint8) * 255
    return images, torch.randint(0, C, (B,), generator=generator)


@pytest.mark.parametrize("accumulate, max_norm", [(1, 5.0), (2, 5.0), (2, 1e-3)])
def test_two_steps_update_the_weights_as_dense_sgd_with_momentum_and_weight_decay(tmp_path, accumulate, max_norm):
    """Each step's change of every weight, compared element by element: the second step's change carries the
    first one's momentum, and weight decay (backbone and centres) is a visible part of each change."""
    (tmp_path / "c.py").write_text("")
    cfg = load_config(tmp_path / "c.py", [f"lr={LR}", f"weight_decay={WD}", f"momentum={MOMENTUM}",
                                          f"gradient_acc={accumulate}", f"max_grad_norm={max_norm}"])
    state = make_float64_state(cfg)
    batches = [black_and_white_batch(seed) for seed in (1, 2)]
    expected = dense_updates(state.backbone, state.pfc.weight, batches, max_norm)
    size = B // accumulate
    for step, (images, labels) in enumerate(batches):
        params = [*state.backbone.parameters(), state.pfc.weight]
        before = [p.detach().clone() for p in params]
        _, outcome = train_step(state, [(images[i:i + size], labels[i:i + size]) for i in range(0, B, size)], cfg)
        assert outcome == StepOutcome.TAKEN
        for p, old, want in zip(params, before, expected[step], strict=True):
            # the change is a difference of two weights: its rounding is that of the weight (~50 ulps allowed)
            floor = 1e-14 * float(old.abs().max() + want.abs().max())
            torch.testing.assert_close(p.detach() - old, want, rtol=1e-10, atol=floor)

    # The comparison can tell: without momentum, or without weight decay on either group, the changes differ.
    for changed in (dict(momentum=0.0), dict(centre_decay=0.0), dict(backbone_decay=0.0)):
        other = dense_updates(make_float64_state(cfg).backbone, make_float64_state(cfg).pfc.weight, batches, max_norm,
                              **changed)
        worst = max(float(((a - b).abs() / b.abs().max()).max()) for step_a, step_b in zip(other, expected)
                    for a, b in zip(step_a, step_b))
        assert worst > 1e-6, changed


def test_one_backbone_pass_over_all_views_sets_batchnorm_statistics(tmp_path):
    """The step's B*V images go through the backbone in one pass: BatchNorm's running statistics after the
    step are those of one forward over all of them (a pass per view would update them twice)."""
    (tmp_path / "c.py").write_text("")
    cfg = load_config(tmp_path / "c.py", [f"lr={LR}"])
    state = make_state(cfg, nn.Sequential(nn.AvgPool2d(8), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(3 * 14 * 14, D)))
    reference = copy.deepcopy(state.backbone).train()
    generator = torch.Generator().manual_seed(5)
    images = torch.randint(0, 256, (B, V, 3, 112, 112), dtype=torch.uint8, generator=generator)
    with torch.no_grad():
        reference((images.double() / 255 - 0.5).div(0.5).float().reshape(B * V, 3, 112, 112))
    _, outcome = train_step(state, [(images, torch.tensor([0, 3, 3, 1]))], cfg)
    assert outcome == StepOutcome.TAKEN
    bn, expected = state.backbone[1], reference[1]
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, expected.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bn.running_var, expected.running_var, rtol=1e-6, atol=1e-7)
