"""Opt-in ways to run the same training step faster: the backbone's weights in channels_last (NHWC convolutions,
what tensor cores prefer) and the step's backbone compiled by torch.compile (inductor fuses its element-wise
work; mode "reduce-overhead" also replays it as CUDA graphs, the step's shapes being static).

Both are off by default: which one pays depends on the GPU, and `python -m bench.bench_train --split` measures
each on and off in one run (docs/gpu.md). Neither changes what is saved: the weights keep their names and
shapes, a checkpoint written with a switch on resumes with it off and the other way round.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from backbones.registry import backbone_named
from utils.errors import ConfigError

ONEDNN_CHANNEL_BLOCK = 16  # oneDNN's channel block with AVX-512 (AVX2's is 8, so 16 covers both)


def onednn_nhwc_crash(backbone: nn.Module, device: torch.device) -> str | None:
    """The convolution of `backbone` that oneDNN would corrupt the heap on in NHWC here, named, or None.

    oneDNN's NHWC weight gradient of a strided 1x1 convolution with fewer input channels than its channel block
    writes past its workspace ('corrupted double-linked list', 'double free' or a segmentation fault; reproduced
    with that one convolution alone under torch 2.14.1). Only CPUs run oneDNN, and only narrow ResNets (width
    below 0.25) have such a convolution, in their first downsample. inductor runs convolutions NHWC too."""
    if device.type != "cpu" or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return None
    for name, module in backbone.named_modules():
        if (isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1) and module.stride != (1, 1)
                and module.in_channels < ONEDNN_CHANNEL_BLOCK):
            return (f"{name} (1x1, stride {module.stride[0]}, {module.in_channels} < {ONEDNN_CHANNEL_BLOCK} input "
                    f"channels)")
    return None


def check_speedups(cfg: SimpleNamespace, backbone: nn.Module, device: torch.device) -> None:
    """One line naming the key to turn off where a switch cannot run with this network on this device."""
    wanted = [key for key in ("channels_last", "compile_backbone") if getattr(cfg, key)]
    crash = onednn_nhwc_crash(backbone, device) if wanted else None
    if crash:
        raise ConfigError(f"config key {wanted[0]!r} runs the convolutions in NHWC, and this CPU's oneDNN corrupts "
                          f"memory on {cfg.network}'s {crash}; turn it off on this CPU, or use a width_mult of 0.25 "
                          "or more, or a GPU")


def to_channels_last(cfg: SimpleNamespace, backbone: nn.Module) -> None:
    """The backbone's 4-d weights in NHWC, in place (an optimizer made before keeps the same tensors); a
    convolution whose weight is NHWC gives NHWC outputs, so every layer after the first runs NHWC."""
    if cfg.channels_last:
        backbone.to(memory_format=torch.channels_last)


def layout_advice(cfg: SimpleNamespace, world_size: int) -> str | None:
    """What to set with compile_backbone on several processes, or None. inductor computes the convolutions of a
    network declaring nhwc_gradients (the ResNets) in NHWC and hands DDP their weights' gradients so; DDP's buckets
    follow the weights' layout, so with NCHW weights every gradient is copied into its bucket each step, and torch
    warns that the strides do not match (measured on this CPU with 2 processes; with channels_last both are NHWC and
    it does not warn)."""
    if (cfg.compile_backbone is None or cfg.channels_last or world_size < 2
            or not backbone_named(cfg.network).nhwc_gradients):
        return None
    return ("compile_backbone on several processes: inductor gives DDP the convolutions' weight gradients in NHWC "
            "and the weights are NCHW, so each step copies every gradient (torch warns 'Grad strides do not match "
            "bucket view strides'); set channels_last=True too")


def compiled_for_the_step(cfg: SimpleNamespace, module: nn.Module) -> nn.Module:
    """What the step calls: `module` (the backbone, or it in DDP) compiled in compile_backbone's mode, or as it is.
    Only the step's forward is compiled: verification and frozen steps call the backbone itself, so that eval
    mode and their batch shapes cost no compilation of their own."""
    if cfg.compile_backbone is None:
        return module
    return torch.compile(module, mode=cfg.compile_backbone)
