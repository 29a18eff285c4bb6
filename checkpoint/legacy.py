"""`checkpoint.pt`: the single-file checkpoint of earlier pairface versions (every centre gathered on
rank 0), still read; a resume from it writes the sharded layout at its first save."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from checkpoint.restored import Restored, check_architecture
from training.components import optimizer_index
from training.state import TrainingState
from utils.distributed import rank, world
from utils.errors import CheckpointError
from utils.torch_files import load_torch_file

LEGACY_FORMAT = "pairface-checkpoint-1"
LEGACY_NAME = "checkpoint.pt"


def restore_legacy(path: Path, architecture: Mapping, state: TrainingState) -> Restored:
    """Load an earlier version's checkpoint.pt (memory-mapped: each rank touches only its own rows)."""
    checkpoint = read_legacy(path)
    check_architecture(checkpoint["model"], architecture, path)
    pfc = state.pfc
    state.backbone.load_state_dict(checkpoint["backbone"], strict=True)
    with torch.no_grad():
        pfc.weight.copy_(pfc.local_rows(checkpoint["class_centres"]))
    saved = checkpoint["optimizer"]
    centres_at = optimizer_index(state.optimizer, pfc.weight)
    optimizer_state = {index: {name: pfc.local_rows(value) if index == centres_at and torch.is_tensor(value)
                               and value.shape[0] == pfc.num_classes and value.dim() == 2 else value
                               for name, value in per_param.items()}
                       for index, per_param in saved["state"].items()}
    state.optimizer.load_state_dict({"state": optimizer_state, "param_groups": saved["param_groups"]})
    state.scheduler.load_state_dict(checkpoint["scheduler"])
    state.scaler.load_state_dict(checkpoint["grad_scaler"])
    same_world = checkpoint["world_size"] == world()
    return Restored(progress=checkpoint["progress"], world_size=checkpoint["world_size"], config=checkpoint["config"],
                    rank_state=checkpoint["per_rank"][rank()] if same_world else None,
                    first_rank_state=checkpoint["per_rank"][0])


def read_legacy(path: Path) -> dict:
    obj = load_torch_file(path, lambda reason: CheckpointError(
        f"cannot read {path} ({reason}); it is damaged or not a checkpoint: resume from another file or start a "
        "new run"), mmap=True)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a checkpoint or a state_dict; resume "
                              "from a run folder or a backbone .pth file")
    return obj
