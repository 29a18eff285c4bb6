"""The tiny training run that the tests and the device check's resume row start, and reading back what a run
left: its checkpoint assembled whole, its logged scalars, its backbone; and whether a resumed run ended exactly as
an uninterrupted one (run_difference), which gpu_check.py's resume row prints and tests/run_helpers.py asserts.
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from backbones import get_model
from checkpoint.pointer import POINTER_NAME

CONFIG = "configs/synthetic_pair.py"
# 40 two-view records of 20 identities (the `data` fixture of tests/test_train.py), batch 4: 10 steps
# per epoch on 1 process, 5 on 2. Every step logged; no verification (it is not what these tests check).
# The GPU recipe (SGD with momentum, ArcFace) is pinned so that retuning the demo config cannot change
# which optimizer state and margin these tests exercise. r18 at 1/16 of its widths: the smallest r18 that the
# fp16 runs also afford (float16 convolutions' backward has no fast CPU kernel).
QUIET = ["network=r18", "network_kwargs={'width_mult': 0.0625}", "embedding_size=32", "batch_size=4", "num_workers=0",
         "frequent=1", "verbose=1000", "val_targets=()", "num_epoch=4", "optimizer=sgd", "lr=0.1",
         "weight_decay=5e-4", "margin_list=(1.0, 0.5, 0.0)", "margin_scale=64.0"]
INFO = {"network": "r18", "network_kwargs": {"width_mult": 0.0625}, "embedding_size": 32, "num_classes": 20}


def arguments(data: Path, output: Path, *overrides: str, resume: bool = False, config: str = CONFIG,
              base: Sequence[str] = QUIET) -> list[str]:
    argv = [config]
    for item in [f"rec={data}", f"output={output}", *base, *overrides]:
        argv += ["--set", item]
    return argv + (["--resume"] if resume else [])


def load_run(output: Path, info: dict | None = None) -> dict:
    """The checkpoint `output/checkpoint.json` names, assembled whole in this process by torch's own
    DCP-to-torch.save converter and plain json: {"model", "config", "world_size", "progress", "backbone",
    "class_centres" (all rows), "optimizer" (state with all centre rows, param_groups), "scheduler",
    "grad_scaler", "per_rank": [{"rng", "loader"} of each rank]}. Asserts the model is `info`."""
    pointer = json.loads((output / POINTER_NAME).read_text())
    folder = output / pointer["directory"]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, f"{tmp}/whole.pt")
        whole = torch.load(f"{tmp}/whole.pt", weights_only=True)
    saved = json.loads((folder / "state.json").read_text())
    run = saved["run"]
    assert pointer["model"] == run["model"] == (info or INFO), (pointer["model"], run["model"])
    return {**{key: run[key] for key in ("model", "config", "world_size", "progress", "scheduler", "grad_scaler")},
            "backbone": torch.load(folder / "backbone.pth", weights_only=True), "class_centres": whole["centres"],
            "optimizer": {"state": {int(index): state for index, state in whole.get("optimizer", {}).items()},
                          "param_groups": run["param_groups"]},
            "per_rank": saved["ranks"]}


def load_backbone_strict(path: Path, info: dict | None = None) -> torch.nn.Module:
    info = info or INFO
    backbone = get_model(info["network"], num_features=info["embedding_size"], **info["network_kwargs"])
    backbone.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return backbone


def scalars(output: Path, tag: str) -> dict[int, float]:
    """step -> value of a TensorBoard scalar over every event file of the run (resumes add files; a
    step logged again replaces the old value, as TensorBoard shows it)."""
    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


TAGS = ("loss", "loss_view1", "loss_view2", "learning_rate")
SAVED_STATE = ("backbone", "class_centres", "optimizer", "scheduler", "grad_scaler", "progress")


def first_difference(a, b, where: str = "") -> str | None:
    """None when `a` and `b` are bitwise equal (as same_tensors), else the path of the first tensor or value
    that differs and how: 'optimizer.state.0.momentum_buffer: 3 of 512 elements differ, the largest by 1e-07'."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {describe(a)} against {describe(b)}"
        if torch.equal(a, b):
            return None
        unequal = a != b
        largest = (a.double() - b.double()).abs()[unequal].nan_to_num(nan=float("inf")).max().item()
        return f"{where}: {int(unequal.sum())} of {a.numel()} elements differ, the largest by {largest:.3g}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"
        return next((d for key in a if (d := first_difference(a[key], b[key], f"{where}.{key}".lstrip("."))) is not
                     None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items against {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{where}[{i}]")) is not
                     None), None)
    return None if a == b else f"{where}: {a!r} against {b!r}"


def describe(value) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__


def run_difference(split: Path, whole: Path, info: dict | None = None) -> str | None:
    """None when the resumed run `split` ended exactly as the uninterrupted run `whole` (logged scalars, every
    saved tensor, each rank's loader position and torch/CUDA generators, backbone.pth), else the first thing
    that differs."""
    for tag in TAGS:
        if (difference := first_difference(scalars(split, tag), scalars(whole, tag), f"logged {tag}")) is not None:
            return difference
    resumed, uninterrupted = load_run(split, info), load_run(whole, info)
    for key in SAVED_STATE:
        if (difference := first_difference(resumed[key], uninterrupted[key], key)) is not None:
            return difference
    for rank, (mine, theirs) in enumerate(zip(resumed["per_rank"], uninterrupted["per_rank"], strict=True)):
        if mine["loader"] != theirs["loader"]:
            return f"rank {rank}'s loader position: {mine['loader']} against {theirs['loader']}"
        # torch's generators draw the sampled centres and dropout masks (on a GPU, CUDA's). Python's and numpy's
        # global generators are seeded by nobody (training draws nothing from them): they differ between any two runs.
        if mine["rng"].keys() != theirs["rng"].keys():
            return f"rank {rank}'s generators: {sorted(mine['rng'])} against {sorted(theirs['rng'])}"
        for generator in sorted({"torch", "cuda"} & mine["rng"].keys()):
            if mine["rng"][generator] != theirs["rng"][generator]:
                return f"rank {rank}'s {generator} generator state"
    return first_difference(load_backbone_strict(split / "backbone.pth", info).state_dict(),
                            load_backbone_strict(whole / "backbone.pth", info).state_dict(), "backbone.pth")
