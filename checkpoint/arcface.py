"""arcface_torch's training checkpoints: what its output folders hold, and resuming from them on any
number of processes.

arcface_torch wrote one set of files per rank of its run, in one of two layouts:
- train_v2 (train_v2.py, 2022 on, with save_all_states=True): `checkpoint_gpu_{rank}.pt`, written at
  each epoch end, a dict {"epoch" (epochs done), "global_step" (batches done), "state_dict_backbone",
  "state_dict_softmax_fc": {"weight": (num_local, D)}, "state_optimizer" (SGD or AdamW over two param
  groups: the backbone's parameters, then the centre shard), "state_lr_scheduler" (its
  PolynomialLRWarmup)}, beside rank 0's backbone as `model.pt`;
- 2021 (train.py with the first partial_fc.py): `backbone.pth`, `rank_{rank}_softmax_weight.pt` and
  `rank_{rank}_softmax_weight_mom.pt` (the centre shard and its SGD momentum as plain tensors); no
  step, schedule or backbone optimizer state: arcface_torch itself restarted such a run at step 0.
Rank r of W held the classes partial_fc.class_range(C, r, W), the split PartialFC uses.

Files are read memory-mapped: opening one reads its pickled structure, not its tensors, so rank 0
checks every file cheaply and each rank then reads only the rows it holds. They are read with torch's
weights-only unpickler (utils/torch_files.py): a crafted file is refused, never run.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from backbones import suggest_network
from checkpoint.restored import Restored
from partial_fc import PartialFC, class_range
from training.state import TrainingState, restore_components
from utils.distributed import is_main, run_on_rank0
from utils.errors import CheckpointError
from utils.lr_scheduler import schedule_power
from utils.progress import progress
from utils.torch_files import load_torch_file

TRAIN_V2, LAYOUT_2021 = "train_v2", "2021"
V2_FILE = "checkpoint_gpu_{}.pt"
WEIGHT_FILE = "rank_{}_softmax_weight.pt"
MOMENTUM_FILE = "rank_{}_softmax_weight_mom.pt"
BACKBONE_2021 = "backbone.pth"
MODEL_FILE = "model.pt"  # train_v2's backbone alone (rank 0's), written at every epoch end
MARKERS = (V2_FILE.format(0), WEIGHT_FILE.format(0))  # the file that stands for each layout's set
_RANK_FILE = re.compile(r"checkpoint_gpu_(\d+)\.pt|rank_(\d+)_softmax_weight(_mom)?\.pt")
_V2_KEYS = ("epoch", "global_step", "state_dict_backbone", "state_dict_softmax_fc", "state_optimizer",
            "state_lr_scheduler")
FRESH_LOADER = {"skipped": 0}  # a loader's state before its first record: arcface_torch's position is not ours

log = logging.getLogger(__name__)


def marker_for(path: Path) -> Path | None:
    """The rank-0 file standing for the set one arcface_torch rank file belongs to (None: not a rank file)."""
    match = _RANK_FILE.fullmatch(path.name)
    if match is None:
        return None
    return path.parent / MARKERS[0 if match.group(1) is not None else 1]


@dataclass(frozen=True)
class Layout:
    """What an arcface_torch output folder holds, read from every rank file's structure (no tensor data)."""

    folder: Path
    kind: str                      # TRAIN_V2 or LAYOUT_2021
    shards: tuple[int, ...]        # centre rows of each rank of the run that wrote it
    embedding_size: int
    global_step: int               # arcface_torch's count of batches (0 for the 2021 layout)
    epoch: int                     # epochs done
    optimizer: str                 # "SGD" or "AdamW"
    centre_index: int | None       # the centre shard's number in state_optimizer (None: the 2021 layout)
    settings: dict = field(default_factory=dict)  # the run's config values the files reveal (lr, ...)
    schedule: dict | None = None   # total_iters, warmup_iters, power of its PolynomialLRWarmup

    @property
    def world_size(self) -> int:
        return len(self.shards)

    @property
    def num_classes(self) -> int:
        return sum(self.shards)

    @property
    def steps_per_epoch(self) -> int:
        # arcface_torch saves at epoch ends only, so the steps done divide evenly into the epochs done;
        # at step 0 (the 2021 layout) nothing is renumbered and any value serves.
        return self.global_step // self.epoch if self.epoch else 1

    @property
    def pattern(self) -> str:
        """The name of its rank files, e.g. V2_FILE."""
        return V2_FILE if self.kind == TRAIN_V2 else WEIGHT_FILE

    def backbone_file(self) -> Path:
        return self.folder / (V2_FILE.format(0) if self.kind == TRAIN_V2 else BACKBONE_2021)

    def pieces(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """(source rank, first row in its file, rows) covering global rows start .. start + count - 1, in order."""
        found, offset = [], 0
        for source, rows in enumerate(self.shards):
            low, high = max(start, offset), min(start + count, offset + rows)
            if low < high:
                found.append((source, low - offset, high - low))
            offset += rows
        return found

    def read_shard(self, source: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rank `source`'s centres and their optimizer state (memory-mapped)."""
        if self.kind == TRAIN_V2:
            checkpoint = _load(self.folder / V2_FILE.format(source))
            state = checkpoint["state_optimizer"]["state"].get(self.centre_index, {})
            return checkpoint["state_dict_softmax_fc"]["weight"], state
        return (_load(self.folder / WEIGHT_FILE.format(source)),
                {"momentum_buffer": _load(self.folder / MOMENTUM_FILE.format(source))})


def read_layout(marker: Path) -> Layout:
    """Check the rank files of the set `marker` (a MARKERS file) stands for and describe them.
    CheckpointError naming the file for a missing, unreadable or foreign file and for files of different runs."""
    folder = marker.parent
    if marker.name == V2_FILE.format(0):
        return _read_train_v2(folder)
    return _read_2021(folder)


def _read_train_v2(folder: Path) -> Layout:
    shards, first = [], None
    for source in _ranks(folder, V2_FILE):
        path = folder / V2_FILE.format(source)
        checkpoint = _load(path)
        missing = [key for key in _V2_KEYS if key not in checkpoint] if isinstance(checkpoint, dict) else _V2_KEYS
        if missing:
            raise CheckpointError(f"{path} is not an arcface_torch train_v2 checkpoint (it lacks "
                                  f"{', '.join(missing)}); point resume at the output folder train_v2.py wrote")
        weight = _rows(checkpoint["state_dict_softmax_fc"].get("weight"), path, "state_dict_softmax_fc weight")
        groups = checkpoint["state_optimizer"]["param_groups"]
        if len(groups) != 2:
            raise CheckpointError(f"{path} holds an optimizer with {len(groups)} parameter groups, not arcface_torch's "
                                  "two (backbone, class centres); import a checkpoint train_v2.py wrote")
        centre_index = groups[1]["params"][0]
        for name, value in checkpoint["state_optimizer"]["state"].get(centre_index, {}).items():
            if torch.is_tensor(value) and value.dim() and value.shape != weight.shape:
                raise CheckpointError(f"{path} holds {name} of shape {tuple(value.shape)} for centres of shape "
                                      f"{tuple(weight.shape)}; the file is damaged: copy it again")
        if first is None:
            first = checkpoint
        elif (checkpoint["global_step"], checkpoint["epoch"]) != (first["global_step"], first["epoch"]):
            raise CheckpointError(f"{path} was saved at global step {checkpoint['global_step']}, "
                                  f"{folder / V2_FILE.format(0)} at {first['global_step']}; the folder mixes saves: "
                                  "copy every rank's file of one save into a folder of their own")
        shards.append(weight.shape[0])
    _check_split(shards, folder, V2_FILE)
    groups = first["state_optimizer"]["param_groups"]
    name = _optimizer_name(groups)
    scheduler = first["state_lr_scheduler"]
    schedule = {key: scheduler[key] for key in ("total_iters", "warmup_iters", "power")}
    layout = Layout(folder=folder, kind=TRAIN_V2, shards=tuple(shards), embedding_size=weight.shape[1],
                    global_step=first["global_step"], epoch=first["epoch"], optimizer=name,
                    centre_index=groups[1]["params"][0], schedule=schedule)
    return dataclasses.replace(layout, settings=_settings(layout, groups[0], scheduler["base_lrs"][0]))


def _settings(layout: Layout, group: dict, lr: float) -> dict:
    """The run's config values that its files reveal, to name the ones this run changes."""
    settings = {"optimizer": layout.optimizer.lower(), "lr": lr, "weight_decay": group["weight_decay"]}
    if layout.optimizer == "SGD":
        settings["momentum"] = group["momentum"]
    steps = layout.steps_per_epoch
    for key, iterations in (("num_epoch", layout.schedule["total_iters"]),
                            ("warmup_epoch", layout.schedule["warmup_iters"])):
        if iterations % steps == 0:  # arcface_torch sizes the schedule from the image count, not the loader
            settings[key] = iterations // steps
    return settings


def _read_2021(folder: Path) -> Layout:
    shards = []
    for source in _ranks(folder, WEIGHT_FILE):
        weight_path, momentum_path = folder / WEIGHT_FILE.format(source), folder / MOMENTUM_FILE.format(source)
        if not momentum_path.is_file():
            raise CheckpointError(f"{momentum_path} is missing; copy every rank's softmax weight and momentum file "
                                  "of the run into the folder")
        weight = _rows(_load(weight_path), weight_path, "the centre shard")
        momentum = _rows(_load(momentum_path), momentum_path, "the centre momentum")
        if momentum.shape != weight.shape:
            raise CheckpointError(f"{momentum_path} has shape {tuple(momentum.shape)}, {weight_path} "
                                  f"{tuple(weight.shape)}; the folder mixes runs: copy both files of each rank "
                                  "from one run")
        shards.append(weight.shape[0])
    _check_split(shards, folder, WEIGHT_FILE)
    if not (folder / BACKBONE_2021).is_file():
        raise CheckpointError(f"{folder / BACKBONE_2021} is missing beside the rank files; copy the backbone.pth "
                              "the same run wrote into the folder")
    return Layout(folder=folder, kind=LAYOUT_2021, shards=tuple(shards), embedding_size=weight.shape[1],
                  global_step=0, epoch=0, optimizer="SGD", centre_index=None)


def rank_files(folder: Path, pattern: str) -> dict[int, Path]:
    """The files of `folder` named like `pattern` (e.g. V2_FILE), by rank."""
    expression = re.compile(re.escape(pattern).replace(r"\{\}", r"(\d+)"))
    return {int(m.group(1)): path for path in folder.iterdir() if (m := expression.fullmatch(path.name))}


def _ranks(folder: Path, pattern: str) -> range:
    """0 .. W-1 for the W rank files of `pattern` in `folder`; CheckpointError naming the first one missing."""
    found = rank_files(folder, pattern)
    missing = next(r for r in range(len(found) + 1) if r not in found)
    if missing < len(found) or not found:
        held = ", ".join(map(str, sorted(found))) or "none"
        raise CheckpointError(f"{folder / pattern.format(missing)} is missing (the folder holds the files of ranks "
                              f"{held}); copy every rank's file of the save into it")
    return range(len(found))


def _check_split(shards: list[int], folder: Path, pattern: str) -> None:
    """The shards must be the split of their sum over their count; else the folder mixes world sizes."""
    total, world_size = sum(shards), len(shards)
    for source, rows in enumerate(shards):
        expected = class_range(total, source, world_size)[1]
        if rows != expected:
            raise CheckpointError(f"{folder / pattern.format(source)} holds {rows} class centres where rank {source} "
                                  f"of {world_size} holding {total} would hold {expected}; the folder mixes files of "
                                  "runs on different numbers of processes: copy the rank files of one run into a "
                                  "folder of their own")


def _rows(value, path: Path, what: str) -> torch.Tensor:
    if not torch.is_tensor(value) or value.dim() != 2:
        found = f"shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
        raise CheckpointError(f"{path} holds {found} as {what}, not a (classes, embedding_size) matrix; point "
                              "resume at an arcface_torch output folder")
    return value


def _load(path: Path):
    return load_torch_file(path, lambda reason: CheckpointError(
        f"cannot read {path} ({reason}); it is damaged or not an arcface_torch checkpoint: copy it again from the "
        "run that wrote it"), mmap=True)


def _optimizer_name(groups: list[dict]) -> str:
    return "AdamW" if "betas" in groups[0] else "SGD"


# --- fitting the run ------------------------------------------------------------------------------

def check_fits(layout: Layout, architecture: dict, state: TrainingState) -> None:
    """CheckpointError unless the files fit this run's embedding size, class count, network and optimizer."""
    where = layout.folder / layout.pattern.format(0)
    if state.pfc.num_subcenters > 1:
        raise CheckpointError(f"{where} holds one centre per class, this run {state.pfc.num_subcenters} sub-centres "
                              "per class (margin_family='subcenter'); continue it with margin_family='combined', or "
                              "start from its backbone alone (--set resume=<its model.pt>)")
    if layout.embedding_size != architecture["embedding_size"]:
        raise CheckpointError(f"{where} holds {layout.embedding_size}-dimensional class centres, this run's "
                              f"embedding_size is {architecture['embedding_size']}; set "
                              f"embedding_size={layout.embedding_size} (or resume with the config that trained it)")
    if layout.num_classes != architecture["num_classes"]:
        raise CheckpointError(_class_count_problem(layout, architecture["num_classes"]))
    _check_backbone(layout.backbone_file(), _backbone_state(layout), architecture, state.backbone)
    ours = _optimizer_name(state.optimizer.param_groups)
    if layout.optimizer != ours:
        raise CheckpointError(f"{where} holds {layout.optimizer} state, this run uses {ours}; set "
                              f"optimizer={layout.optimizer.lower()!r} to continue it (optimizer state does not carry "
                              "over to another optimizer)")


def _class_count_problem(layout: Layout, num_classes: int) -> str:
    # Files of ranks 0..W-1 of a run on more processes, the last ranks' files not copied?
    world = layout.world_size + 1
    while layout.num_classes < num_classes and world <= num_classes \
            and class_range(num_classes, 0, world)[1] >= layout.shards[0]:
        if [class_range(num_classes, r, world)[1] for r in range(layout.world_size)] == list(layout.shards):
            return (f"{layout.folder / layout.pattern.format(layout.world_size)} is missing: the folder holds ranks 0.."
                    f"{layout.world_size - 1} of a run on {world} processes; copy every rank's file into it")
        world += 1
    return (f"{layout.folder} holds {layout.num_classes} class centres in {layout.world_size} rank files, this run "
            f"has {num_classes} classes; set num_classes={layout.num_classes} (or resume with the config and data "
            "that trained it)")


def _backbone_state(layout: Layout) -> dict[str, torch.Tensor]:
    saved = _load(layout.backbone_file())
    return saved["state_dict_backbone"] if layout.kind == TRAIN_V2 else saved


def _check_backbone(where: Path, state: dict, architecture: dict, backbone: torch.nn.Module) -> None:
    expected = backbone.state_dict()
    differences = ([key for key in expected if key not in state] + [key for key in state if key not in expected]
                   + [key for key in expected if key in state and state[key].shape != expected[key].shape])
    if differences:
        suggestion = suggest_network(state)
        ours = ", ".join([f"network {architecture['network']}",
                          *(f"{key}={value}" for key, value in architecture["network_kwargs"].items())])
        fix = f"it fits {suggestion}: resume with those settings" if suggestion else \
            "resume with the network it was trained with"
        raise CheckpointError(f"{where} holds a backbone that does not fit {ours} ({len(differences)} keys differ, "
                              f"e.g. {differences[0]}); {fix}")


# --- loading --------------------------------------------------------------------------------------

def restore_arcface(marker: Path, architecture: dict, state: TrainingState, stream: TextIO | None = None) -> Restored:
    """Load the arcface_torch checkpoint `marker` stands for into `state`: the backbone and
    its optimizer state from rank 0's file, this rank's centre rows and their optimizer state from the
    files that hold them. Collective: rank 0 checks the files first and every rank raises its error.
    `stream` gets a progress line per file read (command lines pass one)."""
    layout = run_on_rank0(lambda: _checked(marker, architecture, state))
    first = _load(layout.backbone_file())
    centres, centre_state = _read_rows(layout, state.pfc, stream)
    optimizer_state = {}
    if layout.kind == TRAIN_V2:
        saved = first["state_optimizer"]
        # The backbone's parameter state as it is, copied: the file is not kept mapped during training.
        backbone_params = saved["param_groups"][0]["params"]
        optimizer_state = {ours: _cloned(saved["state"][theirs])
                           for ours, theirs in enumerate(backbone_params) if theirs in saved["state"]}
        scalars = {name: value for name, value in _cloned(saved["state"].get(layout.centre_index, {})).items()
                   if torch.is_tensor(value) and not value.dim()}  # AdamW's step: one count for all rows
        centre_state = {**scalars, **centre_state}
    if centre_state:
        optimizer_state[len(state.optimizer.param_groups[0]["params"])] = centre_state
    # This run's param groups stay: its config says lr, momentum and weight decay; what the files said
    # goes back as Restored.config, and the resume logs where the two differ. No schedule in pairface's form:
    # the resume jumps to the step; no grad scaler, EMA or margin state: they start afresh.
    restore_components(state, {"backbone": first["state_dict_backbone"] if layout.kind == TRAIN_V2 else first,
                               "centres": centres,
                               "optimizer": {str(index): values for index, values in optimizer_state.items()},
                               "param_groups": state.optimizer.state_dict()["param_groups"]})
    _log_import(layout, centre_state, schedule_power(state.scheduler))
    return Restored(progress={"global_step": layout.global_step, "steps_per_epoch": layout.steps_per_epoch,
                              "nonfinite_total": 0},
                    world_size=layout.world_size, config=layout.settings, rank_state=None,
                    first_rank_state={"loader": dict(FRESH_LOADER)})


def _cloned(state: dict) -> dict:
    return {name: value.clone() if torch.is_tensor(value) else value for name, value in state.items()}


def _checked(marker: Path, architecture: dict, state: TrainingState) -> Layout:
    layout = read_layout(marker)
    check_fits(layout, architecture, state)
    return layout


def _read_rows(layout: Layout, pfc: PartialFC, stream: TextIO | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's centre rows and their optimizer state, each read from the files that hold them: one file
    open at a time, no matrix beyond this rank's rows."""
    pieces = layout.pieces(pfc.class_start, pfc.num_local)
    centres = torch.empty_like(pfc.weight)
    targets: dict[str, torch.Tensor] = {}
    at = 0
    for source, first, rows in progress(pieces, len(pieces), "reading class centres", stream):
        weight, shard_state = layout.read_shard(source)
        centres[at:at + rows].copy_(weight[first:first + rows])
        for name, value in shard_state.items():
            if torch.is_tensor(value) and value.dim():
                target = targets.setdefault(name, torch.empty(pfc.weight.shape, dtype=value.dtype,
                                                              device=pfc.weight.device))
                target[at:at + rows].copy_(value[first:first + rows])
        at += rows
    return centres, targets


def _log_import(layout: Layout, centre_state: dict, power: float) -> None:
    what = ["backbone", f"{layout.num_classes} class centres"]
    if centre_state:
        what.append(f"{layout.optimizer} {'momentum' if layout.optimizer == 'SGD' else 'moments'}")
    if layout.kind == TRAIN_V2:
        what.append("LR schedule")
    log.info("imported arcface_torch checkpoint (%s, %d ranks, global step %d): %s%s", layout.kind,
             layout.world_size, layout.global_step, ", ".join(what),
             "" if layout.kind == TRAIN_V2 else "; the 2021 layout holds no step, LR schedule or backbone optimizer "
             "state: training starts at step 0, as arcface_torch restarted it")
    if layout.schedule and layout.schedule["power"] != power and is_main():
        log.warning("arcface_torch's LR schedule in %s decays with power %g (train_v2's default), pairface's with "
                    "power %g: from here on the learning rate follows pairface's curve (set lr_power=%g to keep "
                    "arcface_torch's)", layout.folder, layout.schedule["power"], power, layout.schedule["power"])
