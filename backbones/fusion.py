"""Inference copies of a backbone with every BatchNorm folded into the layer that feeds it."""
from __future__ import annotations

import copy

from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval


def _fuse_pair(layer: nn.Module, bn: nn.Module) -> nn.Module | None:
    if isinstance(layer, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
        return fuse_conv_bn_eval(layer, bn)
    if isinstance(layer, nn.Linear) and isinstance(bn, nn.BatchNorm1d):
        return fuse_linear_bn_eval(layer, bn)
    return None


def _fusable_pairs(module: nn.Module) -> list[tuple[str, str]]:
    """Names of (layer, BN applied directly to that layer's output) among module's children."""
    if isinstance(module, nn.Sequential):
        names = [name for name, _ in module.named_children()]
        return list(zip(names, names[1:], strict=False))
    # Modules whose forward is not a plain chain declare their pairs (see IBasicBlock).
    return list(getattr(module, "bn_fusable_pairs", ()))


def fuse_batchnorm(model: nn.Module) -> nn.Module:
    """An eval-mode copy of ``model`` in which conv->BN and linear->BN pairs are single layers.

    The result computes the same function as ``model.eval()`` up to float rounding, with fewer
    passes over memory; its state_dict differs (no BN entries), so it is for inference and export
    only. ``model`` itself is left untouched.
    """
    fused = copy.deepcopy(model).eval()
    for module in list(fused.modules()):
        for layer_name, bn_name in _fusable_pairs(module):
            replacement = _fuse_pair(getattr(module, layer_name), getattr(module, bn_name))
            if replacement is not None:
                setattr(module, layer_name, replacement)
                setattr(module, bn_name, nn.Identity())
    return fused
