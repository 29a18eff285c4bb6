"""Loading a ``backbone.pth`` into a backbone, with errors that say which network the file fits."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from backbones.registry import REGISTRY, get_model
from utils.errors import ConfigError, WeightsError

logger = logging.getLogger(__name__)

# Training checkpoints that wrap the backbone's state_dict under one of these keys are accepted too
# (arcface_torch's checkpoint_gpu_*.pt uses the first).
_WRAPPER_KEYS = ("state_dict_backbone", "backbone", "state_dict", "model")
_DDP_PREFIX = "module."


def _is_state_dict(obj: object) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The backbone state_dict stored in ``path`` (a plain state_dict or a checkpoint wrapping one)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist; pass the backbone.pth written by training "
                           "(e.g. output/backbone.pth)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for a foreign or truncated file
        # torch's own text runs to paragraphs (e.g. on weights_only); its first sentence says what failed.
        reason = str(error).splitlines()[0].split(". ")[0] if str(error) else type(error).__name__
        raise WeightsError(f"{path} is not a readable PyTorch weights file ({reason}); pass a backbone "
                           "state_dict saved with torch.save(model.state_dict(), path)") from error
    if isinstance(obj, dict) and not _is_state_dict(obj):
        obj = next((obj[key] for key in _WRAPPER_KEYS if _is_state_dict(obj.get(key))), obj)
    if not _is_state_dict(obj):
        found = f"a dict with keys {sorted(obj)[:6]}" if isinstance(obj, dict) else type(obj).__name__
        raise WeightsError(f"{path} holds {found}, not a backbone state_dict; pass the backbone.pth "
                           "written by training")
    if all(key.startswith(_DDP_PREFIX) for key in obj):
        obj = {key[len(_DDP_PREFIX):]: value for key, value in obj.items()}
    return obj


def _shape_mismatches(expected: dict, found: dict) -> tuple[list[str], list[str], list[str]]:
    """Keys the network has but the file lacks, keys only the file has, keys whose shapes differ."""
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    reshaped = [
        f"{key} {list(found[key].shape)} in the file vs {list(expected[key].shape)} in the network"
        for key in expected
        if key in found and found[key].shape != expected[key].shape
    ]
    return missing, unexpected, reshaped


def _fits(state_dict: dict, name: str, **options) -> bool:
    with torch.device("meta"):
        try:
            model = get_model(name, **options)
        except ConfigError:  # e.g. a width that network cannot have
            return False
    return not any(_shape_mismatches(model.state_dict(), state_dict))


def suggest_network(state_dict: dict[str, torch.Tensor]) -> str | None:
    """'network r18, width_mult=0.5, num_features=512' for the network the weights fit, else None."""
    fitting = fitting_network(state_dict)
    return None if fitting is None else f"network {fitting[0]}, width_mult={fitting[1]:g}, num_features={fitting[2]}"


def fitting_network(state_dict: dict[str, torch.Tensor]) -> tuple[str, float, int] | None:
    """``(network, width_mult, num_features)`` the weights fit, else None."""
    embedding_keys = [key for key in state_dict if key.endswith("running_mean")]
    if not embedding_keys:
        return None
    num_features = state_dict[embedding_keys[-1]].shape[0]
    candidates = []
    for name, backbone in REGISTRY.items():
        if backbone.first_weight in state_dict:
            candidates.append((name, state_dict[backbone.first_weight].shape[0] / backbone.first_width))
    # Networks at their own width first: a full-size vit_l checkpoint also fits vit_b scaled by 1.5.
    candidates.sort(key=lambda candidate: candidate[1] != 1)
    for name, width_mult in candidates:
        if _fits(state_dict, name, width_mult=width_mult, num_features=num_features):
            return name, width_mult, int(num_features)
    return None


def _describe(items: list[str], what: str) -> str:
    shown = ", ".join(items[:3]) + (", ..." if len(items) > 3 else "")
    return f"{len(items)} {what} ({shown})"


def load_backbone(
    network: str,
    weights: str | Path,
    device: str | torch.device = "cpu",
    settings_fix: Callable[[str, float, int], str] | None = None,
    **model_options,
) -> nn.Module:
    """Backbone ``network`` built with ``model_options`` (see get_model), weights loaded strictly, in eval mode.

    Raises WeightsError for a missing file, and naming the missing, unexpected and
    mis-shaped keys (and the network the file does fit, when one does) for anything else;
    ``settings_fix(network, width_mult, num_features)`` words how to give the fitting network's settings where the
    caller takes them (default: "use those settings").
    """
    model = get_model(network, **model_options)
    state_dict = read_state_dict(weights)
    missing, unexpected, reshaped = _shape_mismatches(model.state_dict(), state_dict)
    if missing or unexpected or reshaped:
        problems = [
            _describe(items, what)
            for items, what in ((missing, "missing keys"), (unexpected, "unexpected keys"),
                                (reshaped, "shape mismatches"))
            if items
        ]
        options = ", ".join(f"{k}={v}" for k, v in model_options.items())
        fitting = fitting_network(state_dict)
        fix = ("pass the network (and width/embedding size) it was trained with" if fitting is None else
               f"it fits {suggest_network(state_dict)}: "
               f"{'use those settings' if settings_fix is None else settings_fix(*fitting)}")
        raise WeightsError(
            f"{weights} does not fit network {network}{f' ({options})' if options else ''}: "
            f"{', '.join(problems)}; {fix}"
        )
    model.load_state_dict(state_dict, strict=True)
    logger.info("Loaded %s weights from %s", network, weights)
    return model.to(device).eval()
