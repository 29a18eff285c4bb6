"""Semi-Siamese Training's classifier (Du et al., ECCV 2020): a FIFO queue of gallery features, sharded over
ranks as the class centres are, against which each view's probe features are classified.

A record's two views are two photos of one identity. The probe network (the trained backbone) embeds both, and
so does the gallery network (its momentum copy, without gradient: training/semi_siamese.py). One forward:

1. the step's slots are the next N (the global batch) from the pointer, modulo the queue size: sample j of the
   global batch, ordered (rank, sample), owns slot ``(pointer + j) % queue_size``, and that slot is its target;
2. view v's probes are scored against the queue whose step slots hold the *other* view's gallery features
   (SST's swap: view 1's probe against view 2's gallery, and symmetrically), every other slot a negative;
3. through partial_fc.py's sharded margin softmax, under any margin family: exact gradients to the probes,
   none to the queue; the loss is ``sum_v w_v * CE_v``, each CE the mean over the global batch;
4. the gallery features wait (``pending``) until the optimizer step is taken (``commit``): then they are enqueued
   over the oldest slots and the pointer moves on, one view's N features, the view drawn at random each step
   (``enqueue="one"``, FaceX-Zoo's SST_Prototype), or both views' (2N slots, view 1's at the step's slots, view 2's
   after them: ``enqueue="both"``). A skipped step (non-finite loss) ``discard``s them: a NaN never enters the
   queue, where every later step would read it. With several micro-batches per step, each takes the slots after
   those of the micro-batches before it, all scored against the queue as the step found it.

This is FaceX-Zoo's head where its queue size is a multiple of the global batch (its slots never wrap) and every
step is taken; here slots may wrap. Each rank holds slots ``class_range(queue_size, rank, world)``; the initial
queue is seeded random unit vectors, the same matrix on any number of processes. The view each step enqueues is
drawn from the seed and the step's number alone, so every rank draws the same one without a collective.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from losses import GlobalRows, MarginFamily
from partial_fc import (
    NORM_EPS,
    all_gather_rows,
    class_range,
    initial_centres,
    load_margin_state,
    sharded_margin_softmax,
)
from utils.distributed import rank, world
from utils.errors import ConfigError

ENQUEUE = ("one", "both")
DRAW_SEED = 7_919  # keeps the enqueue draws apart from the initial queue's stream of the same seed


class PrototypeQueue(nn.Module):
    """The queue of ``queue_size`` gallery features of ``embedding_size``, this rank's slots in ``queue``.

    ``pointer``: the next slot to write; ``step``: commits so far (the enqueue draws' position);
    ``margin_state``/``margin_step``: the margin family's state, as PartialFC keeps it for the centres (a stateful
    family updates it at each view's scoring). ``view_weights`` (default equal, summing to 1) weight the views."""

    def __init__(self, margin_loss: MarginFamily, embedding_size: int, queue_size: int, seed: int = 0,
                 view_weights: Sequence[float] | None = None, enqueue: Literal["one", "both"] = "one",
                 compile_margin_softmax: bool = False):
        super().__init__()
        if enqueue not in ENQUEUE:
            raise ValueError(f"enqueue={enqueue!r} must be one of {ENQUEUE}")
        self.margin_loss, self.embedding_size, self.queue_size = margin_loss, embedding_size, queue_size
        self.seed, self.enqueue, self.compile_margin_softmax = seed, enqueue, compile_margin_softmax
        self.view_weights = (0.5, 0.5) if view_weights is None else tuple(float(w) for w in view_weights)
        self.world_size = world()
        self.slot_start, self.num_local = class_range(queue_size, rank(), self.world_size)
        queue = initial_centres(seed, self.slot_start, self.num_local, embedding_size)
        self.register_buffer("queue", nn.functional.normalize(queue, dim=1, eps=NORM_EPS), persistent=False)
        self.register_buffer("margin_state", torch.tensor(margin_loss.initial_state(), dtype=torch.float32),
                             persistent=False)
        self.pointer = self.step = self.margin_step = 0
        self.pending: list[list[torch.Tensor]] = []  # each forward's features to enqueue, until commit or discard

    def extra_repr(self) -> str:
        return (f"queue_size={self.queue_size}, local={self.slot_start}..{self.slot_start + self.num_local - 1}, "
                f"embedding_size={self.embedding_size}, enqueue={self.enqueue}")

    def slots_per_step(self, batch: int) -> int:
        """Slots a step of `batch` records per rank overwrites."""
        return batch * self.world_size * (2 if self.enqueue == "both" else 1)

    def forward(self, probes: Sequence[torch.Tensor],
                galleries: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, each view's mean cross-entropy (2,), detached) of this rank's probes (B, D) of both views against
        the queue, given both views' gallery features of the whole global batch (N, D), ordered (rank, sample) and
        the same on every rank, which wait in ``pending`` for the step's ``commit``. Collective."""
        if len(probes) != 2 or len(galleries) != 2:
            raise ValueError(f"semi-siamese training takes two views, not {len(probes)} probes and "
                             f"{len(galleries)} galleries")
        batch = probes[0].shape[0]
        n = batch * self.world_size
        written = self.slots_per_step(batch) * (len(self.pending) + 1)
        if written > self.queue_size:
            raise ConfigError(f"config key 'sst_queue_size' ({self.queue_size}) is smaller than the {written} gallery "
                              "features a step enqueues (all its micro-batches'); raise it to at least that (a "
                              "multiple of it keeps FaceX-Zoo's layout)")
        dtype = torch.promote_types(torch.promote_types(torch.float32, probes[0].dtype), self.queue.dtype)
        device = self.queue.device
        local = torch.stack(list(probes)).to(dtype)  # (2, B, D): one gather for both views
        gathered = all_gather_rows(nn.functional.normalize(local, dim=-1, eps=NORM_EPS).reshape(-1, local.shape[-1]))
        gathered = gathered.view(self.world_size, 2, batch, -1)
        gallery = [nn.functional.normalize(g.detach().to(dtype), dim=-1, eps=NORM_EPS) for g in galleries]
        first = self.pointer + self.slots_per_step(batch) * len(self.pending)
        samples, columns = self._local_slots(first, n, device)
        labels = torch.full((n,), -1, dtype=torch.long, device=device).index_copy_(0, samples, columns)
        norms = None
        if self.margin_loss.reads_norms:
            with torch.no_grad():
                norms = all_gather_rows(local.norm(dim=-1).reshape(-1)).view(self.world_size, 2, batch)
        loss = torch.zeros((), dtype=dtype, device=device)
        per_view = []
        for view, weight in enumerate(self.view_weights):
            keys = self.queue.to(dtype).clone().index_copy_(0, columns, gallery[1 - view][samples])
            rows = GlobalRows(self.world_size, 1, batch, None if norms is None else norms[:, view].reshape(-1),
                              self.seed, self.margin_step)
            coef = torch.full((n,), weight / n, dtype=dtype, device=device)
            view_loss, row_losses = sharded_margin_softmax(
                gathered[:, view].reshape(n, -1), keys, labels, coef, self.margin_loss, self.margin_state, rows,
                self.compile_margin_softmax)
            self.margin_step += 1
            loss = loss + view_loss
            per_view.append(row_losses.mean())
        self.pending.append(gallery)
        return loss, torch.stack(per_view).detach()

    def _local_slots(self, first: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(which of `count` global-batch samples, their columns here) for the slots first .. first + count - 1,
        modulo the queue size, that this rank holds. Computed on the host: the pointer is a Python number."""
        slots = (first + torch.arange(count)) % self.queue_size - self.slot_start
        mine = (slots >= 0) & (slots < self.num_local)
        return torch.nonzero(mine).view(-1).to(device), slots[mine].to(device)

    def commit(self) -> None:
        """The step was taken: its gallery features over the oldest slots, each forward's in turn, one view's
        (drawn as FaceX-Zoo draws it: view 1 on heads) or both views', and the pointer past them."""
        generator = torch.Generator().manual_seed(self.seed * DRAW_SEED + self.step)
        with torch.no_grad():
            for gallery in self.pending:
                heads = torch.rand((), generator=generator).item() > 0.5
                for features in gallery if self.enqueue == "both" else [gallery[0] if heads else gallery[1]]:
                    samples, columns = self._local_slots(self.pointer, features.shape[0], self.queue.device)
                    self.queue.index_copy_(0, columns, features[samples].to(self.queue.dtype))
                    self.pointer = (self.pointer + features.shape[0]) % self.queue_size
        self.pending.clear()
        self.step += 1

    def discard(self) -> None:
        """Forget the features of a step that was not taken."""
        self.pending.clear()

    def position_dict(self) -> dict:
        """The pointer, the draws' position and the margin family's state as plain numbers (exact)."""
        return {"pointer": self.pointer, "step": self.step, "margin_state": self.margin_state.tolist(),
                "margin_step": self.margin_step}

    def load_position_dict(self, saved: dict) -> None:
        """Put back what position_dict returned, bit for bit."""
        load_margin_state(self.margin_state, saved["margin_state"], self.margin_loss)
        self.pointer, self.step, self.margin_step = int(saved["pointer"]), int(saved["step"]), int(saved["margin_step"])
