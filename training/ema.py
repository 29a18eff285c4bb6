"""An exponential moving average of the backbone's weights (config key `ema_decay`), a common recipe for face
models: with it on, backbone.pth and verification use the averaged weights.

After every optimizer step taken, each parameter's average moves towards it,
``average <- d * average + (1 - d) * weight`` with ``d = min(ema_decay, (1 + n) / (10 + n))`` and n the steps
averaged before this one (the warm-up of TensorFlow's ExponentialMovingAverage, so that the random start is
soon forgotten); the averages start as the weights the run starts from. BatchNorm statistics are not
averaged: the exported backbone takes the trained one's (averages already).

The component stands in for training/components.py's Backbone: in a checkpoint, backbone.pth holds the exported
backbone (the averages), and the trained parameters go in their place (DCP tensors under "ema", the same on
every rank, so written once and read on any number of processes) with n as JSON; a resume takes the averages from
backbone.pth and the trained weights from here, bit for bit.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Mapping

import torch
from torch import nn

from training.components import Backbone
from training.fields import integer
from utils.errors import ConfigError

log = logging.getLogger(__name__)


class BackboneEMA(Backbone):
    keys = ("backbone", "ema", "ema_updates")
    tensor_keys = ("ema",)

    def __init__(self, backbone: nn.Module, decay: float):
        super().__init__(backbone)
        self.decay = decay
        self.average = copy.deepcopy(backbone).requires_grad_(False)
        self.updates = 0

    @classmethod
    def build(cls, state, config: Mapping) -> BackboneEMA | None:
        decay = config.get("ema_decay", 0.0)
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"config key 'ema_decay' must lie in [0, 1), not {decay}; e.g. 0.999 averages over "
                              "about the last thousand steps, 0 turns the average off")
        return cls(state.backbone, decay) if decay else None

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(averages, trained weights), parameter by parameter."""
        return [p.detach() for p in self.average.parameters()], [p.detach() for p in self.backbone.parameters()]

    def after_step(self) -> None:
        rate = 1.0 - min(self.decay, (1 + self.updates) / (10 + self.updates))
        averages, weights = self._pairs()
        with torch.no_grad():
            torch._foreach_lerp_(averages, weights, rate)  # average + rate * (weight - average)
        self.updates += 1

    def exported(self, backbone: nn.Module) -> nn.Module:
        with torch.no_grad():
            for mine, trained in zip(self.average.buffers(), self.backbone.buffers(), strict=True):
                mine.copy_(trained)
        return self.average

    def state_dict(self) -> dict:
        """The averages as backbone.pth, the trained weights and the steps averaged."""
        return {"backbone": self.exported(self.backbone).state_dict(),
                "ema": {name: p.detach() for name, p in self.backbone.named_parameters()},
                "ema_updates": self.updates}

    def template(self, saved: Mapping[str, tuple]) -> dict:
        """New tensors: the trained weights are put in place only once backbone.pth (the averages) is read."""
        if not any(fqn.startswith("ema.") for fqn in saved):
            return {}
        return {"ema": {name: torch.empty_like(p) for name, p in self.backbone.named_parameters()}}

    def load_state_dict(self, saved: Mapping) -> None:
        """backbone.pth's weights (the averages, if the checkpoint has them) into the backbone, then from there
        into the average, and the trained weights back into the backbone."""
        super().load_state_dict(saved)
        averages, weights = self._pairs()
        with torch.no_grad():
            torch._foreach_copy_(averages, weights)
            if "ema" not in saved:
                log.info("the checkpoint holds no average of the backbone's weights (ema_decay was off, or "
                         "arcface_torch wrote it): the average starts from the weights it holds")
                self.updates = 0
                return
            trained = saved["ema"]
            for name, param in self.backbone.named_parameters():
                param.copy_(trained[name])
        self.updates = saved["ema_updates"]

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        if "ema_updates" in section:
            integer(section["ema_updates"], f"{where}.ema_updates", low=0)


def trained_state_dict(exported: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> dict:
    """The trained backbone's state_dict from a checkpoint's backbone.pth (`exported`: the averages) and this
    component's tensors (`saved`, the checkpoint's "ema": the trained parameters); BatchNorm statistics are
    the trained backbone's in both."""
    return {name: saved.get(name, value) for name, value in exported.items()}
