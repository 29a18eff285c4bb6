"""A run that starts from another run's backbone takes that backbone's network keys from the model.json training
wrote beside it, so that a fine-tuning config runs as written whichever trained backbone it is given.

The keys that shape the weights (``network``, ``network_kwargs``, ``embedding_size``) must be the backbone's for
its weights to load; where the config file's differ, the model.json's replace them as ``--set`` values of the run
(recorded in config.json, so that a resume keeps them) and the log says so. Values the user gave by ``--set``
are never replaced: one that contradicts the model.json stops the start, naming the ``--set`` line that fits.
A backbone without a model.json (arcface_torch's model.pt) keeps the config's keys, and a mismatch is named when
its weights are loaded (checkpoint.sources.BareBackbone).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from backbones.trained import MODEL_INFO_NAME, find_saved_backbone
from utils.config import override_key, set_arguments
from utils.errors import ConfigError

NETWORK_KEYS = ("network", "network_kwargs", "embedding_size")


def backbone_network_sets(cfg: SimpleNamespace, overrides: Sequence[str]) -> dict[str, object]:
    """The network keys (``{key: value}``) that the model.json beside the backbone ``cfg.resume`` names gives and
    the config does not: {} when they agree, or when ``resume`` names no file with a model.json beside it (a run
    folder to continue, or arcface_torch's weights). ConfigError when a ``--set`` in ``overrides`` contradicts it."""
    if not isinstance(cfg.resume, str) or not Path(cfg.resume).is_file():
        return {}
    weights = Path(cfg.resume)
    info = weights.parent / MODEL_INFO_NAME
    if not info.is_file():
        return {}
    saved = find_saved_backbone(weights)
    options = dict(saved.options)
    embedding_size = options.pop("num_features", cfg.embedding_size)
    backbone = {"network": saved.network, "network_kwargs": {**cfg.network_kwargs, **options},
                "embedding_size": embedding_size}
    differing = {key: value for key, value in backbone.items() if getattr(cfg, key) != value}
    given = {override_key(item) for item in overrides}
    if contradicted := [key for key in NETWORK_KEYS if key in differing and key in given]:
        raise ConfigError(f"--set {contradicted[0]}={getattr(cfg, contradicted[0])!r} contradicts {info}, which "
                          f"describes the backbone resume={cfg.resume} names; drop that --set (the run takes "
                          f"{info}'s), or give all three as it says: {set_arguments(backbone)}")
    return differing


def network_words(values: dict[str, object]) -> str:
    """``r18 (width_mult=0.0625), embedding_size 128`` for network keys."""
    options = ", ".join(f"{key}={value}" for key, value in values["network_kwargs"].items())
    return f"{values['network']}{f' ({options})' if options else ''}, embedding_size {values['embedding_size']}"
