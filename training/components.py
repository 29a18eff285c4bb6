"""The training state as components: each piece a checkpoint saves is an object with torch's Stateful
protocol (``state_dict()`` / ``load_state_dict()``) that also checks what it loads, so that the checkpointer
(checkpoint/sharded.py) and every importer (checkpoint/arcface.py, checkpoint/sources.py) iterate over them
instead of knowing their fields. A new piece of state is a new component and its line in the one registry,
``training.state.COMPONENTS``.

Where a component's state goes: ``state_dict()`` returns ``{key: value}`` for the keys it owns. A key in
``file_keys`` is written by rank 0 as a torch file of its own (the backbone's backbone.pth, the file
arcface_torch and the tools read); a key in ``tensor_keys`` holds tensors, written by
torch.distributed.checkpoint (each rank its own: centre rows as blocks of the global matrix, ``shard``; a
tensor every rank holds alike is written once); every other key is plain JSON in state.json: rank 0's under
``run``, or every rank's under ``ranks`` for a ``per_rank`` component. ``check(section, where)`` raises
StateFieldError for the first of its JSON fields that is not what pairface writes; the checkpointer runs every
component's check before it loads anything.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch
from torch import nn

from partial_fc import PartialFC
from training.fields import (
    StateFieldError,
    boolean,
    field,
    integer,
    is_integer,
    is_number,
    json_list,
    json_object,
    number,
    setting,
)
from utils.compat import row_block, row_block_rows

OPTIMIZER_GROUPS = 2  # training/state.build_optimizer: the backbone's, then the centres'
MT_WORDS = 624  # the Mersenne Twister's state: 624 32-bit words and a position in 0..624 (Python, numpy)
WORD = 2 ** 32

log = logging.getLogger(__name__)


class Component(Protocol):
    """One piece of the training state as a checkpoint saves it (subclass to inherit the defaults)."""

    keys: tuple[str, ...]  # the keys it owns in its section of state.json (and DCP's, for tensor_keys)
    file_keys: tuple[str, ...] = ()  # those rank 0 writes as a torch file of their own (backbone.pth)
    tensor_keys: tuple[str, ...] = ()  # those holding tensors, which DCP writes
    per_rank: bool = False  # every rank's own state (ranks[i]), else rank 0's (run)
    rank_0_stands_in: bool = False  # per_rank: on another number of processes, rank 0's is loaded on every rank

    @classmethod
    def build(cls, state, config: Mapping) -> Component | None:
        """This run's instance over `state` (a TrainingState), built once with it; None where `config` leaves
        it out, and for the components that are the run's own objects, passed with every save and resume
        (the step counter, the loader's position: training.state.registry)."""
        return None

    def state_dict(self) -> dict:
        """{key: value} for its keys, now: JSON values, and tensors under tensor_keys (not copied)."""
        ...

    def load_state_dict(self, saved: Mapping) -> None:
        """Put back what state_dict returned: `saved` holds those of its keys the checkpoint has (a key an
        earlier version, arcface_torch or a bare backbone did not write is absent: the component keeps what it
        has or starts afresh), already checked, tensors loaded through `template`."""
        ...

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        """StateFieldError for the first of its JSON fields in `section` (state.json's `where`) that a load
        could not use as it is."""

    def shard(self, path: tuple[str, ...], tensor: torch.Tensor) -> torch.Tensor:
        """How the tensor at `path` of state_dict() is written: as it is, or as this rank's rows of a
        global matrix (row_block)."""
        return tensor

    def template(self, saved: Mapping[str, tuple]) -> dict:
        """Where DCP loads its tensor keys, given what the checkpoint holds ({fqn: (shape, dtype)}): by
        default its own tensors, loaded in place."""
        return {key: value for key, value in self.state_dict().items() if key in self.tensor_keys and key in
                {fqn.split(".", 1)[0] for fqn in saved}}

    def before_step(self) -> None:
        """Called as every optimizer step begins, before its first forward."""

    def after_step(self) -> None:
        """Called after every optimizer step taken (not after a skipped one)."""

    def exported(self, backbone: nn.Module) -> nn.Module:
        """The backbone that backbone.pth and verification use, given the one so far (the trained one)."""
        return backbone


# --- run-wide state: rank 0 saves it, every rank loads it --------------------------------------------

class Backbone(Component):
    """The backbone's weights and BatchNorm statistics, as backbone.pth, rank 0's (DDP keeps the weights equal on
    every rank, but each rank's BatchNorm statistics follow its own batches). Loaded first: the components that
    follow the backbone find the file's weights in it. With ema_decay, training/ema.py's BackboneEMA stands in
    for it (backbone.pth then holds the average)."""

    keys = file_keys = ("backbone",)

    def __init__(self, backbone: nn.Module):
        self.backbone = backbone

    @classmethod
    def build(cls, state, config: Mapping) -> Backbone | None:
        return None if config.get("ema_decay") else cls(state.backbone)

    def state_dict(self) -> dict:
        return {"backbone": self.backbone.state_dict()}

    def load_state_dict(self, saved: Mapping) -> None:
        if "backbone" in saved:
            self.backbone.load_state_dict(saved["backbone"], strict=True)


def exported_backbone(state) -> nn.Module:
    """The backbone that backbone.pth and verification use: the trained one unless a component (an EMA) says
    otherwise."""
    backbone = state.backbone
    for component in state.components:
        backbone = component.exported(backbone)
    return backbone


class Centres(Component):
    """The class centres, each rank's rows a block of the global (num_classes * K, D) matrix: a run on
    another number of processes reads its rows from whichever files hold them."""

    keys = tensor_keys = ("centres",)

    def __init__(self, pfc: PartialFC):
        self.pfc = pfc

    @classmethod
    def build(cls, state, config: Mapping) -> Centres:
        return cls(state.pfc)

    def state_dict(self) -> dict:
        return {"centres": self.pfc.weight.detach()}

    def shard(self, path: tuple[str, ...], tensor: torch.Tensor) -> torch.Tensor:
        return centre_block(self.pfc, tensor)

    def template(self, saved: Mapping[str, tuple]) -> dict:
        return {"centres": centre_block(self.pfc, self.pfc.weight)}  # loaded into the weights in place

    def load_state_dict(self, saved: Mapping) -> None:
        """This rank's rows: DCP loaded them into the weights already; an importer hands them over."""
        if "centres" not in saved:
            return
        rows = row_block_rows(saved["centres"])
        if rows.data_ptr() != self.pfc.weight.data_ptr():
            with torch.no_grad():
                self.pfc.weight.copy_(rows)


class Optimizer(Component):
    """The optimizer over backbone and centres: its tensors (momentum, Adam's moments; the centres' as row
    blocks) through DCP, its settings per parameter group and any non-tensor state as JSON."""

    keys = ("optimizer", "param_groups", "optimizer_values")
    tensor_keys = ("optimizer",)

    def __init__(self, optimizer: torch.optim.Optimizer, pfc: PartialFC):
        self.optimizer, self.pfc = optimizer, pfc

    @classmethod
    def build(cls, state, config: Mapping) -> Optimizer:
        return cls(state.optimizer, state.pfc)

    def state_dict(self) -> dict:
        saved = self.optimizer.state_dict()
        tensors: dict[str, dict] = {}
        values: dict[str, dict] = {}  # the optimizer's non-tensor state (none in torch's SGD and AdamW)
        for index, per_param in saved["state"].items():
            for name, value in per_param.items():
                (tensors if torch.is_tensor(value) else values).setdefault(str(index), {})[name] = value
        return {"optimizer": tensors, "param_groups": saved["param_groups"], "optimizer_values": values}

    def shard(self, path: tuple[str, ...], tensor: torch.Tensor) -> torch.Tensor:
        _, index, _ = path
        if int(index) == self._centres_at() and is_centre_rows(tensor, *self.pfc.weight.shape):
            return centre_block(self.pfc, tensor)
        return tensor

    def template(self, saved: Mapping[str, tuple]) -> dict:
        """New tensors of the saved shapes (this rank's rows of the centre-shaped ones): the optimizer's
        state is created by its first step, so there may be nothing to load into yet."""
        pfc, centres_at = self.pfc, self._centres_at()
        tensors: dict[str, dict] = {}
        for fqn, (shape, dtype) in saved.items():
            if not fqn.startswith("optimizer."):
                continue
            _, index, name = fqn.split(".", 2)
            if int(index) == centres_at and shape == (pfc.num_classes * pfc.num_subcenters, *pfc.weight.shape[1:]):
                value = centre_block(pfc, torch.empty(pfc.weight.shape, dtype=dtype))
            else:
                value = torch.empty(shape, dtype=dtype)
            tensors.setdefault(index, {})[name] = value
        return {"optimizer": tensors}

    def load_state_dict(self, saved: Mapping) -> None:
        if "param_groups" not in saved:  # a bare backbone: the optimizer starts afresh
            return
        state = {int(index): {name: row_block_rows(value) for name, value in values.items()}
                 for index, values in saved.get("optimizer", {}).items()}
        for index, values in saved.get("optimizer_values", {}).items():
            state.setdefault(int(index), {}).update(values)
        self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
        self._in_parameter_layouts()

    def _in_parameter_layouts(self) -> None:
        """Each parameter-shaped state tensor in its parameter's memory layout. A fused update walks a parameter
        and its state in memory order, so a momentum buffer loaded NCHW for channels_last weights (or the other
        way round, a checkpoint written with the other setting) would update each weight with another's momentum:
        torch's fused SGD does so without a word."""
        for param, per_param in self.optimizer.state.items():
            for name, value in per_param.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    per_param[name] = torch.empty_like(param, dtype=value.dtype).copy_(value)

    def _centres_at(self) -> int:
        return optimizer_index(self.optimizer, self.pfc.weight)

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        groups = json_list(field(section, "param_groups", where), f"{where}.param_groups", length=OPTIMIZER_GROUPS)
        for index, group in enumerate(groups):
            at = f"{where}.param_groups[{index}]"
            group = json_object(group, at)
            params = json_list(field(group, "params", at), f"{at}.params")
            for position, param in enumerate(params):
                integer(param, f"{at}.params[{position}]", low=0)
            if len(set(params)) != len(params):
                raise StateFieldError(f"{at}.params", "names a parameter twice")
            for key in ("lr", "initial_lr", "weight_decay"):
                number(field(group, key, at), f"{at}.{key}", low=0.0)
            for key, value in group.items():  # the optimizer's other settings: momentum, betas, eps, flags
                if key != "params":
                    setting(value, f"{at}.{key}")
        values = json_object(field(section, "optimizer_values", where), f"{where}.optimizer_values")
        for index, per_param in values.items():
            if not index.isdigit():
                raise StateFieldError(f"{where}.optimizer_values.{index}", "must be named by a parameter's number")
            for name, value in json_object(per_param, f"{where}.optimizer_values.{index}").items():
                setting(value, f"{where}.optimizer_values.{index}.{name}")


class Schedule(Component):
    """The LR schedule (a LambdaLR)."""

    keys = ("scheduler",)
    # LambdaLR.state_dict()'s keys across the supported torch versions ("verbose" and "_is_initial" come and go)
    KNOWN = {"base_lrs", "last_epoch", "verbose", "_step_count", "_get_lr_called_within_step", "_last_lr",
             "_is_initial", "lr_lambdas"}

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.scheduler = scheduler

    @classmethod
    def build(cls, state, config: Mapping) -> Schedule:
        return cls(state.scheduler)

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, saved: Mapping) -> None:
        if "scheduler" in saved:  # arcface_torch's schedule is not a LambdaLR's: the resume jumps to its step
            self.scheduler.load_state_dict(saved["scheduler"])

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        """Every key: LambdaLR's load_state_dict sets each key it is given as an attribute."""
        at = f"{where}.scheduler"
        scheduler = json_object(field(section, "scheduler", where), at)
        unknown = sorted(set(scheduler) - cls.KNOWN)
        if unknown:
            raise StateFieldError(f"{at}.{unknown[0]}", "is no key of the LR scheduler's state")
        field(scheduler, "base_lrs", at)
        for key in ("base_lrs", "_last_lr"):
            if key in scheduler:
                for index, rate in enumerate(json_list(scheduler[key], f"{at}.{key}", length=OPTIMIZER_GROUPS)):
                    number(rate, f"{at}.{key}[{index}]", low=0.0)
        integer(field(scheduler, "last_epoch", at), f"{at}.last_epoch", low=0)
        if "_step_count" in scheduler:
            integer(scheduler["_step_count"], f"{at}._step_count", low=0)
        for key in ("verbose", "_get_lr_called_within_step", "_is_initial"):
            if key in scheduler:
                boolean(scheduler[key], f"{at}.{key}")
        if "lr_lambdas" in scheduler:  # a functools.partial's (empty) __dict__ per group, set back on it
            lambdas = json_list(scheduler["lr_lambdas"], f"{at}.lr_lambdas", length=OPTIMIZER_GROUPS)
            if any(entry not in (None, {}) for entry in lambdas):
                raise StateFieldError(f"{at}.lr_lambdas", "must hold null or {} per group: pairface's schedule "
                                                          "has no attributes to restore")


class GradScale(Component):
    """The fp16 grad scaler: {} when it is off."""

    keys = ("grad_scaler",)
    KNOWN = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    @classmethod
    def build(cls, state, config: Mapping) -> GradScale:
        return cls(state.scaler)

    def state_dict(self) -> dict:
        return {"grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, saved: Mapping) -> None:
        if "grad_scaler" in saved:  # arcface_torch's files hold none
            self.scaler.load_state_dict(saved["grad_scaler"])

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        at = f"{where}.grad_scaler"
        scaler = json_object(field(section, "grad_scaler", where), at)
        if not scaler:
            return
        if set(scaler) != cls.KNOWN:
            raise StateFieldError(at, f"must be {{}} or hold exactly {', '.join(sorted(cls.KNOWN))}")
        for key in ("scale", "growth_factor", "backoff_factor"):
            if number(scaler[key], f"{at}.{key}") <= 0:
                raise StateFieldError(f"{at}.{key}", f"must be positive, not {scaler[key]!r}")
        integer(scaler["growth_interval"], f"{at}.growth_interval", low=1)
        integer(scaler["_growth_tracker"], f"{at}._growth_tracker", low=0)


class MarginState(Component):
    """The margin family's state (EMAs, the draw position): PartialFC's margin_state_dict, with the family's
    name. A checkpoint of another family (or of a version without margin families) leaves this family's
    state at its start, and says so."""

    keys = ("margin",)

    def __init__(self, pfc: PartialFC):
        self.pfc = pfc

    @classmethod
    def build(cls, state, config: Mapping) -> MarginState:
        return cls(state.pfc)

    def state_dict(self) -> dict:
        return {"margin": {"family": type(self.pfc.margin_loss).__name__, **self.pfc.margin_state_dict()}}

    def load_state_dict(self, saved: Mapping) -> None:
        family, margin = type(self.pfc.margin_loss).__name__, saved.get("margin")
        if margin is not None and margin.get("family") == family:
            self.pfc.load_margin_state_dict(margin)
        elif self.pfc.margin_state.numel():
            log.warning("the checkpoint holds no state of the %s margin (it was trained with %s): its state "
                        "starts afresh", family, (margin or {}).get("family", "an earlier version or arcface_torch, "
                                                                               "or it holds a backbone alone"))


# --- per-process state: every rank saves its own ---------------------------------------------------------

class RandomStreams(Component):
    """This process's random streams (Python, numpy, torch CPU and CUDA), for an exact resume. Saved as plain
    JSON numbers (the torch states are byte tensors, stored as their bytes' values): a checkpoint's random
    streams never go through an unpickler."""

    keys = ("rng",)
    per_rank = True

    @classmethod
    def build(cls, state, config: Mapping) -> RandomStreams:
        return cls()

    def state_dict(self) -> dict:
        version, internal, gauss = random.getstate()
        _, keys, position, has_gauss, cached_gauss = np.random.get_state()
        state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().tolist(),
                 "numpy": [keys.tolist(), int(position), int(has_gauss), float(cached_gauss)]}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state().tolist()
        return {"rng": state}

    def load_state_dict(self, saved: Mapping) -> None:
        """Also checkpoint.pt's encoding (an earlier version's: tuples and tensors)."""
        if "rng" not in saved:  # arcface_torch's files hold none: the streams go on as seeded
            return
        state = saved["rng"]
        random.setstate(_as_tuples(state["python"]))
        torch.set_rng_state(_byte_tensor(state["torch"]))
        keys, position, has_gauss, cached_gauss = state["numpy"][-4:]  # checkpoint.pt's starts with "MT19937"
        keys = keys.numpy() if torch.is_tensor(keys) else np.asarray(keys)
        np.random.set_state(("MT19937", keys.astype(np.uint32), int(position), int(has_gauss), float(cached_gauss)))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(_byte_tensor(state["cuda"]))

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        """Random streams that random.setstate, numpy and torch would otherwise refuse with a traceback, or
        worse, accept."""
        rng = json_object(field(section, "rng", where), f"{where}.rng")
        _check_python_rng(field(rng, "python", f"{where}.rng"), f"{where}.rng.python")
        _check_numpy_rng(field(rng, "numpy", f"{where}.rng"), f"{where}.rng.numpy")
        _check_bytes(field(rng, "torch", f"{where}.rng"), f"{where}.rng.torch", torch.get_rng_state().numel())
        if "cuda" in rng:
            _check_bytes(rng["cuda"], f"{where}.rng.cuda",
                         torch.cuda.get_rng_state().numel() if torch.cuda.is_available() else None)


class LoaderPosition(Component):
    """The loader's position beyond what the step tells (FaceLoader.state_dict: the records it skipped).
    On another number of processes rank 0's stands in for every rank's (the random streams start afresh)."""

    keys = ("loader",)
    per_rank = rank_0_stands_in = True

    def __init__(self, loader):
        self.loader = loader  # a FaceLoader, or a SavedPosition

    def state_dict(self) -> dict:
        return {"loader": dict(self.loader.state_dict())}

    def load_state_dict(self, saved: Mapping) -> None:
        if "loader" in saved:
            self.loader.load_state_dict(saved["loader"])

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        loader = json_object(field(section, "loader", where), f"{where}.loader")
        integer(field(loader, "skipped", f"{where}.loader"), f"{where}.loader.skipped", low=0)


class SavedPosition:
    """A loader position taken earlier (the converter's, read from another checkpoint), as a Stateful."""

    def __init__(self, position: Mapping):
        self.position = dict(position)

    def state_dict(self) -> dict:
        return self.position

    def load_state_dict(self, position: Mapping) -> None:
        self.position = dict(position)


# --- shared by the components and the foreign formats' importers ----------------------------------------

def centre_block(pfc: PartialFC, rows: torch.Tensor) -> torch.Tensor:
    """`rows` (this rank's, shaped like the centres) as a block of the (num_classes * K, ...) matrix (K
    sub-centres per class, class-major) at this rank's first class, for DCP. DTensor cannot say this: its
    uneven shards follow torch.chunk, not arcface_torch's split that PartialFC uses."""
    k = pfc.num_subcenters
    return row_block(rows, pfc.num_classes * k, pfc.class_start * k)


def optimizer_index(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> int:
    """The number optimizer.state_dict() gives `param` (parameters counted in group order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return next(i for i, p in enumerate(params) if p is param)


def is_centre_rows(value, rows: int, embedding_size: int) -> bool:
    """Whether an optimizer state entry is shaped like `rows` class centres (momentum, Adam's moments)."""
    return torch.is_tensor(value) and tuple(value.shape) == (rows, embedding_size)


def _check_python_rng(value, where: str) -> None:
    """random.getstate(): [version 3, 624 words and the position, the cached Gaussian or null]."""
    shape = (f"must be random.getstate()'s [3, {MT_WORDS} integers in [0, 2**32) and a position in "
             f"0..{MT_WORDS}, null or a number]")
    if not (isinstance(value, list) and len(value) == 3 and value[0] == 3 and isinstance(value[1], list)
            and len(value[1]) == MT_WORDS + 1 and _words(value[1][:MT_WORDS])
            and is_integer(value[1][MT_WORDS]) and 0 <= value[1][MT_WORDS] <= MT_WORDS
            and (value[2] is None or is_number(value[2]))):
        raise StateFieldError(where, shape)


def _check_numpy_rng(value, where: str) -> None:
    """numpy.random.get_state() without its "MT19937": [624 words, position, has_gauss, cached_gaussian]."""
    if not (isinstance(value, list) and len(value) == 4 and isinstance(value[0], list) and len(value[0]) == MT_WORDS
            and _words(value[0]) and is_integer(value[1]) and 0 <= value[1] <= MT_WORDS
            and value[2] in (0, 1) and is_integer(value[2]) and is_number(value[3])):
        raise StateFieldError(where, f"must be numpy's random state: [{MT_WORDS} integers in [0, 2**32), a position "
                                     f"in 0..{MT_WORDS}, 0 or 1, a number]")


def _check_bytes(value, where: str, length: int | None) -> None:
    """A torch generator's state: its bytes' values (`length` of them, where this torch says)."""
    if not (isinstance(value, list) and all(is_integer(byte) and 0 <= byte < 256 for byte in value)
            and (length is None or len(value) == length)):
        size = f"{length} " if length is not None else ""
        raise StateFieldError(where, f"must be a torch generator's state: a list of {size}byte values (0..255)")


def _words(values: list) -> bool:
    return all(is_integer(word) and 0 <= word < WORD for word in values)


def _byte_tensor(value) -> torch.Tensor:
    return value if torch.is_tensor(value) else torch.tensor(value, dtype=torch.uint8)


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
