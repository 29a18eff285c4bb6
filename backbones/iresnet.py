"""Improved ResNet (iresnet r18..r200, r2060) with arcface_torch's parameter names and BN-dropout-FC-BN head."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from backbones.base import Backbone, FaceBackbone, scaled_width

# Blocks per stage, as arcface_torch defines them.
IRESNET_LAYERS: dict[str, tuple[int, int, int, int]] = {
    "r18": (2, 2, 2, 2),
    "r34": (3, 4, 6, 3),
    "r50": (3, 4, 14, 3),
    "r100": (3, 13, 30, 3),
    "r200": (6, 26, 60, 6),
    "r2060": (3, 128, 896, 3),
}

# Per stage, how many segments its activations are recomputed in during backward instead of kept
# (0: kept), as arcface_torch's iresnet2060 does: otherwise its 1030 blocks' activations do not fit.
IRESNET_CHECKPOINT_SEGMENTS: dict[str, tuple[int, int, int, int]] = {
    "r2060": (0, 20, 100, 0),
}

# A 112x112 input is halved by each of the four stages.
_FINAL_SIDE = 7


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    """BN -> conv -> BN -> PReLU -> conv(stride) -> BN, plus the (projected) input."""

    # (layer, BatchNorm directly applied to its output): inference folds each BN into its layer.
    bn_fusable_pairs = (("conv1", "bn2"), ("conv2", "bn3"))

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels, eps=1e-05)
        self.conv1 = _conv3x3(in_channels, channels)
        self.bn2 = nn.BatchNorm2d(channels, eps=1e-05)
        self.prelu = nn.PReLU(channels)
        self.conv2 = _conv3x3(channels, channels, stride)
        self.bn3 = nn.BatchNorm2d(channels, eps=1e-05)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(channels, eps=1e-05),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        identity = x if self.downsample is None else self.downsample(x)
        return out + identity


@contextlib.contextmanager
def _batchnorm_statistics_kept(module: nn.Module) -> Iterator[None]:
    """Undo whatever the enclosed forward does to BN running statistics.

    Recomputing a checkpointed segment runs its BNs in training mode a second time on the same batch;
    without this, the batch would count twice in the running statistics (as it does upstream).
    """
    buffers = [buffer for bn in module.modules() if isinstance(bn, nn.modules.batchnorm._BatchNorm)
               for buffer in (bn.running_mean, bn.running_var, bn.num_batches_tracked) if buffer is not None]
    saved = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                buffer.copy_(value)


def _run_checkpointed(stage: nn.Sequential, segments: int, x: torch.Tensor) -> torch.Tensor:
    """``stage(x)``, keeping only each segment's input for backward, as checkpoint_sequential splits
    it: ``segments - 1`` checkpointed runs of ``len // segments`` blocks, the rest run plainly."""
    size = len(stage) // segments
    end = size * (segments - 1)
    for start in range(0, end, size):
        segment = stage[start:start + size]
        x = checkpoint(segment, x, use_reentrant=False,
                       context_fn=lambda segment=segment: (contextlib.nullcontext(),
                                                           _batchnorm_statistics_kept(segment)))
    return stage[end:](x)


class IResNet(FaceBackbone):
    bn_fusable_pairs = (("conv1", "bn1"), ("fc", "features"))

    def __init__(
        self,
        layers: tuple[int, int, int, int],
        num_features: int = 512,
        dropout: float = 0.0,
        width_mult: float = 1.0,
        checkpoint_segments: tuple[int, int, int, int] = (0, 0, 0, 0),
    ) -> None:
        super().__init__()
        self.checkpoint_segments = checkpoint_segments
        base = scaled_width(64, width_mult)
        widths = (base, 2 * base, 4 * base, 8 * base)
        self.conv1 = _conv3x3(3, base)
        self.bn1 = nn.BatchNorm2d(base, eps=1e-05)
        self.prelu = nn.PReLU(base)
        in_channels = base
        for index, (blocks, width) in enumerate(zip(layers, widths, strict=True), start=1):
            stage = [IBasicBlock(in_channels, width, stride=2)]
            stage += [IBasicBlock(width, width, stride=1) for _ in range(blocks - 1)]
            setattr(self, f"layer{index}", nn.Sequential(*stage))
            in_channels = width
        self.bn2 = nn.BatchNorm2d(in_channels, eps=1e-05)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(in_channels * _FINAL_SIDE * _FINAL_SIDE, num_features)
        self.features = nn.BatchNorm1d(num_features, eps=1e-05)
        self._initialize()

    def _initialize(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.normal_(module.weight, 0, 0.1)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        # arcface_torch freezes the embedding BN's scale at 1: embeddings are only normalised and
        # shifted, their scale is left to the margin softmax.
        nn.init.ones_(self.features.weight)
        self.features.weight.requires_grad = False

    def forward_trunk(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))
        stages = (self.layer1, self.layer2, self.layer3, self.layer4)
        for stage, segments in zip(stages, self.checkpoint_segments, strict=True):
            x = _run_checkpointed(stage, segments, x) if segments and self.training else stage(x)
        return self.dropout(torch.flatten(self.bn2(x), 1))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(self.fc(x))


def _iresnet(name: str) -> Backbone:
    segments = IRESNET_CHECKPOINT_SEGMENTS.get(name, (0, 0, 0, 0))
    return Backbone(functools.partial(IResNet, IRESNET_LAYERS[name], checkpoint_segments=segments), "conv1.weight", 64,
                    nhwc_gradients=True)


BACKBONES: dict[str, Backbone] = {name: _iresnet(name) for name in IRESNET_LAYERS}
