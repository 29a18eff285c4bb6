"""MobileFaceNet (mbf, mbf_large) with arcface_torch's module tree, hence its parameter names."""
from __future__ import annotations

import functools

import torch
from torch import nn

from backbones.base import Backbone, FaceBackbone, scaled_width

# (blocks per residual stage, channel scale), as arcface_torch's get_mbf / get_mbf_large.
MOBILEFACENET_CONFIGS: dict[str, tuple[tuple[int, int, int, int], int]] = {
    "mbf": ((1, 4, 6, 2), 2),
    "mbf_large": ((2, 8, 12, 4), 4),
}


class ConvBlock(nn.Module):
    """conv -> BN -> PReLU."""

    activation = True

    def __init__(self, in_c: int, out_c: int, kernel: int = 1, stride: int = 1, padding: int = 0,
                 groups: int = 1) -> None:
        super().__init__()
        layers = [
            nn.Conv2d(in_c, out_c, kernel, stride=stride, padding=padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_c),
        ]
        self.layers = nn.Sequential(*layers, *([nn.PReLU(out_c)] if self.activation else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class LinearBlock(ConvBlock):
    """conv -> BN, no activation."""

    activation = False


class DepthWise(nn.Module):
    """Inverted bottleneck: 1x1 expand to ``hidden`` -> 3x3 depthwise (stride) -> 1x1 project."""

    def __init__(self, in_c: int, out_c: int, hidden: int, stride: int, residual: bool) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            ConvBlock(in_c, hidden),
            ConvBlock(hidden, hidden, kernel=3, stride=stride, padding=1, groups=hidden),
            LinearBlock(hidden, out_c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return x + out if self.residual else out


class Residual(nn.Module):
    def __init__(self, channels: int, num_blocks: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[DepthWise(channels, channels, hidden, stride=1, residual=True) for _ in range(num_blocks)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class GDC(nn.Module):
    """Global depthwise 7x7 conv -> BN -> (dropout) -> linear -> BN: the embedding head."""

    def __init__(self, channels: int, num_features: int, dropout: float) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            LinearBlock(channels, channels, kernel=7, groups=channels),
            # Index 1 holds no parameters (arcface_torch's Flatten), so dropout fits here without
            # shifting the names of the layers after it.
            nn.Sequential(nn.Flatten(), nn.Dropout(p=dropout)),
            nn.Linear(channels, num_features, bias=False),
            nn.BatchNorm1d(num_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class MobileFaceNet(FaceBackbone):
    def __init__(
        self,
        blocks: tuple[int, int, int, int],
        scale: int,
        num_features: int = 512,
        dropout: float = 0.0,
        width_mult: float = 1.0,
    ) -> None:
        super().__init__()
        unit = scaled_width(64, width_mult)  # arcface_torch's widths are all multiples of 64

        def width(multiple_of_64: int) -> int:
            return unit * multiple_of_64 // 64

        stem, wide = width(64 * scale), width(128 * scale)
        self.layers = nn.ModuleList([ConvBlock(3, stem, kernel=3, stride=2, padding=1)])
        if blocks[0] == 1:
            self.layers.append(ConvBlock(stem, stem, kernel=3, padding=1, groups=width(64)))
        else:
            self.layers.append(Residual(stem, blocks[0], hidden=width(128)))
        self.layers.extend([
            DepthWise(stem, stem, hidden=width(128), stride=2, residual=False),
            Residual(stem, blocks[1], hidden=width(128)),
            DepthWise(stem, wide, hidden=width(256), stride=2, residual=False),
            Residual(wide, blocks[2], hidden=width(256)),
            DepthWise(wide, wide, hidden=width(512), stride=2, residual=False),
            Residual(wide, blocks[3], hidden=width(256)),
        ])
        self.conv_sep = ConvBlock(wide, width(512))
        self.features = GDC(width(512), num_features, dropout)
        self._initialize()

    def _initialize(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward_trunk(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(self.conv_sep(x))


# The first layer's width is 64 * the channel scale.
BACKBONES: dict[str, Backbone] = {
    name: Backbone(functools.partial(MobileFaceNet, blocks, scale), "layers.0.layers.0.weight", 64 * scale)
    for name, (blocks, scale) in MOBILEFACENET_CONFIGS.items()
}
