"""What a run resumes from (find_resume_source): one importer per kind of saved state, asked in turn which
of them a path is.

An importer says whether a path is its kind of save (`matches`) and puts that save into the training state
(`restore`). A new kind of source is one class here and one entry in IMPORTERS. The run folder's own
checkpoint comes first; a bare backbone .pth is what any other file is taken for.

Importers carry no state (equal whenever they are the same class), so a source found on rank 0 travels to
the other ranks as it is.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from backbones import load_backbone
from backbones.trained import BACKBONE_NAME
from checkpoint.arcface import MARKERS, MODEL_FILE, marker_for, restore_arcface
from checkpoint.manifest import MANIFEST_NAME
from checkpoint.pointer import POINTER_NAME, complete_folders, folder_step
from checkpoint.restored import Restored, check_architecture
from training.components import optimizer_index
from training.state import TrainingState, restore_components
from utils.config import set_arguments
from utils.distributed import rank, world
from utils.errors import CheckpointError, located
from utils.torch_files import load_torch_file

log = logging.getLogger(__name__)

LEGACY_FORMAT = "pairface-checkpoint-1"
LEGACY_NAME = "checkpoint.pt"
# What makes a folder a run worth guarding, in the order a resume prefers them: arcface_torch's rank
# files before its backbone alone (model.pt is all train_v2.py writes by default).
WEIGHTS_NAMES = (POINTER_NAME, LEGACY_NAME, *MARKERS, BACKBONE_NAME, MODEL_FILE)


class Importer(Protocol):
    """One kind of saved state a run can start from."""

    def matches(self, path: Path) -> Path | None:
        """The file or folder standing for this kind's save at `path` (a file or folder the user named, or the
        one a run folder resumes from), or None when `path` is not this kind."""

    def restore(self, path: Path, architecture: Mapping, state: TrainingState) -> Restored | None:
        """Put the save `matches` found into `state` (on every rank: collective); what it says beyond the
        state (None: it held the backbone's weights alone, so everything else starts fresh)."""


class Source(NamedTuple):
    importer: Importer
    path: Path


@dataclass(frozen=True)
class SavedCheckpoint:
    """pairface's own checkpoint: checkpoint.json, or one checkpoint folder (checkpoint/sharded.py)."""

    def matches(self, path: Path) -> Path | None:
        if path.is_dir():
            return path if folder_step(path.name) is not None and (path / MANIFEST_NAME).is_file() else None
        return path if path.suffix == ".json" and path.is_file() else None

    def restore(self, path: Path, architecture: Mapping, state: TrainingState) -> Restored:
        if path.is_dir() and not (path.parent / POINTER_NAME).is_file():
            log.warning("%s holds no %s: resuming from %s, its newest complete checkpoint folder, once every file "
                        "matches its checksum", path.parent, POINTER_NAME, path)
        # torch.distributed.checkpoint and DTensor behind it take about a second to import, which a start
        # refused before its steps (and --help) need not pay.
        from checkpoint.sharded import restore_state  # noqa: PLC0415

        return restore_state(path, architecture, state)


@dataclass(frozen=True)
class ArcfaceTorchSave:
    """A save of arcface_torch's, found from any one rank's file of it (checkpoint/arcface.py)."""

    def matches(self, path: Path) -> Path | None:
        return marker_for(path) if path.is_file() else None

    def restore(self, path: Path, architecture: Mapping, state: TrainingState) -> Restored:
        return restore_arcface(path, architecture, state)


@dataclass(frozen=True)
class EarlierCheckpoint:
    """`checkpoint.pt`: the single-file checkpoint of earlier pairface versions (every centre gathered on
    rank 0), still read; a resume from it writes the sharded layout at its first save."""

    def matches(self, path: Path) -> Path | None:
        return path if path.is_file() and read_legacy(path).get("format") == LEGACY_FORMAT else None

    def restore(self, path: Path, architecture: Mapping, state: TrainingState) -> Restored:
        """Memory-mapped: each rank touches only its own rows."""
        checkpoint = read_legacy(path)
        check_architecture(checkpoint["model"], architecture, path)
        pfc = state.pfc
        saved = checkpoint["optimizer"]
        centres_at = optimizer_index(state.optimizer, pfc.weight)
        optimizer_state = {str(index): {name: pfc.local_rows(value) if index == centres_at and torch.is_tensor(value)
                                        and value.shape[0] == pfc.num_classes and value.dim() == 2 else value
                                        for name, value in per_param.items()}
                           for index, per_param in saved["state"].items()}
        restore_components(state, {"backbone": checkpoint["backbone"],
                                   "centres": pfc.local_rows(checkpoint["class_centres"]),
                                   "optimizer": optimizer_state, "param_groups": saved["param_groups"],
                                   "scheduler": checkpoint["scheduler"], "grad_scaler": checkpoint["grad_scaler"]})
        same_world = checkpoint["world_size"] == world()
        return Restored(progress=checkpoint["progress"], world_size=checkpoint["world_size"],
                        config=checkpoint["config"],
                        rank_state=checkpoint["per_rank"][rank()] if same_world else None,
                        first_rank_state=checkpoint["per_rank"][0])


@dataclass(frozen=True)
class BareBackbone:
    """A backbone's state_dict alone (backbone.pth, arcface_torch's model.pt, or any .pth of its networks'):
    the backbone starts from it; class centres, optimizer and schedule start fresh."""

    def matches(self, path: Path) -> Path | None:
        return path if path.is_file() else None

    def restore(self, path: Path, architecture: Mapping, state: TrainingState) -> None:
        def as_sets(network: str, width_mult: float, num_features: int) -> str:
            options = {key: value for key, value in architecture["network_kwargs"].items() if key != "width_mult"}
            options |= {"width_mult": width_mult} if width_mult != 1 else {}
            return "start with " + set_arguments({"network": network, "network_kwargs": options,
                                                  "embedding_size": num_features})

        weights = load_backbone(architecture["network"], path, num_features=architecture["embedding_size"],
                                settings_fix=as_sets, **architecture["network_kwargs"])
        restore_components(state, {"backbone": weights.state_dict()})  # an EMA, too, starts from these weights
        log.info("initialised the backbone from %s (a bare backbone: class centres, optimizer and schedule "
                 "start fresh)", path)


IMPORTERS: tuple[Importer, ...] = (SavedCheckpoint(), ArcfaceTorchSave(), EarlierCheckpoint(), BareBackbone())


def find_resume_source(location: str | os.PathLike) -> Source:
    """What to resume from, for a run folder, a checkpoint folder or a file: the first importer
    that takes it, and the path it stands for. CheckpointError if there is none.

    A run folder resumes from its checkpoint.json, else from the first of WEIGHTS_NAMES it holds. One
    holding complete checkpoint folders but no checkpoint.json (it was deleted, or the first save was
    killed between its rename and the pointer switch) resumes from the newest of them, which the load
    verifies file by file like any other."""
    location = Path(location)
    if location.is_dir() and SavedCheckpoint().matches(location) is None:
        location = _resumed_in_run_folder(location)
    elif not location.exists():
        raise CheckpointError(f"resume source {located(location)} does not exist; point resume at a run folder, "
                              f"a {POINTER_NAME} or a backbone .pth file")
    # every file is at least a bare backbone's, so one importer takes it
    return next(Source(importer, found) for importer in IMPORTERS if (found := importer.matches(location)) is not None)


def _resumed_in_run_folder(folder: Path) -> Path:
    found = [folder / name for name in WEIGHTS_NAMES if (folder / name).is_file()]
    complete = complete_folders(folder)
    if complete and (not found or found[0].name != POINTER_NAME):
        return complete[0]
    if not found:
        raise CheckpointError(f"nothing to resume in {folder}: it holds neither {POINTER_NAME} nor "
                              f"{BACKBONE_NAME}; start a new run without --resume, or point resume at a checkpoint")
    return found[0]


def read_legacy(path: Path) -> dict:
    obj = load_torch_file(path, lambda reason: CheckpointError(
        f"cannot read {path} ({reason}); it is damaged or not a checkpoint: resume from another file or start a "
        "new run"), mmap=True)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a checkpoint or a state_dict; resume "
                              "from a run folder or a backbone .pth file")
    return obj
