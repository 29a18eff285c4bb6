"""The network names and the one function that builds any of them."""
from __future__ import annotations

import difflib

from torch import nn

from backbones.iresnet import IRESNET_LAYERS, IResNet
from backbones.mobilefacenet import MOBILEFACENET_CONFIGS, MobileFaceNet
from backbones.vit import VIT_CONFIGS, VisionTransformer

NETWORKS: tuple[str, ...] = (
    "r18", "r34", "r50", "r100", "r200", "mbf", "mbf_large", "vit_t", "vit_s", "vit_b",
)

# Options beyond get_model's own arguments that each family understands.
_VIT_OPTIONS = ("mask_ratio", "drop_path_rate", "using_checkpoint")


def _check_name(name: str) -> None:
    if name not in NETWORKS:
        close = difflib.get_close_matches(name, NETWORKS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"Unknown network '{name}'; valid networks are: {', '.join(NETWORKS)}.{hint}")


def _check_options(name: str, options: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        valid = ", ".join(("num_features", "dropout", "fp16", "width_mult") + allowed)
        raise TypeError(f"get_model('{name}') got unknown option(s) {', '.join(unknown)}; valid options: {valid}.")


def get_model(
    name: str,
    num_features: int = 512,
    dropout: float = 0.0,
    fp16: bool = False,
    width_mult: float = 1.0,
    **kw,
) -> nn.Module:
    """Build backbone ``name``: (N, 3, 112, 112) float images in [-1, 1] -> (N, num_features) float32.

    ``dropout`` applies to the flattened trunk output just before the embedding layer. ``fp16``
    runs the trunk under autocast (float16 on GPU, bfloat16 on CPU) and the head in float32.
    ``width_mult`` scales every channel width (ViT: the embedding width), e.g. 0.125 for CPU demos;
    the default 1.0 is arcface_torch's network, parameter for parameter. ViTs also take
    ``mask_ratio``, ``drop_path_rate`` and ``using_checkpoint`` (defaults: arcface_torch's).
    """
    _check_name(name)
    common = dict(num_features=num_features, dropout=dropout, fp16=fp16, width_mult=width_mult)
    if name in IRESNET_LAYERS:
        _check_options(name, kw, ())
        return IResNet(IRESNET_LAYERS[name], **common)
    if name in MOBILEFACENET_CONFIGS:
        _check_options(name, kw, ())
        blocks, scale = MOBILEFACENET_CONFIGS[name]
        return MobileFaceNet(blocks, scale, **common)
    _check_options(name, kw, _VIT_OPTIONS)
    embed_dim, depth, using_checkpoint = VIT_CONFIGS[name]
    kw.setdefault("using_checkpoint", using_checkpoint)
    return VisionTransformer(embed_dim, depth, **common, **kw)

