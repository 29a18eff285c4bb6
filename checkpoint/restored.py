"""What every checkpoint format hands back to the run, and the checks they share."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from utils.errors import CheckpointError

# What the weights are shaped by: a checkpoint must agree on each (the photos' preparation, also in the
# architecture a run records, may change between starts: it shapes no tensor).
SHAPE_KEYS = ("network", "network_kwargs", "embedding_size", "num_classes", "num_subcenters")
# A key a run records only when it differs from this (one centre per class: arcface_torch's and older runs').
SHAPE_DEFAULTS = {"num_subcenters": 1}


@dataclass
class Restored:
    """What a checkpoint tells the loop beyond the state it put in place."""

    progress: dict
    world_size: int
    config: dict
    rank_state: dict | None  # this rank's loader state and random streams; None when the world size changed
    first_rank_state: dict   # rank 0's, whose loader state stands in on another world size


def check_architecture(saved: Mapping, architecture: Mapping, where: Path) -> None:
    """CheckpointError unless the checkpoint at `where` was written for this run's network and classes."""
    def value(shape: Mapping, key: str):
        return shape.get(key, SHAPE_DEFAULTS.get(key))

    differences = [f"{key} {value(saved, key)!r} there, {value(architecture, key)!r} here" for key in SHAPE_KEYS
                   if (key in architecture or key in SHAPE_DEFAULTS) and value(saved, key) != value(architecture, key)]
    if differences:
        raise CheckpointError(f"{where} was written for another model ({'; '.join(differences)}); resume with the "
                              "config that wrote it, or start a new output folder")
