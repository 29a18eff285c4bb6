"""One optimizer step: the micro-batches of a step through the backbone and PartialFC, one backward each,
then a step every rank agrees to take or to skip.

The loader's (B, V, 3, 112, 112) uint8 batch -> one backbone pass over the B*V images under the step's
one autocast -> V embedding tensors -> PartialFC -> (loss, per-view losses) -> backward -> unscale,
clip -> the outcome every rank agrees on -> one optimizer step (or a skip that puts BatchNorm
statistics back) -> one LR step.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from enum import IntEnum
from types import SimpleNamespace

import torch
from torch import nn

from training.semi_siamese import semi_siamese
from training.state import TrainingState, backbone_frozen
from utils.distributed import all_reduce_max
from utils.image import normalize


class StepOutcome(IntEnum):
    """What became of an optimizer step; ranks agree on the worst (largest) one."""

    TAKEN = 0
    GRAD_NONFINITE = 1  # finite loss, non-finite gradient (routine for fp16: the grad scaler backs off)
    LOSS_NONFINITE = 2


def train_step(state: TrainingState, micro_batches, cfg: SimpleNamespace) -> tuple[torch.Tensor, StepOutcome]:
    """One optimizer step over the micro-batches. Returns ([loss, view losses...] averaged over the
    micro-batches, detached, on the device; the worst outcome over the ranks): a step is taken on
    every rank, or skipped on every rank."""
    state.keep_bn_buffers()
    state.before_step()
    frozen = backbone_frozen(state, cfg)
    state.backbone.train(not frozen)  # eval mode: BatchNorm neither updates nor uses batch statistics
    micro_losses = []
    for i, (images, labels) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # DDP's no_sync (a compiled DDP passes it through; one process has none): no all-reduce until the last
        accumulating = not last and hasattr(state.ddp_backbone, "no_sync")
        with state.ddp_backbone.no_sync() if accumulating else contextlib.nullcontext():
            micro_losses.append(_forward_backward(state, images, labels, len(micro_batches), frozen))
    state.scaler.unscale_(state.optimizer)
    grad_norm = nn.utils.clip_grad_norm_(state.backbone.parameters(), cfg.max_grad_norm)
    losses = torch.stack(micro_losses).mean(dim=0)
    outcome = _worst_outcome_of_all_ranks(losses[0], grad_norm, state.pfc.weight.grad)
    if outcome == StepOutcome.LOSS_NONFINITE and state.pfc.defer_label_check:
        for _, labels in micro_batches:  # a bad label is a data error, not a diverging loss
            state.pfc.check_labels(labels)
    if outcome:
        state.optimizer.zero_grad(set_to_none=True)
        state.restore_bn_buffers()
        if state.scaler.is_enabled():
            _back_off(state.scaler)
        with warnings.catch_warnings():  # torch warns when the very first step is skipped: that is on purpose
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"))
            state.scheduler.step()
    else:
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.optimizer.zero_grad(set_to_none=True)
        state.scheduler.step()
        state.after_step()
    return losses, outcome


def _forward_backward(state: TrainingState, images: torch.Tensor, labels: torch.Tensor,
                      accumulation: int, frozen: bool) -> torch.Tensor:
    """One micro-batch: returns [loss, loss of view 1..V] (detached); gradients accumulate. A `frozen` backbone
    runs outside autograd and outside DDP: it gets no gradient, so the optimizer leaves it as it is."""
    batch, views = images.shape[:2]
    flat = normalize(images).reshape(batch * views, *images.shape[2:])  # row b*V + v = record b, view v
    with state.autocast(flat.device.type):
        with torch.no_grad() if frozen else contextlib.nullcontext():
            embeddings = (state.backbone if frozen else state.ddp_backbone)(flat)
        probes = embeddings.reshape(batch, views, -1).unbind(dim=1)
        sst = semi_siamese(state)
        loss, per_view = sst.loss(probes, images, labels, state.pfc) if sst else state.pfc(probes, labels)
    state.scaler.scale(loss / accumulation).backward()
    return torch.cat([loss.detach().reshape(1), per_view])


def _worst_outcome_of_all_ranks(loss: torch.Tensor, grad_norm: torch.Tensor,
                                centre_grad: torch.Tensor | None) -> StepOutcome:
    """The worst outcome over ranks, computed on the device: the step's one wait for the device."""
    # The sum is non-finite exactly when an element is (short of an overflow no real gradient reaches), and
    # unlike isfinite(centre_grad) it needs no temporaries the size of the centre matrix.
    grads_finite = torch.isfinite(grad_norm)
    if centre_grad is not None:  # None: semi-siamese training without its centre loss leaves the centres out
        grads_finite &= torch.isfinite(centre_grad.sum())
    local = torch.where(torch.isfinite(loss), torch.where(grads_finite, 0.0, 1.0), 2.0).to(torch.float32)
    return StepOutcome(int(all_reduce_max(local).item()))


def _back_off(scaler: torch.amp.GradScaler) -> None:
    """A skipped step backs the grad scale off as if the scaler had found the overflow itself: scale
    times backoff_factor, growth counted from zero again."""
    state = scaler.state_dict()
    scaler.update()  # forgets this step's unscale_, so that the next step may unscale again
    scaler.load_state_dict({**state, "scale": state["scale"] * state["backoff_factor"], "_growth_tracker": 0})
