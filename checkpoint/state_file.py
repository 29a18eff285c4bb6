"""The fields of a checkpoint's `state.json`, checked one by one before any is used.

The file matches its checksum when it gets here, so whatever it holds was written so: by pairface, by
another program, or forged with its checksum recomputed. Each field a resume reads is checked for the
type and shape pairface writes (the random streams included, which `random.setstate`, numpy and torch
would otherwise refuse with a traceback, or worse, accept), so that a file that does not hold them is
one line naming the field. Keys nothing reads are let through; the scheduler's are not, since its
`load_state_dict` sets every key it is given as an attribute.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

STATE_NAME = "state.json"  # in every checkpoint folder, beside DCP's shards
MT_WORDS = 624  # the Mersenne Twister's state: 624 32-bit words and a position in 0..624 (Python, numpy)
WORD = 2 ** 32
OPTIMIZER_GROUPS = 2  # training/state.build_optimizer: the backbone's, then the centres'
# LambdaLR.state_dict()'s keys across the supported torch versions ("verbose" and "_is_initial" come and go)
SCHEDULER_KEYS = {"base_lrs", "last_epoch", "verbose", "_step_count", "_get_lr_called_within_step", "_last_lr",
                  "_is_initial", "lr_lambdas"}
GRAD_SCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}


class StateFieldError(ValueError):
    """A field of state.json that is not what pairface writes: the field's path and what it must be."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field {field!r} {problem}")
        self.field, self.problem = field, problem


def check_state(content: Mapping) -> None:
    """StateFieldError for the first field of `content` (state.json, its checksum removed) that a resume
    could not use as it is."""
    run = _object(_field(content, "run", ""), "run")
    _object(_field(run, "model", "run"), "run.model")
    _check_config(_object(_field(run, "config", "run"), "run.config"))
    world_size = _integer(_field(run, "world_size", "run"), "run.world_size", low=1)
    _check_progress(_object(_field(run, "progress", "run"), "run.progress"))
    _check_param_groups(_field(run, "param_groups", "run"))
    _check_scheduler(_object(_field(run, "scheduler", "run"), "run.scheduler"))
    _check_grad_scaler(_object(_field(run, "grad_scaler", "run"), "run.grad_scaler"))
    _check_optimizer_values(_object(_field(run, "optimizer_values", "run"), "run.optimizer_values"))
    ranks = _list(_field(content, "ranks", ""), "ranks")
    if len(ranks) != world_size:
        raise StateFieldError("ranks", f"holds {len(ranks)} entries, but run.world_size says {world_size} processes "
                                       "saved one each")
    for index, entry in enumerate(ranks):
        _check_rank(_object(entry, f"ranks[{index}]"), f"ranks[{index}]")


def _check_config(config: Mapping) -> None:
    """The values computed with (the LR ratio of a changed lr, the converter's schedule), where present: a key
    the file lacks is a key the resume does not compare; the rest are only compared and shown."""
    if "lr" in config:
        _number(config["lr"], "run.config.lr", low=0.0)
    for key in ("num_epoch", "batch_size", "gradient_acc"):
        if key in config:
            _integer(config[key], f"run.config.{key}", low=1)
    if "warmup_epoch" in config:
        _integer(config["warmup_epoch"], "run.config.warmup_epoch")


def _check_progress(progress: Mapping) -> None:
    for key, low in (("global_step", 0), ("steps_per_epoch", 1), ("nonfinite_total", 0)):
        _integer(_field(progress, key, "run.progress"), f"run.progress.{key}", low=low)
    if "epoch" in progress:
        _integer(progress["epoch"], "run.progress.epoch", low=0)
    if "shown_offset" in progress:
        _integer(progress["shown_offset"], "run.progress.shown_offset")
    for name, value in _object(progress.get("best_accuracy", {}), "run.progress.best_accuracy").items():
        _number(value, f"run.progress.best_accuracy.{name}")
    for name, value in _object(progress.get("verification", {}), "run.progress.verification").items():
        _object(value, f"run.progress.verification.{name}")


def _check_param_groups(value) -> None:
    groups = _list(value, "run.param_groups", length=OPTIMIZER_GROUPS)
    for index, group in enumerate(groups):
        where = f"run.param_groups[{index}]"
        group = _object(group, where)
        params = _list(_field(group, "params", where), f"{where}.params")
        for position, param in enumerate(params):
            _integer(param, f"{where}.params[{position}]", low=0)
        if len(set(params)) != len(params):
            raise StateFieldError(f"{where}.params", "names a parameter twice")
        for key in ("lr", "initial_lr", "weight_decay"):
            _number(_field(group, key, where), f"{where}.{key}", low=0.0)
        for key, setting in group.items():  # the optimizer's other settings: momentum, betas, eps, flags
            if key != "params":
                _setting(setting, f"{where}.{key}")


def _check_scheduler(scheduler: Mapping) -> None:
    unknown = sorted(set(scheduler) - SCHEDULER_KEYS)
    if unknown:
        raise StateFieldError(f"run.scheduler.{unknown[0]}", "is no key of the LR scheduler's state")
    _field(scheduler, "base_lrs", "run.scheduler")
    for key in ("base_lrs", "_last_lr"):
        if key in scheduler:
            rates = _list(scheduler[key], f"run.scheduler.{key}", length=OPTIMIZER_GROUPS)
            for index, rate in enumerate(rates):
                _number(rate, f"run.scheduler.{key}[{index}]", low=0.0)
    _integer(_field(scheduler, "last_epoch", "run.scheduler"), "run.scheduler.last_epoch", low=0)
    if "_step_count" in scheduler:
        _integer(scheduler["_step_count"], "run.scheduler._step_count", low=0)
    for key in ("verbose", "_get_lr_called_within_step", "_is_initial"):
        if key in scheduler:
            _boolean(scheduler[key], f"run.scheduler.{key}")
    if "lr_lambdas" in scheduler:  # a functools.partial's (empty) __dict__ per group, set back on it
        lambdas = _list(scheduler["lr_lambdas"], "run.scheduler.lr_lambdas", length=OPTIMIZER_GROUPS)
        if any(entry not in (None, {}) for entry in lambdas):
            raise StateFieldError("run.scheduler.lr_lambdas", "must hold null or {} per group: pairface's schedule "
                                                              "has no attributes to restore")


def _check_grad_scaler(scaler: Mapping) -> None:
    """{} (no fp16) or the GradScaler's five values."""
    if not scaler:
        return
    if set(scaler) != GRAD_SCALER_KEYS:
        raise StateFieldError("run.grad_scaler", f"must be {{}} or hold exactly {', '.join(sorted(GRAD_SCALER_KEYS))}")
    for key in ("scale", "growth_factor", "backoff_factor"):
        if _number(scaler[key], f"run.grad_scaler.{key}") <= 0:
            raise StateFieldError(f"run.grad_scaler.{key}", f"must be positive, not {scaler[key]!r}")
    _integer(scaler["growth_interval"], "run.grad_scaler.growth_interval", low=1)
    _integer(scaler["_growth_tracker"], "run.grad_scaler._growth_tracker", low=0)


def _check_optimizer_values(values: Mapping) -> None:
    """The optimizer's non-tensor state, by parameter number: settings-like values."""
    for index, per_param in values.items():
        if not index.isdigit():
            raise StateFieldError(f"run.optimizer_values.{index}", "must be named by a parameter's number")
        for name, value in _object(per_param, f"run.optimizer_values.{index}").items():
            _setting(value, f"run.optimizer_values.{index}.{name}")


def _check_rank(entry: Mapping, where: str) -> None:
    loader = _object(_field(entry, "loader", where), f"{where}.loader")
    _integer(_field(loader, "skipped", f"{where}.loader"), f"{where}.loader.skipped", low=0)
    rng = _object(_field(entry, "rng", where), f"{where}.rng")
    _check_python_rng(_field(rng, "python", f"{where}.rng"), f"{where}.rng.python")
    _check_numpy_rng(_field(rng, "numpy", f"{where}.rng"), f"{where}.rng.numpy")
    _check_bytes(_field(rng, "torch", f"{where}.rng"), f"{where}.rng.torch", torch.get_rng_state().numel())
    if "cuda" in rng:
        _check_bytes(rng["cuda"], f"{where}.rng.cuda",
                     torch.cuda.get_rng_state().numel() if torch.cuda.is_available() else None)


def _check_python_rng(value, where: str) -> None:
    """random.getstate(): [version 3, 624 words and the position, the cached Gaussian or null]."""
    shape = (f"must be random.getstate()'s [3, {MT_WORDS} integers in [0, 2**32) and a position in "
             f"0..{MT_WORDS}, null or a number]")
    if not (isinstance(value, list) and len(value) == 3 and value[0] == 3 and isinstance(value[1], list)
            and len(value[1]) == MT_WORDS + 1 and _words(value[1][:MT_WORDS])
            and _is_integer(value[1][MT_WORDS]) and 0 <= value[1][MT_WORDS] <= MT_WORDS
            and (value[2] is None or _is_number(value[2]))):
        raise StateFieldError(where, shape)


def _check_numpy_rng(value, where: str) -> None:
    """numpy.random.get_state() without its "MT19937": [624 words, position, has_gauss, cached_gaussian]."""
    if not (isinstance(value, list) and len(value) == 4 and isinstance(value[0], list) and len(value[0]) == MT_WORDS
            and _words(value[0]) and _is_integer(value[1]) and 0 <= value[1] <= MT_WORDS
            and value[2] in (0, 1) and _is_integer(value[2]) and _is_number(value[3])):
        raise StateFieldError(where, f"must be numpy's random state: [{MT_WORDS} integers in [0, 2**32), a position "
                                     f"in 0..{MT_WORDS}, 0 or 1, a number]")


def _check_bytes(value, where: str, length: int | None) -> None:
    """A torch generator's state: its bytes' values (`length` of them, where this torch says)."""
    if not (isinstance(value, list) and all(_is_integer(byte) and 0 <= byte < 256 for byte in value)
            and (length is None or len(value) == length)):
        size = f"{length} " if length is not None else ""
        raise StateFieldError(where, f"must be a torch generator's state: a list of {size}byte values (0..255)")


def _words(values: list) -> bool:
    return all(_is_integer(word) and 0 <= word < WORD for word in values)


def _field(parent: Mapping, key: str, where: str):
    if key not in parent:
        raise StateFieldError(f"{where}.{key}" if where else key, "is missing")
    return parent[key]


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise StateFieldError(where, f"must be a JSON object, not {_kind(value)}")
    return value


def _list(value, where: str, length: int | None = None) -> list:
    if not isinstance(value, list):
        raise StateFieldError(where, f"must be a list, not {_kind(value)}")
    if length is not None and len(value) != length:
        raise StateFieldError(where, f"must hold {length} entries, not {len(value)}")
    return value


def _integer(value, where: str, low: int | None = None) -> int:
    if not _is_integer(value):
        raise StateFieldError(where, f"must be an integer, not {_kind(value)}")
    if low is not None and value < low:
        raise StateFieldError(where, f"must be at least {low}, not {value}")
    return value


def _number(value, where: str, low: float | None = None) -> float:
    if not _is_number(value):
        raise StateFieldError(where, f"must be a finite number, not {_kind(value)}")
    if low is not None and value < low:
        raise StateFieldError(where, f"must be at least {low:g}, not {value}")
    return value


def _boolean(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise StateFieldError(where, f"must be true or false, not {_kind(value)}")
    return value


def _setting(value, where: str) -> None:
    """An optimizer setting: null, true/false, a finite number, or a list of finite numbers (AdamW's betas)."""
    if not (_is_plain(value) or (isinstance(value, list) and all(_is_number(item) for item in value))):
        raise StateFieldError(where, f"must be null, true/false, a number or a list of numbers, not {_kind(value)}")


def _is_plain(value) -> bool:
    return value is None or isinstance(value, bool) or _is_number(value)


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _kind(value) -> str:
    """How a JSON value reads in a message: its JSON type and a short excerpt."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    text = repr(value)
    return f"{names.get(type(value), 'the number')} {text[:40]}{'...' if len(text) > 40 else ''}"
