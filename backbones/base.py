"""What every backbone shares: a trunk in its caller's precision, a float32 embedding head, width scaling."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from utils.errors import ConfigError


@dataclass(frozen=True)
class Backbone:
    """What one network name declares; backbones/registry.py registers each, and get_model, the weights' checks and
    the memory plan ask it (none of them names a network)."""

    build: Callable[..., nn.Module]  # (num_features, dropout, width_mult, **options) -> the network
    first_weight: str                # its first layer's weight in the state_dict, whose output width at
    first_width: int                 # width_mult 1 is this: a weights file's width is read from it
    options: tuple[str, ...] = ()    # options it takes beyond get_model's own
    nhwc_gradients: bool = False     # compiled, its convolutions' weight gradients come out NHWC (measured on the
                                     # ResNets): training/speedups.py asks for channels_last to match them


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision tensors go up to float32; float32 and float64 (references) stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _outside_autocast(device_type: str) -> contextlib.AbstractContextManager:
    # Devices without autocast (e.g. "meta", used to build networks without memory) run as they are.
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def scaled_width(channels: int, width_mult: float, what: str = "channel count") -> int:
    """``channels * width_mult`` as a whole number, or a ConfigError saying which multipliers work.

    Widths are never rounded: rounding could break the divisibility that grouped convolutions and
    attention heads rely on, and a silently different network is worse than a clear refusal.
    """
    scaled = channels * width_mult
    if width_mult <= 0 or abs(scaled - round(scaled)) > 1e-9 or round(scaled) < 1:
        raise ConfigError(
            f"width_mult={width_mult} gives a {what} of {channels} x {width_mult} = {scaled:g}, which "
            f"is not a positive whole number; use a multiple of 1/{channels} such as 0.25 or 0.125"
        )
    return int(round(scaled))


class FaceBackbone(nn.Module):
    """An image -> embedding network split into a trunk and an embedding head.

    The trunk runs in whatever precision the caller chose: float32, or the autocast the caller opens around
    the call (training's is the step's one autocast, TrainingState.autocast, from the config's fp16 or bf16).
    The head always runs in float32, outside any autocast, so the embedding the margin softmax sees is
    float32. Subclasses implement ``forward_trunk`` and ``forward_head``; their parameters stay direct
    attributes so that ``state_dict()`` keys are exactly arcface_torch's.
    """

    def forward_trunk(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_trunk(x)
        with _outside_autocast(x.device.type):
            return self.forward_head(at_least_float32(x))
