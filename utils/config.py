"""Configuration: configs/base.py, then an experiment file, then `--set key=value` overrides.

A config file is plain Python whose module-level names are the keys (names starting with `_`,
imported modules, functions, classes and typing forms are helpers, not keys), or an arcface_torch
config file whose `config = edict()` holds them (`config.key = value`): both merge onto base.py.
configs/base.py defines every key and annotates its type (a component above this floor, a margin family,
may declare keys of its own: `Declared`); anything else is an error naming the key and the closest valid one.
"""
from __future__ import annotations

import ast
import difflib
import math
import os
import re
import runpy
import shlex
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from utils.errors import ConfigError, located

BASE_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "base.py"


@dataclass(frozen=True)
class KeyRule:
    """A config key a component above this floor declares (a margin family): the values it accepts and a good one,
    for the error that names the fix. A key configs/base.py does not list (a family added later) also brings its
    `type` and `default`."""

    key: str
    accepts: Callable[[Any], bool]  # None is always accepted: "the component's own default"
    asked: str                      # what `accepts` admits, in words, e.g. "in [0, pi)"
    example: str                    # e.g. "0.5 (the paper's)"
    type: Any = None                # None: the key is configs/base.py's
    default: Any = None


@dataclass(frozen=True)
class Declared:
    """What the components above this floor add to configs/base.py (they may import this module, not the other way
    round): their own keys, and the value checks that read their declarations."""

    keys: tuple[KeyRule, ...] = ()
    check: Callable[[dict], None] | None = None


def load_config(path: str | os.PathLike, overrides: Sequence[str] = (), declared: Declared = Declared()
                ) -> SimpleNamespace:
    """The merged configuration: base defaults and `declared`'s own keys, the file's values, then each `key=value`
    override, checked (with `declared.check` last).

    `output` left empty (None, as arcface_torch's files leave it) becomes `output/<config file name>`.
    """
    defaults, types_by_key = _read_base()
    examples = {}  # the declared keys' good values: configs/base.py does not describe them
    for rule in declared.keys:
        if rule.type is not None and rule.key not in types_by_key:
            defaults[rule.key], types_by_key[rule.key] = rule.default, rule.type
            examples[rule.key] = rule.example
    values = dict(defaults)
    source = str(path)
    for key, value in _read_config_file(Path(path)).items():
        values[key] = _checked(key, value, types_by_key, f"config file {source}", examples)
    for item in overrides:
        key, value = _parse_override(item, types_by_key)
        values[key] = _checked(key, value, types_by_key, f"--set {item}", examples)
    if not values["output"]:
        values["output"] = os.path.join("output", Path(path).stem)
    _check_values(values)
    if declared.check is not None:
        declared.check(values)
    return SimpleNamespace(**values)


def _read_base() -> tuple[dict, dict]:
    names = _module_names(BASE_CONFIG)
    annotations = names.pop("__annotations__", {})
    return _keys_of(names), annotations


def _read_config_file(path: Path) -> dict:
    if path.suffix != ".py":
        raise ConfigError(f"config {path} is not a Python file; pass a configs/*.py file such as "
                          "configs/synthetic_pair.py")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing configs/*.py file such as "
                          "configs/synthetic_pair.py")
    names = _keys_of(_module_names(path))
    config = names.get("config")
    if isinstance(config, Mapping):  # arcface_torch's style: config = edict(); config.key = value
        del names["config"]
        names.update(config)
    # easydict is the files' import, not pairface's: its class is recognised by name
    elif edicts := [key for key, value in names.items() if isinstance(value, Mapping)
                    and type(value).__name__ == "EasyDict"]:
        raise ConfigError(f"config file {path} defines no `config`, but the edict object(s) {', '.join(edicts)}; "
                          f"name the object arcface_torch's way (config = edict()), or rename {edicts[0]} to config")
    return names


def _module_names(path: Path) -> dict:
    try:
        return runpy.run_path(str(path))
    except SyntaxError as error:
        raise ConfigError(f"config file {path} has a syntax error on line {error.lineno}: {error.msg}; "
                          "fix that line") from None
    except Exception as error:  # a config is user code: any failure is reported as the file's fault
        raise ConfigError(f"config file {path} failed to run ({type(error).__name__}: {error}); fix the file") from None


def _keys_of(names: dict) -> dict:
    """A config file's keys: its names but private ones and imported helpers (modules, functions, classes,
    typing forms such as Literal)."""
    helpers = (types.ModuleType, types.FunctionType, type)
    return {k: v for k, v in names.items()
            if not k.startswith("_") and not isinstance(v, helpers) and getattr(v, "__module__", None) != "typing"}


def override_key(item: str) -> str:
    """The key a `--set KEY=VALUE` override sets."""
    return item.partition("=")[0].strip()


def set_item(key: str, value: object) -> str:
    """The `KEY=VALUE` that `--set` parses back to `value` (a bare word for a string, as --set network=r18)."""
    return f"{key}={value if isinstance(value, str) else repr(value)}"


def set_arguments(values: Mapping[str, object]) -> str:
    """The `--set` options that give each key its value, as a shell takes them: ``--set network=r18 --set
    "network_kwargs={'width_mult': 0.0625}"`` (double quotes where the shell would split or strip the item)."""
    words = []
    for item in (set_item(key, value) for key, value in values.items()):
        words.append(f"--set {item}" if re.fullmatch(r"[\w.,=/+:-]+", item) else
                     f'--set "{item}"' if not re.search(r'["$`\\!]', item) else f"--set {shlex.quote(item)}")
    return " ".join(words)


def _parse_override(item: str, types_by_key: dict) -> tuple[str, object]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r} is not key=value; write e.g. --set lr=0.05")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # bare words such as --set network=r18 are strings
    if key in NETWORK_OPTION_TYPES and key not in types_by_key:
        raise ConfigError(f"--set {item}: {key} is an option of the network, not a config key; write it in "
                          f"network_kwargs, e.g. {set_arguments({'network_kwargs': {key: value}})} (that dict replaces "
                          "the config's: give the network's other options in it too)")
    _require_known(key, types_by_key, f"--set {item}")
    if _accepts_str(types_by_key[key]) and not _matches(value, types_by_key[key]):
        value = text
    return key, value


# Names other trainers (and habit) give these keys; spelling distance alone would suggest a wrong key for some
# (learning_rate is closest to sample_rate).
ALIASES = {
    "learning_rate": "lr", "base_lr": "lr", "epochs": "num_epoch", "num_epochs": "num_epoch", "epoch": "num_epoch",
    "max_epochs": "num_epoch", "warmup_epochs": "warmup_epoch", "warmup": "warmup_epoch", "steps": "max_steps",
    "max_iters": "max_steps", "wd": "weight_decay", "grad_clip": "max_grad_norm", "clip_grad_norm": "max_grad_norm",
    "gradient_accumulation": "gradient_acc", "accumulate_grad_batches": "gradient_acc", "batch": "batch_size",
    "bs": "batch_size", "workers": "num_workers", "classes": "num_classes", "emb_size": "embedding_size",
    "embedding_dim": "embedding_size", "feature_dim": "embedding_size", "margin": "margin_list",
    "scale": "margin_scale", "s": "margin_scale", "amp": "fp16", "data": "rec", "dataset": "rec",
    "output_dir": "output", "log_every": "frequent", "eval_every": "verbose", "save_every": "save_every_steps",
    "backbone": "network", "arch": "network",
}


def _require_known(key: str, types_by_key: dict, where: str) -> None:
    if key in types_by_key:
        return
    close = [ALIASES[key]] if key in ALIASES else difflib.get_close_matches(key, list(types_by_key), n=1, cutoff=0.0)
    raise ConfigError(f"unknown config key {key!r} in {where}; did you mean {close[0]!r}? "
                      "(every key is listed in configs/base.py)")


def _checked(key: str, value, types_by_key: dict, where: str, examples: Mapping[str, str]):
    _require_known(key, types_by_key, where)
    expected = types_by_key[key]
    if not _matches(value, expected):
        raise ConfigError(f"config key {key!r} must be {_type_name(expected)}, not {type(value).__name__} {value!r} "
                          f"(from {where}); {_spelling(key, value, expected, where, examples)}")
    return _coerced(value, expected)


def _spelling(key: str, value, expected, where: str, examples: Mapping[str, str]) -> str:
    """How to write a value that does not fit: a lone item of a tuple key as a one-item tuple, in the syntax
    of where it came from; else a declared key's example, or where the key is described."""
    if isinstance(value, str) and where.startswith("--set") and (meant := _dict_unquoted(value)) is not None:
        return f"the shell took the quotes off: quote the whole item, {set_arguments({key: meant})}"
    if not _matches((value,), expected):
        return f"e.g. {key}={examples[key]}" if key in examples else "see configs/base.py"
    if where.startswith("--set"):
        return f'write a tuple, e.g. --set "{key}={(value,)!r}"'
    return f"write a tuple, e.g. {key} = {(value,)!r}"


def _dict_unquoted(text: str) -> dict | None:
    """The dict ``{width_mult:0.0625}`` meant, once a shell has taken the quotes off its keys (None: not that)."""
    try:
        value = ast.literal_eval(re.sub(r"([{,]\s*)([A-Za-z_]\w*)\s*:", r"\1'\2':", text))
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, dict) else None


def _matches(value, expected) -> bool:
    origin = typing.get_origin(expected)
    if origin is typing.Literal:
        return value in typing.get_args(expected)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, option) for option in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list) or expected in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        element = typing.get_args(expected)[:1]
        return not element or all(_matches(item, element[0]) for item in value)
    if origin is dict or expected is dict:
        return isinstance(value, dict)
    return isinstance(value, expected)


def _coerced(value, expected):
    """The value in the annotated shape: ints given for floats become floats, lists become tuples."""
    if typing.get_origin(expected) in (types.UnionType, typing.Union):
        option = next(option for option in typing.get_args(expected) if _matches(value, option))
        return _coerced(value, option)
    if expected is float:
        return float(value)
    if typing.get_origin(expected) is tuple or expected is tuple:
        element = typing.get_args(expected)[:1]
        return tuple(_coerced(item, element[0]) for item in value) if element else tuple(value)
    return value


def _accepts_str(expected) -> bool:
    if typing.get_origin(expected) is typing.Literal:
        return any(isinstance(choice, str) for choice in typing.get_args(expected))
    return expected is str or any(_accepts_str(option) for option in typing.get_args(expected))


def _type_name(expected) -> str:
    if typing.get_origin(expected) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(expected)))
    if typing.get_origin(expected) in (types.UnionType, typing.Union):
        return " or ".join(_type_name(option) for option in typing.get_args(expected))
    if expected is type(None):
        return "None"
    return expected.__name__ if isinstance(expected, type) else str(expected)


# get_model's options and their types (its names come from backbones/registry.py): network_kwargs,
# --network-kw and model.json are checked against them before a network is built
NETWORK_OPTION_TYPES = {"num_features": int, "dropout": float, "fp16": bool, "width_mult": float, "mask_ratio": float,
                        "drop_path_rate": float, "using_checkpoint": bool}

_POSITIVE = ("num_views", "embedding_size", "batch_size", "gradient_acc", "num_epoch", "frequent", "verbose")
# torch.optim and the loop refuse these below zero (a traceback from deep inside): checked here first
# (warmup_epoch may be: arcface_torch's 3millions.py sets -1, a schedule without warmup, see utils/lr_scheduler.py)
_NOT_NEGATIVE = ("lr", "lr_power", "momentum", "weight_decay", "max_grad_norm", "num_workers", "max_steps",
                 "save_every_steps", "dropout", "backbone_lr_mult", "freeze_backbone_steps")


def _check_values(values: dict) -> None:
    """Value checks no single component could make on its own (types are already right)."""
    for key in _POSITIVE:
        if values[key] < 1:
            raise ConfigError(f"config key {key!r} must be at least 1, not {values[key]}")
    for key in _NOT_NEGATIVE:
        if values[key] < 0:
            raise ConfigError(f"config key {key!r} must not be negative, not {values[key]}; see configs/base.py")
    check_network_options(values["network_kwargs"], "config key 'network_kwargs'")
    if values["batch_size"] * values["num_views"] < 2:
        raise ConfigError("batch_size=1 with num_views=1 puts one image in each step, and the embedding's BatchNorm "
                          "needs two or more; raise batch_size")
    if values["fp16"] and values["bf16"]:
        raise ConfigError("config keys 'fp16' and 'bf16' are both True; choose one (--set bf16=False)")
    _check_augmentations(values["crop_scale"], values["erase_p"])
    _check_margins(values["margin_list"], values["margin_scale"])
    if not 0.0 <= values["sample_rate"] <= 1.0:
        raise ConfigError(f"config key 'sample_rate' must be in [0, 1], not {values['sample_rate']}; 1.0 uses every "
                          "class centre, 0 only the classes of each step's batch")
    weights = values["view_weights"]
    if weights is not None and len(weights) != values["num_views"]:
        raise ConfigError(f"config key 'view_weights' has {len(weights)} weights but num_views is "
                          f"{values['num_views']}; "
                          "give one weight per view or None")
    _check_semi_siamese(values)
    if values["warmup_epoch"] > values["num_epoch"]:
        raise ConfigError(f"config key 'warmup_epoch' ({values['warmup_epoch']}) exceeds num_epoch "
                          f"({values['num_epoch']})")


def _check_augmentations(crop_scale: tuple[float, ...], erase_p: float) -> None:
    """crop_scale is two area fractions (low, high), 0 < low <= high <= 1; erase_p a probability."""
    if len(crop_scale) != 2 or not 0.0 < crop_scale[0] <= crop_scale[1] <= 1.0:
        raise ConfigError(f"config key 'crop_scale' must be two area fractions (low, high) with 0 < low <= high <= 1, "
                          f"not {crop_scale!r}; e.g. crop_scale=(0.7, 1.0), or (1.0, 1.0) for no crop")
    if not 0.0 <= erase_p <= 1.0:
        raise ConfigError(f"config key 'erase_p' is a probability and must be in [0, 1], not {erase_p}; e.g. "
                          "erase_p=0.5, or 0 for no erasing")


def _check_semi_siamese(values: dict) -> None:
    """Semi-siamese training's keys (the queue's size against the world size is checked where that is known)."""
    if not values["sst"]:
        return
    if values["num_views"] != 2:
        raise ConfigError(f"config key 'sst' needs two views per record (a probe and a gallery photo of each "
                          f"identity), not num_views={values['num_views']}; set num_views=2")
    enqueued = values["batch_size"] * values["gradient_acc"] * (2 if values["sst_enqueue"] == "both" else 1)
    if values["sst_queue_size"] < enqueued:
        raise ConfigError(f"config key 'sst_queue_size' ({values['sst_queue_size']}) is smaller than the {enqueued} "
                          "gallery features a step of one process enqueues; raise it (FaceX-Zoo: 16384)")
    for key, (ok, asked), example in (("sst_momentum", _FRACTION, "0.999"), ("sst_centre_weight", _FRACTION, "0.5")):
        if not ok(values[key]):
            raise ConfigError(f"config key {key!r} must be {asked}, not {values[key]}; e.g. {key}={example}")


def _check_margins(margin_list: tuple[float, ...], scale: float) -> None:
    """The target logit s*(cos(m1*theta + m2) - m3) must exist and favour the target: s > 0, m1 > 0, m2 in [0, pi).
    margin_list is arcface_torch's own key, in every one of its configs: checked whichever family is chosen."""
    if len(margin_list) != 3:
        raise ConfigError(f"config key 'margin_list' must hold three numbers (m1, m2, m3), not {margin_list!r}")
    m1, m2, _ = margin_list
    if scale <= 0:
        raise ConfigError(f"config key 'margin_scale' must be positive, not {scale}; arcface_torch uses 64")
    if m1 <= 0:
        raise ConfigError(f"config key 'margin_list' has m1={m1}; the multiplicative margin must be positive "
                          "(1.0 turns it off), e.g. margin_list=(1.0, 0.5, 0.0)")
    if not 0.0 <= m2 < math.pi:
        raise ConfigError(f"config key 'margin_list' has m2={m2}; the additive angular margin must lie in [0, pi) "
                          "(ArcFace: 0.5), e.g. margin_list=(1.0, 0.5, 0.0)")


# Ranges a component's KeyRule may name: (the check, what it admits in words).
ANGLE = (lambda v: 0.0 <= v < math.pi, "in [0, pi)")
RATE = (lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
NOT_NEGATIVE = (lambda v: v >= 0.0, "at least 0")
_FRACTION = (lambda v: 0.0 <= v < 1.0, "in [0, 1)")


def check_rules(values: Mapping, rules: Sequence[KeyRule], owner: str) -> None:
    """ConfigError for the first key whose value (unless None) a rule refuses; `owner` says whose rule it is, e.g.
    "margin_family='adaface'"."""
    for rule in rules:
        value = values[rule.key]
        if value is not None and not rule.accepts(value):
            raise ConfigError(f"config key {rule.key!r} must be {rule.asked} for {owner}, not {value}; "
                              f"e.g. {rule.key}={rule.example}")


def check_data_path(cfg: SimpleNamespace) -> None:
    """A missing data folder is reported before any process group, model or loader is built."""
    if cfg.rec == "synthetic":
        return
    if not cfg.rec:
        raise ConfigError("config key 'rec' is empty; set it to the folder holding train.rec/train.idx "
                          "(e.g. --set rec=/data/ms1mv3) or to \"synthetic\"")
    if not os.path.exists(cfg.rec):
        raise ConfigError(f"config key 'rec' names data folder {located(cfg.rec)}, which does not exist; point rec at "
                          "the folder holding train.rec/train.idx, e.g. --set rec=/data/ms1mv3")


def planned_world_size(world_size: int | None, environ: Mapping[str, str]) -> int:
    """The number of processes a --dry-run plans for: --world-size, else WORLD_SIZE, else 1."""
    if world_size is None:
        text = environ.get("WORLD_SIZE", "1")
        if not text.strip().isdigit():
            raise ConfigError(f"environment variable WORLD_SIZE={text!r} is not a number of processes; unset it or "
                              "set it to a positive integer (torchrun sets it for you)")
        world_size = int(text)
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size} plans for no process; pass a positive number of processes")
    return world_size


def check_network_options(options: Mapping, where: str) -> None:
    """ConfigError naming `where` unless every get_model option of a known name has its type (unknown
    names are get_model's to refuse) and width_mult is positive."""
    for key, value in options.items():
        expected = NETWORK_OPTION_TYPES.get(key)
        if expected is not None and not _matches(value, expected):
            raise ConfigError(f"{where}: network option {key!r} must be {expected.__name__}, not "
                              f"{type(value).__name__} {value!r}; e.g. width_mult=0.25, num_features=512")
    if options.get("width_mult", 1.0) <= 0:
        raise ConfigError(f"{where}: network option 'width_mult' must be positive, not {options['width_mult']}")
