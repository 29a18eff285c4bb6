"""The network names and the one function that builds any of them."""
from __future__ import annotations

import difflib
import logging

from torch import nn

from backbones.iresnet import IRESNET_CHECKPOINT_SEGMENTS, IRESNET_LAYERS, IResNet
from backbones.mobilefacenet import MOBILEFACENET_CONFIGS, MobileFaceNet
from backbones.vit import VIT_CONFIGS, VisionTransformer
from utils.errors import ConfigError

log = logging.getLogger(__name__)

NETWORKS: tuple[str, ...] = (
    "r18", "r34", "r50", "r100", "r200", "r2060", "mbf", "mbf_large",
    "vit_t", "vit_t_dp005_mask0", "vit_s", "vit_s_dp005_mask_0", "vit_b", "vit_b_dp005_mask_005",
    "vit_l_dp005_mask_005", "vit_h",
)

# Options beyond get_model's own arguments that each family understands.
_VIT_OPTIONS = ("mask_ratio", "drop_path_rate", "using_checkpoint")


def _check_name(name: str) -> None:
    if name not in NETWORKS:
        close = difflib.get_close_matches(name, NETWORKS, n=1)
        valid = ", ".join(NETWORKS)
        fix = f"did you mean '{close[0]}'? (valid networks: {valid})" if close else f"use one of {valid}"
        raise ConfigError(f"unknown network '{name}'; {fix}")


def _check_options(name: str, options: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        valid = ", ".join(("num_features", "dropout", "fp16", "width_mult") + allowed)
        raise ConfigError(f"get_model('{name}') got unknown option(s) {', '.join(unknown)}; "
                                 f"use only {valid}")


def get_model(
    name: str,
    num_features: int = 512,
    dropout: float = 0.0,
    fp16: bool = False,
    width_mult: float = 1.0,
    **kw,
) -> nn.Module:
    """Build backbone ``name``: (N, 3, 112, 112) float images in [-1, 1] -> (N, num_features) float32.

    ``dropout`` applies to the flattened trunk output just before the embedding layer. ``fp16`` is
    arcface_torch's argument, taken so that its calls run unchanged, and changes nothing: the trunk runs in
    the precision of the autocast its caller opens (train.py's step opens the one autocast, from the config's
    fp16 or bf16), the head in float32 (a True value is logged as a warning saying so).
    ``width_mult`` scales every channel width (ViT: the embedding width), e.g. 0.125 for CPU demos;
    the default 1.0 is arcface_torch's network, parameter for parameter. ViTs also take
    ``mask_ratio``, ``drop_path_rate`` and ``using_checkpoint`` (defaults: arcface_torch's for that
    name). r2060 recomputes activations in backward, as arcface_torch does. Raises ConfigError for an
    unknown name, option or impossible width.
    """
    _check_name(name)
    if fp16:
        # A warning, not an error: arcface_torch's calls and an earlier model.json's network_kwargs still build.
        log.warning("get_model('%s', fp16=True): the network runs in the precision of the autocast its caller "
                    "opens, not its own; for training set fp16=True in the config (not in network_kwargs), elsewhere "
                    "open torch.autocast around the call", name)
    common = dict(num_features=num_features, dropout=dropout, width_mult=width_mult)
    if name in IRESNET_LAYERS:
        _check_options(name, kw, ())
        segments = IRESNET_CHECKPOINT_SEGMENTS.get(name, (0, 0, 0, 0))
        return IResNet(IRESNET_LAYERS[name], checkpoint_segments=segments, **common)
    if name in MOBILEFACENET_CONFIGS:
        _check_options(name, kw, ())
        blocks, scale = MOBILEFACENET_CONFIGS[name]
        return MobileFaceNet(blocks, scale, **common)
    _check_options(name, kw, _VIT_OPTIONS)
    config = VIT_CONFIGS[name]
    options = dict(mask_ratio=config.mask_ratio, drop_path_rate=config.drop_path_rate,
                   using_checkpoint=config.using_checkpoint) | kw
    return VisionTransformer(config.embed_dim, config.depth, **common, **options)
