"""A toy training state for the checkpoint tests: a 4 -> 3 backbone with BatchNorm, 7 class centres and
the components every run has, with steps whose gradients differ per centre row, so that every saved
tensor tells its rows apart."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from losses import CombinedMarginLoss
from partial_fc import PartialFC
from training.state import build_components
from utils.lr_scheduler import build_scheduler

NUM_CLASSES, DIM = 7, 3
INFO = {"network": "toy", "network_kwargs": {}, "embedding_size": DIM, "num_classes": NUM_CLASSES}
# What a run saves beside the tensors (training.progress.StepCounter's "progress"), a resume reads back.
PROGRESS = {"global_step": 2, "steps_per_epoch": 10, "nonfinite_total": 0}


def make_model(optimizer_name: str, seed: int = 0) -> SimpleNamespace:
    torch.manual_seed(seed)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, DIM), torch.nn.BatchNorm1d(DIM))
    pfc = PartialFC(CombinedMarginLoss(), DIM, NUM_CLASSES, seed=seed)
    groups = [{"params": list(backbone.parameters())}, {"params": [pfc.weight]}]
    optimizer = (torch.optim.SGD(groups, lr=0.1, momentum=0.9) if optimizer_name == "sgd"
                 else torch.optim.AdamW(groups, lr=0.1))
    model = SimpleNamespace(backbone=backbone, pfc=pfc, optimizer=optimizer,
                            scheduler=build_scheduler(optimizer, 2, 20),
                            scaler=torch.amp.GradScaler("cpu", enabled=False))
    model.components = build_components(model, {})
    return model


def take_steps(model: SimpleNamespace, steps: int = 2) -> None:
    """Steps with a known, row-dependent centre gradient, so optimizer state differs per row."""
    pfc = model.pfc
    for step in range(steps):
        rows = torch.arange(pfc.class_start, pfc.class_start + pfc.num_local, dtype=torch.float32)
        pfc.weight.grad = rows[:, None] * 10 + torch.arange(DIM) + step
        for p in model.backbone.parameters():
            p.grad = torch.ones_like(p)
        model.optimizer.step()
        model.scheduler.step()
    model.backbone(torch.randn(5, 4))  # BatchNorm statistics move too


def centre_state(model: SimpleNamespace) -> dict:
    """The centres and their optimizer state (momentum or Adam moments and step), cloned."""
    state = model.optimizer.state[model.pfc.weight]
    return {"weight": model.pfc.weight.detach().clone(), **{k: v.clone() for k, v in state.items()}}
