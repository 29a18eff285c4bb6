"""A trained backbone on disk, written by training and named the one way every tool takes it: a run folder,
or a ``.pth`` file.

A run folder written by train.py holds ``backbone.pth`` (the plain backbone state_dict with CPU tensors,
as arcface_torch saves it, so either project loads the other's with strict=True) and ``model.json``
(``network``, ``network_kwargs``, ``embedding_size``, ``num_classes``, and ``photo_preparation`` when the
training data recorded one: what ``save_backbone`` is given; and ``verification``: per verification set,
the operating point of the model's last verification, during training or by eval.verification, which
tools.inference's verdict uses; ``threshold_set``: the set among them whose threshold decides, which a set
evaluated later does not change unless asked). Given the folder, or a ``.pth`` with a ``model.json`` beside
it, nothing else is needed. A bare ``.pth`` (e.g. from arcface_torch) needs its network and the options it was trained
with: ``--network r50 --network-kw width_mult=0.25 num_features=256``.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from backbones.weights import load_backbone, read_state_dict, suggest_network
from dataset import PREPARATIONS
from utils.atomic import atomic_save, write_bytes
from utils.config import check_network_options
from utils.distributed import is_main
from utils.errors import ConfigError, WeightsError, located

BACKBONE_NAME = "backbone.pth"
MODEL_INFO_NAME = "model.json"


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """A (plain, not DDP-wrapped) module's state_dict with CPU tensors."""
    return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}


def save_backbone(backbone: nn.Module, output_dir: str | os.PathLike, architecture: Mapping,
                  verification: Mapping | None = None) -> Path:
    """Write `output_dir/backbone.pth` and `model.json` (rank 0 only; other ranks return the path untouched).
    `verification`: {set name: operating point} of the last verification, if any."""
    path = Path(output_dir) / BACKBONE_NAME
    if is_main():
        _write_model_info(path.parent / MODEL_INFO_NAME, model_info(architecture, verification))
        atomic_save(cpu_state_dict(backbone), path)
    return path


def record_verification(saved: SavedBackbone, verification: Mapping, decides: str | None = None) -> Path | None:
    """Put `verification` ({set name: operating point}) in the model.json beside `saved`'s weights, replacing
    what was recorded before for those sets (the others stay: a set evaluated alone does not take the place of
    the held-out one), and name the set whose threshold decides: `decides` when given, else the one that decided
    before, so that evaluating another set never changes the verdicts of tools.inference and tools.search unless
    asked (with nothing recorded before, the one deciding_set picks). The file written, or None when the weights
    have no model.json (a bare .pth)."""
    info_path = saved.weights.parent / MODEL_INFO_NAME
    if not info_path.is_file():
        return None
    recorded = {**saved.verification, **verification}
    if decides is None:
        decides = deciding_set(saved.verification or recorded, None, info_path, saved.threshold_set)[0]
    _write_model_info(info_path, {**_info_without_verification(info_path), THRESHOLD_SET_KEY: decides,
                                  "verification": recorded})
    return info_path


def forget_verification(saved: SavedBackbone, names: Sequence[str]) -> Path | None:
    """Take the sets `names` out of the model.json beside `saved`'s weights (their thresholds no longer judge
    pairs; a forgotten deciding set leaves the choice to deciding_set's rule); the file written, or None when the
    weights have no model.json."""
    info_path = saved.weights.parent / MODEL_INFO_NAME
    if not info_path.is_file():
        return None
    kept = {name: point for name, point in saved.verification.items() if name not in names}
    decides = {THRESHOLD_SET_KEY: saved.threshold_set} if saved.threshold_set in kept else {}
    _write_model_info(info_path, {**_info_without_verification(info_path), **decides, **model_info({}, kept)})
    return info_path


def _info_without_verification(info_path: Path) -> dict:
    return {key: value for key, value in json.loads(info_path.read_text()).items()
            if key not in ("verification", THRESHOLD_SET_KEY)}


# A threshold this loose (more than this share of different-person pairs pass it) judges pairs little better than
# a guess of "same person": recorded and used, but said each time it is.
WEAK_FAR = 0.1


def weak_threshold_caution(name: str, point: Mapping) -> str | None:
    """The caution line for a recorded threshold that lets more than WEAK_FAR of different-person pairs pass, else
    None."""
    if point["far"] <= WEAK_FAR:
        return None
    return (f"caution: the threshold of {name} ({point['threshold']:.4f}) lets {point['far']:.2g} of its different-"
            f"person pairs pass (FAR {point['far']:.2g}, above {WEAK_FAR:g}): a weak model, whose 'same person' is "
            "often wrong; train it further or on more people before trusting its verdicts")


def far_words(point: Mapping) -> str:
    """``FAR 0.0125``, or ``FAR < 1/20`` for a threshold that no different-person pair passed (of the 20 the set
    held): 0 would claim more than so few pairs can show. Points recorded before the count was kept say 0."""
    if point["far"] == 0 and point.get("different"):
        return f"FAR < 1/{point['different']}"
    return f"FAR {point['far']:.4g}"


THRESHOLD_SET_KEY = "threshold_set"
THRESHOLD_SET_DEFAULT = ("the set model.json names (threshold_set: the one deciding when eval.verification first "
                         "recorded a set there, or the one its --threshold-set named), else the largest (by pairs) of "
                         "the recorded sets whose people were kept out of training, else the largest not known to "
                         "hold training people, else the largest recorded")
THRESHOLD_SET_HELP = ("which verification set recorded in the model's model.json decides, by its threshold (a set is "
                      "named by its .bin file name without .bin, as model.json lists it); default: "
                      f"{THRESHOLD_SET_DEFAULT}")


def add_threshold_set_argument(parser: argparse.ArgumentParser, help_text: str = THRESHOLD_SET_HELP) -> None:
    """``--threshold-set NAME``: the same choice of the deciding threshold in eval.verification, tools.inference and
    tools.search."""
    parser.add_argument("--threshold-set", metavar="NAME", help=help_text)


def deciding_set(verification: Mapping[str, Mapping], requested: str | None, where: str | os.PathLike,
                 named: str | None = None) -> tuple[str, str]:
    """The recorded set (of ``verification``, model.json's at ``where``) whose threshold decides, and why:
    ``requested`` (--threshold-set), else ``named`` (model.json's threshold_set) while it is recorded, else as
    THRESHOLD_SET_HELP says. The largest set, since a threshold chosen on a few pairs moves with every pair; ties
    go to the set recorded first."""
    if requested is not None:
        if requested not in verification:
            raise ConfigError(f"--threshold-set {requested}: {where} records no set of that name (recorded: "
                              f"{', '.join(verification) or 'none'}); pass one of those")
        return requested, "--threshold-set"
    if named in verification:
        return named, (f"the set {MODEL_INFO_NAME} names ({THRESHOLD_SET_KEY}; eval.verification --threshold-set "
                       "NAME names another)")
    for wanted, why in ((True, "the largest recorded set of people kept out of training"),
                        (None, "the largest recorded set not known to hold training people")):
        candidates = [name for name, point in verification.items() if point.get("held_out") is wanted]
        if candidates:
            return max(candidates, key=lambda name: verification[name].get("pairs", 0)), why
    return (max(verification, key=lambda name: verification[name].get("pairs", 0)),
            "the largest recorded set; every one holds people the model was trained on")


def model_info(architecture: Mapping, verification: Mapping | None) -> dict:
    """model.json's content: the architecture, and the last verification's operating points if any."""
    return {**architecture, **({"verification": dict(verification)} if verification else {})}


def _write_model_info(path: Path, info: Mapping) -> None:
    atomic_save(json.dumps(dict(info), indent=2).encode(), path, write=write_bytes)


@dataclass(frozen=True)
class SavedBackbone:
    """Which weights file, and the ``get_model`` call that fits it."""

    weights: Path
    network: str
    options: dict[str, object] = field(default_factory=dict)
    verification: dict[str, dict] = field(default_factory=dict)  # model.json's, see the module doc
    photo_preparation: str | None = None  # how its training photos were prepared (model.json), if known
    threshold_set: str | None = None  # the recorded set whose threshold decides (model.json), if it names one

    @property
    def info_path(self) -> Path:
        """The model.json beside the weights (which may not exist: a bare .pth)."""
        return self.weights.parent / MODEL_INFO_NAME

    def describe(self) -> str:
        """``r18 (width_mult=0.125, num_features=32) from output/backbone.pth``."""
        options = ", ".join(f"{key}={value}" for key, value in self.options.items())
        return f"{self.network}{f' ({options})' if options else ''} from {self.weights}"


def parse_network_kw(items: Sequence[str]) -> dict[str, object]:
    """``["width_mult=0.25", "fp16=False"]`` -> ``{"width_mult": 0.25, "fp16": False}``."""
    options: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--network-kw {item!r} is not KEY=VALUE; write e.g. --network-kw width_mult=0.25")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            options[key] = text  # a bare word such as a name
    check_network_options(options, "--network-kw")
    return options


def _read_model_info(path: Path) -> tuple[str, dict[str, object], dict[str, dict], str | None, str | None]:
    """``(network, get_model options, verification, photo preparation, deciding set)`` from a model.json; the
    embedding size becomes num_features."""
    fix = "pass the .pth file with --network NAME instead, or the run folder train.py wrote"
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WeightsError(f"{path} cannot be read as JSON ({error}); {fix}") from None
    if not isinstance(info, dict) or not isinstance(info.get("network"), str) \
            or not isinstance(info.get("network_kwargs", {}), dict):
        raise WeightsError(f"{path} does not name a network as train.py writes it ('network', 'network_kwargs', "
                           f"'embedding_size'); {fix}")
    options = dict(info.get("network_kwargs", {}))
    if "embedding_size" in info:
        options["num_features"] = info["embedding_size"]
    try:
        check_network_options(options, str(path))
    except ConfigError as error:
        raise WeightsError(f"{error}; {fix}") from None
    verification = info.get("verification", {})
    preparation = info.get("photo_preparation")
    if preparation is not None and preparation not in PREPARATIONS:
        raise WeightsError(f"{path} records photo_preparation {preparation!r}, not one of {', '.join(PREPARATIONS)}; "
                           "remove that key, or use the model.json train.py wrote")
    decides = info.get(THRESHOLD_SET_KEY)
    return (info["network"], options, verification if isinstance(verification, dict) else {}, preparation,
            decides if isinstance(decides, str) else None)


def _merge(info_path: Path, saved_network: str, saved_options: dict[str, object], network: str | None,
           options: Mapping[str, object]) -> tuple[str, dict[str, object]]:
    """model.json's network and options, plus command-line ones that do not contradict them."""
    if network is not None and network != saved_network:
        raise ConfigError(f"--network {network} contradicts {info_path}, which says {saved_network}; drop --network "
                          "(a run folder names its own network)")
    for key, value in options.items():
        if key in saved_options and saved_options[key] != value:
            raise ConfigError(f"--network-kw {key}={value} contradicts {info_path}, which says "
                              f"{key}={saved_options[key]}; drop that option")
    return saved_network, {**saved_options, **options}


def find_saved_backbone(path: str | Path, network: str | None = None,
                  options: Mapping[str, object] | None = None) -> SavedBackbone:
    """The weights file and network that ``path`` names (a run folder or a .pth; see the module doc)."""
    path = Path(path)
    options = dict(options or {})
    if path.is_dir():
        weights = path / BACKBONE_NAME
        if not weights.is_file():
            raise WeightsError(f"folder {path} holds no {BACKBONE_NAME}; pass a run folder written by train.py "
                               "or a backbone .pth file")
    elif path.is_file():
        weights = path
    else:
        raise WeightsError(f"weights file {located(path)} does not exist; pass a run folder written by train.py or "
                           "a backbone .pth file")
    info_path = weights.parent / MODEL_INFO_NAME
    verification, preparation, decides = {}, None, None
    if info_path.is_file():
        saved_network, saved_options, verification, preparation, decides = _read_model_info(info_path)
        network, options = _merge(info_path, saved_network, saved_options, network, options)
    elif network is None:
        suggestion = suggest_network(read_state_dict(weights))
        hint = f" (it fits {suggestion})" if suggestion else ""
        raise ConfigError(f"{weights} is a bare backbone without a {MODEL_INFO_NAME} beside it; pass --network NAME "
                          f"and the options it was trained with as --network-kw KEY=VALUE{hint}")
    return SavedBackbone(weights=weights, network=network, options=options, verification=verification,
                         photo_preparation=preparation, threshold_set=decides)


def load_saved_backbone(path: str | Path, network: str | None = None, options: Mapping[str, object] | None = None,
                 device: str | torch.device = "cpu") -> tuple[nn.Module, SavedBackbone]:
    """The backbone ``path`` names, weights loaded strictly, in eval mode on ``device``, and what it is."""
    saved = find_saved_backbone(path, network, options)
    return load_backbone(saved.network, saved.weights, device, **saved.options), saved


def add_backbone_arguments(parser: argparse.ArgumentParser,
                        model_group: argparse._MutuallyExclusiveGroup | None = None) -> None:
    """``--model`` (alias ``--weights``), ``--network``, ``--network-kw``: the same in every tool.

    ``model_group``: a required group that also offers another source (eval's ``--onnx``).
    """
    (model_group or parser).add_argument(
        "--model", "--weights", dest="model", type=Path, required=model_group is None, metavar="PATH",
        help=f"a run folder written by train.py ({BACKBONE_NAME} + {MODEL_INFO_NAME}), or a backbone .pth file")
    parser.add_argument("--network", help="the network of a bare .pth, e.g. r50 (a run folder names its own)")
    parser.add_argument("--network-kw", nargs="+", default=[], metavar="KEY=VALUE",
                        help="get_model options a bare .pth was trained with, e.g. width_mult=0.25 num_features=256")


def load_backbone_from_args(args: argparse.Namespace,
                            device: str | torch.device = "cpu") -> tuple[nn.Module, SavedBackbone]:
    """``load_saved_backbone`` for the arguments ``add_backbone_arguments`` added."""
    return load_saved_backbone(args.model, args.network, parse_network_kw(args.network_kw), device)
