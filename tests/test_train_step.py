"""train.py's optimizer step against a dense float64 computation written out here: views taken
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
from train import Model, StepOutcome, build_optimizer, train_step
from utils.config import load_config
from utils.lr_scheduler import build_scheduler

B, V, D, C, S, M3 = 4, 2, 8, 5, 32.0, 0.35
LR, WD, MOMENTUM = 0.2, 5e-4, 0.9


def make_model(cfg) -> Model:
    torch.manual_seed(3)
    backbone = nn.Sequential(nn.AvgPool2d(8), nn.Flatten(), nn.Linear(3 * 14 * 14, D))  # no BatchNorm: exact
    pfc = PartialFC(CombinedMarginLoss(S, 1.0, 0.0, M3), D, C)
    optimizer = build_optimizer(cfg, backbone, pfc)
    return Model(backbone=backbone, ddp_backbone=backbone, pfc=pfc, optimizer=optimizer,
                 scheduler=build_scheduler(optimizer, 0, 10), scaler=torch.amp.GradScaler("cpu", enabled=False),
                 precision=None)


def dense_reference(model: Model, images: torch.Tensor, labels: torch.Tensor, max_norm: float):
    """Backbone and centres after one SGD step, in float64, from the formulas alone."""
    backbone = copy.deepcopy(model.backbone).double()
    centres = model.pfc.weight.detach().double().clone().requires_grad_(True)
    loss = 0.0
    for v in range(V):  # view v of record b is images[b, v]
        x = (images[:, v].double() / 255 - 0.5) / 0.5
        cos = F.normalize(backbone(x)) @ F.normalize(centres).t()
        logits = S * (cos - M3 * F.one_hot(labels, C))
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
    model = make_model(cfg)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (B, V, 3, 112, 112), dtype=torch.uint8, generator=generator)
    labels = torch.tensor([0, 3, 3, 1])
    reference_backbone, reference_centres, reference_loss = dense_reference(model, images, labels, max_norm)

    size = B // accumulate
    micro = [(images[i:i + size], labels[i:i + size]) for i in range(0, B, size)]
    losses, outcome = train_step(model, micro, cfg)

    assert outcome == StepOutcome.TAKEN
    assert losses[0].item() == pytest.approx(reference_loss, rel=1e-5)
    for mine, theirs in zip(model.backbone.parameters(), reference_backbone.parameters()):
        torch.testing.assert_close(mine.detach().double(), theirs.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.pfc.weight.detach().double(), reference_centres, rtol=1e-4, atol=1e-6)
    assert model.scheduler.last_epoch == 1  # one LR step per optimizer step, however many micro-batches
    assert all(p.grad is None for p in model.backbone.parameters())


def test_a_nonfinite_loss_leaves_weights_and_optimizer_untouched(tmp_path):
    (tmp_path / "c.py").write_text("")
    cfg = load_config(tmp_path / "c.py", [f"lr={LR}"])
    model = make_model(cfg)
    before = [p.detach().clone() for p in [*model.backbone.parameters(), model.pfc.weight]]
    images = torch.zeros((B, V, 3, 112, 112), dtype=torch.uint8)
    losses, outcome = train_step(model, [(images, torch.tensor([0, 1, 2, 3]))], cfg, inject_nan=True)
    assert outcome == StepOutcome.LOSS_NONFINITE and torch.isnan(losses[0])
    after = [*model.backbone.parameters(), model.pfc.weight]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert model.optimizer.state_dict()["state"] == {}  # no momentum was started from a bad gradient
