"""What a backbone's forward and backward hold, traced on fake tensors: from the configuration alone,
without a GPU, in seconds for any network.

`backbone_memory` runs the backbone part of one training step as `training.step` does (the uint8
batch normalised, one forward under the step's autocast, the backward from the embeddings' gradient)
under torch's FakeTensorMode: every tensor has its shape, dtype and lifetime, none has memory, and an
operator costs only its shape arithmetic. `_LiveBytes`, a TorchDispatchMode, adds the bytes of every
storage an operator creates and takes them off when the storage is freed (a weak reference's
finalizer: freed when autograd or Python lets go of it, as on a device), keeping the peak. torch's own
MemTracker does this bookkeeping too, but updates every module's statistics at every operator: 37 s
for r100 where this takes about one.

Deep networks repeat one block hundreds of times (r2060: 1026 equal blocks, ~60 s of fake operators).
Blocks met twice or more in a Sequential or ModuleList with equal classes, settings and tensor shapes
are therefore traced once, alone (`_profile`), and every call of such a block replays what it
allocates (`_Replay`: its forward's peak, what it keeps for backward, its output; in backward its
peak, its parameters' gradients, its input's gradient) without its operators. The replay is an
autograd Function, so activation checkpointing around replayed blocks drops and recomputes what they
keep as it would their own tensors. Replayed blocks are taken out of the network (converting
their ~9000 tensors to fake ones alone would take seconds).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from backbones import get_model
from utils.image import IMAGE_SIZE, normalize


@dataclass(frozen=True)
class _Trace:
    """Bytes of one traced step of the backbone."""

    held: int         # alive when the forward ends, as the step's softmax starts
    released: int     # freed when the step's autocast ends: weight casts that no backward keeps
    live: list[int]   # alive after each allocation (where every peak is)


class BackboneMemory:
    """Bytes of one backbone in training: its tensors (float32), and one step's forward and backward at
    any batch size.

    Every tensor of a step is either as large for any batch (weights, their casts and gradients) or in
    proportion to it, and the operators are the same: so each amount alive during the step is
    `fixed + per_record * batch_size`, and two traces give them all. The peak is the largest of them,
    whose place in the step can move with the batch size. The first batch size asked for is traced; a
    second trace comes with the first question about another.
    """

    def __init__(self, parameters: int, trainable: int, buffers: int, trace: Callable[[int], _Trace]) -> None:
        self.parameters = parameters  # every parameter
        self.trainable = trainable    # the parameters that get a gradient (and optimizer state)
        self.buffers = buffers        # BatchNorm statistics and other buffers
        self._trace = trace
        self._traces: dict[int, _Trace] = {}
        self._peaks: tuple[tuple[int, int], ...] = ()

    def held(self, batch_size: int) -> int:
        """Left by the forward for the backward: activations, the normalised batch, the embeddings; and
        autocast's weight casts, until the step's autocast ends."""
        return self._amount(batch_size, "held")

    def released(self, batch_size: int) -> int:
        """Of `held`, freed when the step's autocast ends (casts that checkpointing did not keep)."""
        return self._amount(batch_size, "released")

    def peak(self, batch_size: int) -> int:
        """The forward's and backward's largest, parameter gradients included."""
        if batch_size in self._traced(batch_size):
            return max(self._traces[batch_size].live)
        if not self._peaks:
            (first, one), (_, other) = self._two_traces()
            if len(one.live) != len(other.live):
                raise RuntimeError(f"tracing at {first} and {first + 1} records allocated {len(one.live)} and "
                                   f"{len(other.live)} times: the network's operators depend on the batch size")
            self._peaks = _upper_front(_through(first, *amounts) for amounts in zip(one.live, other.live, strict=True))
        return max(fixed + per_record * batch_size for fixed, per_record in self._peaks)

    def _amount(self, batch_size: int, name: str) -> int:
        if batch_size in self._traced(batch_size):
            return getattr(self._traces[batch_size], name)
        (first, one), (_, other) = self._two_traces()
        fixed, per_record = _through(first, getattr(one, name), getattr(other, name))
        return fixed + per_record * batch_size

    def _traced(self, batch_size: int) -> dict[int, _Trace]:
        if not self._traces:
            self._traces[batch_size] = self._trace(batch_size)
        return self._traces

    def _two_traces(self) -> list[tuple[int, _Trace]]:
        """The first batch size traced and one record more."""
        first = next(iter(self._traces))
        if first + 1 not in self._traces:
            self._traces[first + 1] = self._trace(first + 1)
        return [(first, self._traces[first]), (first + 1, self._traces[first + 1])]


def backbone_memory(network: str, network_kwargs: dict, embedding_size: int, dropout: float,
                    precision: torch.dtype | None, num_views: int) -> BackboneMemory:
    """The backbone's bytes in a step of records of `num_views` images under autocast to `precision`
    (None: float32). Networks and their traces are kept for the process: asking again is free."""
    traced = _traced_network(network, tuple(sorted(network_kwargs.items())), embedding_size, dropout)
    return traced.memory(precision, num_views)


def inference_memory(network: str, network_kwargs: dict, embedding_size: int, dropout: float,
                     precision: torch.dtype | None) -> BackboneMemory:
    """The backbone's bytes in a forward without gradient of a batch of single images (SST's gallery network:
    training/semi_siamese.py), its normalised input included: its `peak(batch_size)` alone is meaningful."""
    traced = _traced_network(network, tuple(sorted(network_kwargs.items())), embedding_size, dropout)
    return traced.memory(precision, num_views=None)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


class _Count:
    """Bytes alive and their peak, of the storages created while this count was the innermost one."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.casts = 0  # of them, autocast's copies of parameters (cached until the autocast ends)
        self.after_each_allocation: list[int] = []  # live, where every peak is

    def allocated(self, nbytes: int, cast: bool) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.casts += nbytes if cast else 0
        self.after_each_allocation.append(self.live)

    def freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def restart_peak(self) -> int:
        """Start a new peak from what is alive now; returns that."""
        self.peak = self.live
        return self.live


class _LiveBytes(TorchDispatchMode):
    """Counts every storage an operator creates, once, until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[_Count] = []
        self._seen = WeakIdKeyDictionary()

    @contextlib.contextmanager
    def counting(self) -> Iterator[_Count]:
        """A new count for the storages created inside (a block profiled on its own is not the step's)."""
        count = _Count()
        self.counts.append(count)
        try:
            yield count
        finally:
            self.counts.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counts:
            # Views and in-place results share an input's storage: already counted, or not the step's (parameters).
            inputs = {id(tensor.untyped_storage()) for tensor in tree_leaves((args, kwargs))
                      if isinstance(tensor, torch.Tensor)}
            cast = func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter)
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in inputs:
                    self._add(tensor.untyped_storage(), cast)
        return out

    def blob(self, nbytes: int) -> torch.Tensor:
        """`nbytes` counted as allocated without an operator: a meta tensor, made outside every mode."""
        with _disable_current_modes():
            tensor = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        self._add(tensor.untyped_storage(), cast=False)
        return tensor

    def _add(self, storage: torch.UntypedStorage, cast: bool) -> None:
        if storage in self._seen:
            return
        count, nbytes = self.counts[-1], storage.nbytes()
        self._seen[storage] = True
        weakref.finalize(storage, count.freed, nbytes)
        count.allocated(nbytes, cast)


@dataclass(frozen=True)
class _BlockProfile:
    """What one call of a block allocates, in bytes, measured by tracing the block alone."""

    input_shape: torch.Size
    input_dtype: torch.dtype
    output_shape: torch.Size
    output_dtype: torch.dtype
    forward_peak: int   # above what was alive when its forward started
    kept: int           # left for its backward, its output aside
    casts: int          # of which autocast's copies of its parameters
    keeps_input: bool   # its backward needs the input itself, which then stays alive
    keeps_output: bool
    backward_peak: int  # above what was alive when its backward started
    gradients: int      # its parameters' gradients


class _Replay(torch.autograd.Function):
    """A block's allocations without its operators: its output and input gradient are fake tensors, the
    rest meta tensors counted as they are made (a fake tensor costs ~0.4 ms to make, a meta one ~0.01).
    Every size is one the block's own tensors had, none a difference that could fall below zero at
    another batch size: each amount alive stays in proportion to the batch (see BackboneMemory)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, profile: _BlockProfile, network: _TracedNetwork) -> torch.Tensor:
        live = network.live
        casts = live.blob(profile.casts)
        if not network.in_backward:
            # Autocast's cache holds its casts until the step's autocast ends, also where checkpointing drops
            # what the block keeps; a recomputation's own autocast ends before the block's backward.
            network.autocast_cache.append(casts)
        kept = live.blob(profile.kept - profile.casts)
        out = x.new_empty(profile.output_shape, dtype=profile.output_dtype)
        live.blob(profile.forward_peak - profile.kept - _nbytes(out))  # its transients on top, freed at once
        ctx.save_for_backward(kept, casts, x if profile.keeps_input else None, out if profile.keeps_output else None)
        ctx.profile, ctx.network = profile, network
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        ctx.saved_tensors  # unpacking them recomputes a checkpointed segment, as the block's own tensors would  # noqa: B018
        profile, network = ctx.profile, ctx.network
        network.live.blob(profile.backward_peak)  # its peak, freed at once
        network.gradients.append(network.live.blob(profile.gradients))
        return grad_output.new_empty(profile.input_shape, dtype=profile.input_dtype), None, None


def _signature(module: nn.Module) -> tuple:
    """Everything that decides what a module allocates: classes, settings and tensor shapes, all the way down."""
    return tuple(
        (type(sub).__qualname__,
         tuple(sorted((key, value) for key, value in vars(sub).items()
                      if isinstance(value, (bool, int, float, str)) or (isinstance(value, tuple) and all(
                          isinstance(item, (bool, int, float, str)) for item in value)))),
         tuple((name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
               for name, tensor in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]))
        for sub in module.modules())


def _repeated_blocks(model: nn.Module) -> dict[tuple[nn.Module, str], tuple]:
    """(container, name) of the children of Sequential and ModuleList containers whose signature occurs
    twice or more, outermost first: a block inside one of them runs only inside that block's profile."""
    containers = [module for module in model.modules() if isinstance(module, (nn.Sequential, nn.ModuleList))]
    signatures = {child: _signature(child) for container in containers for child in container.children()}
    occurrences = Counter(signatures.values())
    repeated: dict[tuple[nn.Module, str], tuple] = {}

    def visit(module: nn.Module) -> None:
        for name, child in module.named_children():
            if occurrences[signatures.get(child)] > 1:
                repeated[module, name] = signatures[child]
            else:
                visit(child)

    visit(model)
    return repeated


class _ReplayedBlock(nn.Module):
    """Stands in for a repeated block: no tensors of its own (so checkpointing's copies of BatchNorm
    statistics find none to copy), its calls replayed from its kind's profile."""

    def __init__(self, replay: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.replay = replay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.replay(x)


class _TracedNetwork:
    """One backbone built for tracing: repeated blocks replaced by stand-ins, the rest on fake tensors."""

    def __init__(self, network: str, network_kwargs: dict, embedding_size: int, dropout: float) -> None:
        with torch.device("meta"):
            self.model = get_model(network, num_features=embedding_size, dropout=dropout, **network_kwargs)
        self.model.train()
        self.parameters = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.trainable = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        self.buffers = sum(b.numel() * b.element_size() for b in self.model.buffers())
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)  # to_empty reads the meta tensors it replaces
        self.live = _LiveBytes()
        self.profiles: dict[tuple, _BlockProfile] = {}
        self.gradients: list[torch.Tensor] = []  # replayed blocks' parameter gradients, kept as autograd keeps .grad
        self.autocast_cache: list[torch.Tensor] = []  # replayed blocks' parameter casts
        self.in_backward = False
        self.memories: dict[tuple, BackboneMemory] = {}
        representatives: dict[tuple, nn.Module] = {}
        for (parent, name), signature in _repeated_blocks(self.model).items():
            first = representatives.setdefault(signature, getattr(parent, name))
            setattr(parent, name, _ReplayedBlock(functools.partial(self._replayed, first)))
        with self.fake:
            for module in [self.model, *representatives.values()]:
                module.to_empty(device="cpu")

    def memory(self, precision: torch.dtype | None, num_views: int | None) -> BackboneMemory:
        """A training step's on records of `num_views` images, or a forward without gradient's (None)."""
        key = (precision, num_views)
        if key not in self.memories:
            trace = (functools.partial(self._trace, precision, num_views=num_views) if num_views is not None
                     else functools.partial(self._trace_inference, precision))
            self.memories[key] = BackboneMemory(self.parameters, self.trainable, self.buffers, trace)
        return self.memories[key]

    def _trace_inference(self, precision: torch.dtype | None, batch_size: int) -> _Trace:
        autocast = (torch.autocast("cpu", dtype=precision) if precision is not None else contextlib.nullcontext())
        try:
            with self.fake, self.live, torch.no_grad():
                images = torch.empty((batch_size, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8)
                with self.live.counting() as count, autocast:
                    self.model(normalize(images))
                    return _Trace(0, 0, count.after_each_allocation)
        finally:
            self.autocast_cache.clear()

    def _trace(self, precision: torch.dtype | None, batch_size: int, num_views: int) -> _Trace:
        autocast = (torch.autocast("cpu", dtype=precision) if precision is not None else contextlib.nullcontext())
        try:
            with self.fake, self.live:
                images = torch.empty((batch_size, num_views, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8)
                with self.live.counting() as count:
                    # As training.step: the normalised batch and the embeddings stay referenced through backward.
                    flat = normalize(images).reshape(batch_size * num_views, 3, IMAGE_SIZE, IMAGE_SIZE)
                    with autocast:
                        embeddings = self.model(flat)
                        held = count.live  # the step's softmax starts inside its autocast, with the casts cached
                    self.autocast_cache.clear()
                    released = held - count.live
                    self.in_backward = True
                    embeddings.backward(torch.empty_like(embeddings))
                    return _Trace(held, released, count.after_each_allocation)
        finally:
            self.in_backward = False
            self.gradients.clear()
            self.autocast_cache.clear()
            for parameter in self.model.parameters():
                parameter.grad = None

    def _replayed(self, representative: nn.Module, x: torch.Tensor) -> torch.Tensor:
        key = (id(representative), tuple(x.shape), x.dtype, x.requires_grad, torch.is_grad_enabled(),
               torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        if key not in self.profiles:
            self.profiles[key] = self._profile(representative, x)
        return _Replay.apply(x, self.profiles[key], self)

    def _profile(self, block: nn.Module, like: torch.Tensor) -> _BlockProfile:
        """Trace `block` alone on an input like `like`, under the caller's autocast, and measure it."""
        saved = WeakIdKeyDictionary()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved[tensor.untyped_storage()] = True
            return tensor

        with self.live.counting() as count:
            x = torch.empty(like.shape, dtype=like.dtype, requires_grad=like.requires_grad)
            start = count.restart_peak()
            # These hooks replace a surrounding checkpoint's, which would drop what the block keeps.
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = type(block).forward(block, x)
            forward_peak, kept, casts = count.peak - start, count.live - start - _nbytes(out), count.casts
            keeps_input, keeps_output = x.untyped_storage() in saved, out.untyped_storage() in saved
            start = count.restart_peak()
            if out.requires_grad:  # not in a forward without gradient (SST's gallery)
                with torch.autocast("cpu", enabled=False):  # a step's backward runs outside its autocast
                    out.backward(torch.empty_like(out))
            gradients = sum(_nbytes(p.grad) for p in block.parameters() if p.grad is not None)
            for parameter in block.parameters():
                parameter.grad = None
            return _BlockProfile(like.shape, like.dtype, out.shape, out.dtype, forward_peak, kept, casts, keeps_input,
                                 keeps_output, count.peak - start, gradients)


def _through(batch: int, nbytes: int, more_nbytes: int) -> tuple[int, int]:
    """(fixed, per record) of the amount that is `nbytes` at `batch` records and `more_nbytes` at one more."""
    return nbytes - (more_nbytes - nbytes) * batch, more_nbytes - nbytes


def _upper_front(amounts: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The amounts that can be the largest at some batch size: none both smaller and growing slower."""
    front: list[tuple[int, int]] = []
    for fixed, per_record in sorted(set(amounts), key=lambda amount: (-amount[1], -amount[0])):
        if not front or fixed > front[-1][0]:
            front.append((fixed, per_record))
    return tuple(front)


@functools.lru_cache(maxsize=16)
def _traced_network(network: str, network_kwargs: tuple, embedding_size: int, dropout: float) -> _TracedNetwork:
    return _TracedNetwork(network, dict(network_kwargs), embedding_size, dropout)
