"""The network names, each with its declaration (backbones.base.Backbone), and the one function that builds any of
them. A new network is one module declaring its ``BACKBONES`` and one line in ``REGISTRY``."""
from __future__ import annotations

import difflib
import logging

from torch import nn

from backbones import iresnet, mobilefacenet, vit
from backbones.base import Backbone
from utils.errors import ConfigError

log = logging.getLogger(__name__)

REGISTRY: dict[str, Backbone] = {
    **iresnet.BACKBONES,
    **mobilefacenet.BACKBONES,
    **vit.BACKBONES,
}
NETWORKS: tuple[str, ...] = tuple(REGISTRY)

_OWN_OPTIONS = ("num_features", "dropout", "fp16", "width_mult")


def backbone_named(name: str) -> Backbone:
    """The declaration of network `name`, or a ConfigError suggesting the closest name."""
    if name in REGISTRY:
        return REGISTRY[name]
    close = difflib.get_close_matches(name, list(REGISTRY), n=1)
    valid = ", ".join(REGISTRY)
    fix = f"did you mean '{close[0]}'? (valid networks: {valid})" if close else f"use one of {valid}"
    raise ConfigError(f"unknown network '{name}'; {fix}")


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
    backbone = backbone_named(name)
    unknown = sorted(set(kw) - set(backbone.options))
    if unknown:
        raise ConfigError(f"get_model('{name}') got unknown option(s) {', '.join(unknown)}; "
                          f"use only {', '.join(_OWN_OPTIONS + backbone.options)}")
    if fp16:
        # A warning, not an error: arcface_torch's calls and an earlier model.json's network_kwargs still build.
        log.warning("get_model('%s', fp16=True): the network runs in the precision of the autocast its caller "
                    "opens, not its own; for training set fp16=True in the config (not in network_kwargs), elsewhere "
                    "open torch.autocast around the call", name)
    return backbone.build(num_features=num_features, dropout=dropout, width_mult=width_mult, **kw)
