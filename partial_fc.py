"""Partial FC: the class-sharded, sampled margin softmax, for V views of every sample.

Each rank holds a contiguous range of class centres. One forward:

1. all-gather the labels and check them (every rank raises the same error before any embedding
   collective, so a bad label never hangs the job);
2. sample this rank's centres once (every positive class of the step + random negatives) and use
   that one subset for all V views; a rate that leaves no room for negatives (``sample_rate = 0``, as
   in arcface_torch's PartialFC_V2) keeps exactly the positive classes of the step;
3. all-gather the L2-normalised embeddings of all views (autograd-aware: its backward is a
   reduce-scatter, so every view's embeddings receive exactly their own gradient);
4. one fused, memory-lean sharded softmax cross-entropy over all views at once
   (``_ShardedMarginSoftmax``): the backward's GEMMs in the caller's autocast precision
   (float16/bfloat16); the cosines' GEMM gives float32 (half-precision inputs only where the device
   has a GEMM that writes its float32 accumulator), and the softmax is always float32;
5. return ``sum_v w_v * CE_v`` (the same scalar on every rank, with an ordinary backward) and
   each view's mean cross-entropy.

The centres' gradient is zero outside the sampled rows. By default it is a dense (C, D) tensor, what any
optimizer takes; with ``sparse_grad=True`` (as ``nn.Embedding(sparse=True)``) it is a sparse COO tensor
holding the sampled rows alone, so that no step writes or reads C x D zeros: an optimizer that knows such
gradients (training/optimizer.py) then updates every row in one pass with the dense semantics.

The centres are initialised here, from a seed alone: the same matrix for any world size, and each
rank draws only the rows it holds.

Margin families (losses.py) plug into step 4: the sharded softmax binds the family once per forward to
its state (``margin_state``, a buffer of EMAs replicated on every rank, updated from global-batch
statistics), to the rows' feature norms (gathered before normalisation, detached, for AdaFace) and to
every row's target cosine (one all-reduce of N values, for the families that read it). Sub-center
ArcFace keeps ``num_subcenters`` (K) rows per class, class c's as rows c*K .. c*K + K - 1, all on the
rank holding c; a class's cosine is the largest of its K, and sampling picks classes (all K come along).

Host syncs: a forward and backward make the host wait for the device only where a shape or a
Python decision depends on the data. Constants are made on the device, targets are read and written
with gather/scatter over all rows (``losses.read_targets``/``write_targets``) rather than through
``nonzero`` or boolean masks, and positives are marked by ``index_fill_`` rather than ``unique``.
What remains, and why:

- with sampling, when the global batch's labels could outnumber ``int(sample_rate * num_local)``
  (always for ``sample_rate = 0``): the number of distinct positive classes here, one scalar read,
  since it is the number of sampled columns, the shape of every tensor after it;
- without ``defer_label_check`` (the CPU default): whether any label is out of range, a scalar read
  that decides whether to raise. GPU training defers the check to a non-finite loss instead.

Passes over the logits: between the cosines' GEMM and the collectives, the softmax makes three passes over
the (N, C) buffer that hold no margin family's code (``_SoftmaxPasses``): the logits and their row maxima,
the exponentials and their row sums, the logits' gradient. Eager, each is several memory passes (one per
torch operation); with ``compile_margin_softmax=True`` each is compiled by torch.compile, and inductor
fuses it into one kernel (Triton on a GPU, C++ on a CPU), the collectives and the families' code staying
eager between them.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from losses import GlobalRows, MarginFamily, read_targets, write_targets
from utils.compat import all_gather_into, matmul_float32_result, reduce_scatter_into
from utils.distributed import is_initialized, rank, world
from utils.errors import ConfigError, DataError

NORM_EPS = 1e-12  # F.normalize's default; rows shorter than this are divided by it instead
COLUMN_CHUNK_ELEMENTS = 1 << 24  # bounds the (N, chunk) temporaries of the softmax passes
INIT_STD = 0.01  # arcface_torch's centre initialisation: normal(0, 0.01)
INIT_BLOCK_ROWS = 1 << 14  # centres are drawn in blocks of this many rows, each from its own seeded stream


def class_range(num_classes: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first class id, count) held by ``rank``: contiguous ranges, the first ranks one larger."""
    base, extra = divmod(num_classes, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def initial_centres(seed: int, start: int, count: int, embedding_size: int) -> torch.Tensor:
    """Rows ``start .. start + count - 1`` of the seeded initial centre matrix, whatever its height.

    Row r lies in block ``r // INIT_BLOCK_ROWS``, drawn from a generator seeded by (seed, block):
    a rank draws only the blocks its rows touch (memory O(C / W + block)), and the rows equal those
    of a single-process draw of the whole matrix.
    """
    rows = torch.empty(count, embedding_size)
    first_block, end_block = start // INIT_BLOCK_ROWS, -(-(start + count) // INIT_BLOCK_ROWS)
    for block in range(first_block, end_block):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + block)
        drawn = torch.normal(0.0, INIT_STD, (INIT_BLOCK_ROWS, embedding_size), generator=generator)
        low, high = max(start, block * INIT_BLOCK_ROWS), min(start + count, (block + 1) * INIT_BLOCK_ROWS)
        rows[low - start:high - start] = drawn[low - block * INIT_BLOCK_ROWS:high - block * INIT_BLOCK_ROWS]
    return rows


class PartialFC(nn.Module):
    """Sharded margin softmax over ``num_classes`` centres for one or several embedding views.

    ``view_weights`` (default: equal, summing to 1) weight each view's mean cross-entropy, so a
    single-view learning rate carries over to V views. ``seed`` fixes the initial centres (the
    same matrix on any number of processes). ``sample_rate`` in [0, 1]: the share of this rank's
    centres each forward uses, every positive class of the step always among them (0: only those).

    A label outside ``[0, num_classes)`` raises a DataError on every rank before any collective on
    embeddings. Checking costs the host a wait for the device, so a GPU training loop may pass
    ``defer_label_check=True``: a bad label then makes the loss NaN instead (nothing waits), and
    ``check_labels(labels)`` raises its error once the loop sees the non-finite loss.

    ``sparse_grad=True``: when sampling, ``weight.grad`` is a sparse COO tensor of the sampled rows (the
    only non-zero ones) instead of a dense matrix of zeros elsewhere; torch's own optimizers mostly refuse
    such gradients (training/optimizer.py's take them).

    ``compile_margin_softmax=True``: the softmax's passes over the logits compiled by torch.compile (module
    docstring); the same results up to float rounding, the first forwards slower while inductor compiles
    (kept in its cache, TORCHINDUCTOR_CACHE_DIR).
    """

    def __init__(self, margin_loss: MarginFamily, embedding_size: int, num_classes: int,
                 sample_rate: float = 1.0, view_weights: Sequence[float] | None = None, seed: int = 0,
                 defer_label_check: bool = False, num_subcenters: int = 1, sparse_grad: bool = False,
                 compile_margin_softmax: bool = False):
        super().__init__()
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate={sample_rate} must lie in [0, 1] (1.0 uses every class centre, 0 only "
                             "the positive classes of each step)")
        self.margin_loss = margin_loss
        self.embedding_size = embedding_size
        self.num_classes = num_classes
        self.sample_rate = sample_rate
        self.view_weights = None if view_weights is None else tuple(float(w) for w in view_weights)
        self.defer_label_check = defer_label_check
        self.sparse_grad = sparse_grad
        self.compile_margin_softmax = compile_margin_softmax
        self.rank, self.world_size = rank(), world()
        if num_classes < self.world_size:
            raise ConfigError(f"num_classes={num_classes} is smaller than the {self.world_size} processes; every "
                              "rank needs at least one class centre: use fewer processes")
        if num_subcenters < 1:
            raise ValueError(f"num_subcenters={num_subcenters} must be at least 1 (1: one centre per class)")
        self.num_subcenters = num_subcenters
        self.class_start, self.num_local = class_range(num_classes, self.rank, self.world_size)
        k = num_subcenters
        self.weight = nn.Parameter(initial_centres(seed, self.class_start * k, self.num_local * k, embedding_size))
        self.seed = seed
        # The family's state, the same on every rank (float32, as the authors keep it); training state: saved
        # with each checkpoint (margin_state_dict), not in state_dict(), which holds the centres alone.
        self.register_buffer("margin_state", torch.tensor(margin_loss.initial_state(), dtype=torch.float32),
                             persistent=False)
        self.margin_step = 0  # forwards run so far: the position of ElasticFace's draws
        # Which global classes the last forward used (None: all of this rank's), for checks and tests.
        self.last_sampled_classes: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, local={self.class_start}..{self.class_start + self.num_local - 1}, "
                f"embedding_size={self.embedding_size}, sample_rate={self.sample_rate}"
                + (f", num_subcenters={self.num_subcenters}" if self.num_subcenters > 1 else ""))

    def margin_state_dict(self) -> dict:
        """The margin family's state as plain numbers (exact: float32 values are exact as Python floats)."""
        return {"state": self.margin_state.tolist(), "step": self.margin_step}

    def load_margin_state_dict(self, saved: dict) -> None:
        """Put back what margin_state_dict returned, bit for bit."""
        load_margin_state(self.margin_state, saved["state"], self.margin_loss)
        self.margin_step = int(saved["step"])

    def forward(self, embeddings: torch.Tensor | Sequence[torch.Tensor],
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, per-view mean cross-entropy (V,), detached) for the global batch of all ranks."""
        views = [embeddings] if isinstance(embeddings, torch.Tensor) else list(embeddings)
        weights = self._view_weights(len(views))
        self._check_shapes(views, labels)

        global_labels = _all_gather_labels(labels.reshape(-1).long().to(self.weight.device))
        if self.defer_label_check:
            bad_label = ((global_labels < 0) | (global_labels >= self.num_classes)).any()
        else:
            self._raise_for_bad_labels(global_labels)

        local_labels = global_labels - self.class_start
        local_labels = torch.where((local_labels >= 0) & (local_labels < self.num_local), local_labels, -1)
        index, local_labels = self._sample(local_labels)
        self.last_sampled_classes = None if index is None else (index + self.class_start).detach()
        rows_index = index if index is None or self.num_subcenters == 1 else _subcentre_rows(index, self.num_subcenters)

        dtype = torch.promote_types(torch.promote_types(torch.float32, views[0].dtype), self.weight.dtype)
        local = torch.stack(views).to(dtype)  # (V, B, D): one gather and one GEMM for all views
        normalized = nn.functional.normalize(local, dim=-1, eps=NORM_EPS)
        gathered = all_gather_rows(normalized.reshape(-1, self.embedding_size))

        num_views, batch = len(views), labels.numel()
        norms = None
        if self.margin_loss.reads_norms:
            with torch.no_grad():  # the norms set margins; no gradient flows through them (AdaFace)
                norms = all_gather_rows(local.norm(dim=-1).reshape(-1))
        rows = GlobalRows(self.world_size, num_views, batch, norms, self.seed, self.margin_step)
        global_batch = batch * self.world_size
        # gathered rows are ordered (rank, view, sample): repeat labels and view weights to match
        row_labels = local_labels.view(self.world_size, 1, batch).expand(-1, num_views, -1).reshape(-1)
        # filled on the device: a tensor made from the Python list would be a blocking host-to-device copy
        row_coef = torch.cat([torch.full((batch,), weight / global_batch, dtype=dtype, device=gathered.device)
                              for weight in weights]).repeat(self.world_size)

        loss, row_losses = sharded_margin_softmax(
            gathered, self.weight, row_labels, row_coef, self.margin_loss, self.margin_state, rows,
            self.compile_margin_softmax, rows_index, self.num_subcenters, self.sparse_grad)
        self.margin_step += 1
        if self.defer_label_check:
            loss = torch.where(bad_label, torch.nan, loss)
        return loss, row_losses.view(self.world_size, num_views, batch).mean(dim=(0, 2)).detach()

    def check_labels(self, labels: torch.Tensor) -> None:
        """Raise the DataError of a label outside [0, num_classes) on any rank. Collective."""
        self._raise_for_bad_labels(_all_gather_labels(labels.reshape(-1).long().to(self.weight.device)))

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole (num_classes, ...) matrix."""
        return full[self.class_start:self.class_start + self.num_local]

    def _view_weights(self, num_views: int) -> tuple[float, ...]:
        if self.view_weights is None:
            return (1.0 / num_views,) * num_views
        if len(self.view_weights) != num_views:
            raise ValueError(f"view_weights has {len(self.view_weights)} entries but {num_views} views were given")
        return self.view_weights

    def _check_shapes(self, views: list[torch.Tensor], labels: torch.Tensor) -> None:
        for v, emb in enumerate(views):
            if emb.dim() != 2 or emb.shape[1] != self.embedding_size or emb.shape[0] != labels.numel():
                raise ValueError(f"view {v} embeddings have shape {tuple(emb.shape)}, expected "
                                 f"({labels.numel()}, {self.embedding_size}) to match the labels and embedding_size")

    def _raise_for_bad_labels(self, global_labels: torch.Tensor) -> None:
        bad = (global_labels < 0) | (global_labels >= self.num_classes)
        if bool(bad.any()):
            position = int(torch.nonzero(bad)[0])
            batch = global_labels.numel() // self.world_size
            raise DataError(
                f"label {int(global_labels[position])} (sample {position % batch} on rank {position // batch}) "
                f"is outside [0, {self.num_classes}): set num_classes to more than the largest label "
                "in the data, or fix the dataset's labels")

    def _sample(self, local_labels: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Pick this rank's centres for the step: all positives plus random negatives, int(sample_rate *
        num_local) in all, or only the positives when they are more (arcface_torch's PartialFC_V2).

        Returns (sorted local indices or None for all, labels re-indexed into that subset).
        """
        num_sample = int(self.sample_rate * self.num_local)
        if num_sample >= self.num_local:
            return None, local_labels
        has_target = local_labels >= 0
        # The positives marked in a mask with one spare slot, where the labels held by other ranks point.
        slots = torch.where(has_target, local_labels, self.num_local)
        positive = torch.zeros(self.num_local + 1, dtype=torch.bool, device=slots.device).index_fill_(0, slots, True)
        scores = torch.rand(self.num_local, device=slots.device).masked_fill_(positive[:-1], 2.0)  # kept first
        # The step's labels are at most that many positives: with room for all of them, no need to count.
        room = num_sample >= local_labels.numel()
        index = torch.topk(scores, k=num_sample if room else max(num_sample, int(positive[:-1].sum())))[1].sort()[0]
        return index, torch.where(has_target, torch.searchsorted(index, local_labels.clamp_min(0)), -1)


def load_margin_state(state: torch.Tensor, saved: list[float], family: MarginFamily) -> None:
    """A margin family's saved state (plain numbers, exact) into its buffer, in place."""
    values = torch.tensor(saved, dtype=state.dtype)
    if values.shape != state.shape:
        raise ValueError(f"the saved margin state has {values.numel()} values where {family!r} keeps "
                         f"{state.numel()}")
    state.copy_(values)


def sharded_margin_softmax(gathered: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           row_coef: torch.Tensor, family: MarginFamily, margin_state: torch.Tensor,
                           rows: GlobalRows, compiled: bool, index: torch.Tensor | None = None, k: int = 1,
                           sparse_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of row_coef * row loss over every rank's rows, the row losses) of the margin softmax of the global
    batch's normalised rows `gathered` against this rank's `weight` rows (`index` of them when sampling), the
    softmax in float32 or wider whatever the autocast: PartialFC's classifier, and any other whose columns are
    sharded over ranks (prototype_queue.py's). Labels are local column numbers, -1 where the target is not here."""
    device_type = gathered.device.type
    gemm_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    with torch.autocast(device_type, enabled=False):
        return _ShardedMarginSoftmax.apply(gathered, weight, index, labels, row_coef, family, gemm_dtype, margin_state,
                                           rows, k, sparse_grad, _compiled_passes() if compiled else _EAGER_PASSES)


def all_gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, in rank order; the backward gives each rank the gradient of its own rows (times the
    world size, for DDP: _AllGatherRows)."""
    return _AllGatherRows.apply(rows)


def _subcentre_rows(classes: torch.Tensor, k: int) -> torch.Tensor:
    """The weight rows of local classes, K per class, in class order."""
    return (classes[:, None] * k + torch.arange(k, device=classes.device)).reshape(-1)


def _all_gather_labels(labels: torch.Tensor) -> torch.Tensor:
    if not is_initialized():
        return labels.clone()
    out = labels.new_empty(labels.numel() * world())
    all_gather_into(out, labels.contiguous())
    return out


class _AllGatherRows(torch.autograd.Function):
    """All-gather rows along dim 0; backward sums every rank's gradient for our rows.

    The summed gradient is then multiplied by the world size. Why: the loss is global, so the exact
    gradient for the backbone is the *sum* over ranks of each rank's backbone gradient, but
    DistributedDataParallel *averages* gradients over ranks. Scaling here makes DDP's average equal
    that sum, so the backbone receives exactly the gradient of the global loss.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor) -> torch.Tensor:
        if not is_initialized():
            return rows.clone()
        out = rows.new_empty((rows.shape[0] * world(), *rows.shape[1:]))
        all_gather_into(out, rows.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if not is_initialized():
            return grad
        world_size = world()
        mine = grad.new_empty((grad.shape[0] // world_size, *grad.shape[1:]))
        reduce_scatter_into(mine, grad.contiguous())
        return mine.mul_(world_size)


class _ShardedMarginSoftmax(torch.autograd.Function):
    """Loss and per-row losses of the margin softmax over all ranks' class shards.

    Inputs: normalised embeddings X (N, D) of the whole global batch (all views), this rank's
    centres W (C*K, D) (rows ``index`` of it when sampling), local labels (N,) (-1: target not
    here), per-row loss weights (N,), the margin family with its state and what it reads of the rows,
    and K sub-centres per class (the (N, C*K) cosines are reduced to (N, C) by their max; the backward
    sends each class's gradient to the sub-centre that gave it).

    CurricularFace modulates non-target cosines: their derivative, needed once the softmax is known,
    is kept in a second (N, C) buffer.

    Memory: the gradient of a cross-entropy is known once the softmax is, so the forward turns a
    single (N, C) buffer from cosines into logits, softmax and finally the logits' gradient, in
    place; the backward needs only that buffer. Centres are never normalised as a (C, D) copy:
    cos = (X W^T) / |w_c|, and the normalisation's backward is the per-row projection
    ``dW_c = M_c - (M_c . w_c) w_c / |w_c|^2`` with ``M = (G / |w|)^T X``.
    """

    @staticmethod
    def forward(ctx, x, weight, index, labels, row_coef, family: MarginFamily, gemm_dtype, margin_state,
                rows: GlobalRows, k: int, sparse_grad: bool, passes: _SoftmaxPasses):
        dtype = x.dtype
        centres = weight if index is None else weight.index_select(0, index)
        centres = centres.to(dtype)
        norms = centres.norm(dim=1)
        inv_norm = 1.0 / norms.clamp_min(NORM_EPS)

        # (N, C), becomes cos, logits, softmax, grad; never rounded to half precision, even under autocast
        logits = x @ centres.t() if gemm_dtype is None else matmul_float32_result(x, centres.t(), gemm_dtype)
        best = None
        column_scale = inv_norm  # what the logits are yet to be multiplied by to be cosines (None: they are)
        if k > 1:
            logits.mul_(inv_norm)
            values, best = logits.view(logits.shape[0], -1, k).max(dim=2)
            logits, best, column_scale = values, best.to(torch.uint8), None
        # the targets' cosines from the GEMM's output: the same products as reading them from the cosines
        target_cos = read_targets(logits, labels)
        if column_scale is not None:
            target_cos *= read_targets(column_scale.expand_as(logits), labels)
        margin = family.bind(margin_state, rows, _summed(target_cos) if family.reads_target_cos else None)
        if column_scale is not None and (margin.interclass_filtering_threshold > 0 or margin.modulates_negatives):
            logits.mul_(column_scale)  # these margins read every cosine
            column_scale = None
        dirty = None
        if margin.interclass_filtering_threshold > 0:
            dirty = margin.filtered(logits, labels)
            logits.masked_fill_(dirty, 0.0)
        with torch.enable_grad():
            cos_leaf = target_cos.detach().requires_grad_(True)
            target_logit = margin.target_logit(cos_leaf)
            (target_slope,) = torch.autograd.grad(target_logit.sum(), cos_leaf)
        target_logit = torch.where(labels >= 0, target_logit.detach(), 0.0)  # 0: target not among these columns
        slope = None
        if margin.modulates_negatives:
            slope = torch.empty_like(logits)
            for chunk, slope_chunk in zip(_column_chunks(logits), _column_chunks(slope)):
                margin.modulate(chunk, slope_chunk)
        if logits.shape[1]:
            row_max = passes.logits_and_max(logits, column_scale, margin.s, labels, target_logit)
        else:
            row_max = torch.full_like(row_coef, -torch.inf)
        _all_reduce(row_max, dist.ReduceOp.MAX)
        # one all-reduce carries both the exp-sums and the target logits (zero where not ours)
        stats = torch.zeros((2, logits.shape[0]), dtype=dtype, device=logits.device)
        for chunk in _column_chunks(logits) if passes.chunked else (logits,):
            stats[0] += passes.exp_and_sum(chunk, row_max)
        stats[1] = target_logit
        _all_reduce(stats, dist.ReduceOp.SUM)
        sum_exp, global_target_logit = stats
        row_losses = sum_exp.log() + row_max - global_target_logit
        loss = (row_losses * row_coef).sum()

        # d loss / d cos: coef * s * softmax off-target, coef * slope * (p - 1) on the target
        target_prob = read_targets(logits, labels) / sum_exp
        if logits.shape[1]:
            passes.gradient(logits, labels, row_coef * margin.s / sum_exp,
                            row_coef * target_slope * (target_prob - 1.0), slope, dirty)

        ctx.save_for_backward(x, weight, centres, index, inv_norm, norms, logits, best)
        ctx.gemm_dtype, ctx.k, ctx.sparse_grad = gemm_dtype, k, sparse_grad
        ctx.consumed = False
        ctx.mark_non_differentiable(row_losses)
        return loss, row_losses

    @staticmethod
    def backward(ctx, grad_loss, _grad_row_losses):
        if ctx.consumed:
            raise RuntimeError("PartialFC's loss can be back-propagated once per forward (its gradient "
                               "buffer is consumed in place): run the forward again instead of retain_graph")
        ctx.consumed = True
        x, weight, centres, index, inv_norm, norms, grad_cos, best = ctx.saved_tensors
        if best is not None:
            grad_cos = _to_subcentres(grad_cos, best, ctx.k)
        grad_x, grad_centres = _backward_gemms(grad_cos, grad_loss, x, centres, inv_norm, ctx.gemm_dtype,
                                               ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        grad_weight = None
        if ctx.needs_input_grad[1]:
            along = torch.bmm(grad_centres.unsqueeze(1), centres.unsqueeze(2)).view(-1)
            # rows clamped to NORM_EPS were divided by a constant: no projection term there
            along.mul_(torch.where(norms > NORM_EPS, inv_norm * inv_norm, 0.0))
            grad_centres.addcmul_(centres, along[:, None], value=-1.0)
            grad_centres = grad_centres.to(weight.dtype)
            if index is None:
                grad_weight = grad_centres
            elif ctx.sparse_grad:  # the sampled rows alone; sorted and distinct, so already coalesced
                grad_weight = torch.sparse_coo_tensor(index[None], grad_centres, weight.shape, is_coalesced=True,
                                                      check_invariants=False)
            else:
                grad_weight = torch.zeros_like(weight).index_copy_(0, index, grad_centres)
        return grad_x, grad_weight, None, None, None, None, None, None, None, None, None, None


def _logits_and_max(logits: torch.Tensor, column_scale: torch.Tensor | None, s: float, labels: torch.Tensor,
                    target_logit: torch.Tensor) -> torch.Tensor:
    """In place, cosines (or the GEMM's output times ``column_scale``) -> logits: ``s * cos``, the margin's
    ``target_logit`` at each row's target; returns each row's maximum."""
    if column_scale is not None:
        logits.mul_(column_scale)
    logits.mul_(s)
    _put_targets(logits, labels, target_logit)
    return logits.max(dim=1).values


def _exp_and_sum(chunk: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """In place, logits -> ``exp(logit - row max)``; returns their row sums."""
    return chunk.sub_(row_max[:, None]).exp_().sum(dim=1)


def _logit_gradient(logits: torch.Tensor, labels: torch.Tensor, row_scale: torch.Tensor, target_grad: torch.Tensor,
                    slope: torch.Tensor | None, dirty: torch.Tensor | None) -> None:
    """In place, exponentials -> the logits' gradient (times d logit / d cos): ``row_scale`` times them (times the
    margin's ``slope`` where it modulates negatives), ``target_grad`` at each row's target, 0 where ``dirty``."""
    logits.mul_(row_scale[:, None])
    if slope is not None:
        logits.mul_(slope)
    _put_targets(logits, labels, target_grad)
    if dirty is not None:
        logits.masked_fill_(dirty, 0.0)


def _put_targets(matrix: torch.Tensor, labels: torch.Tensor, values: torch.Tensor) -> None:
    """``write_targets``, which torch.compile gets as a comparison with the column ids: inductor fuses that
    into the pass, where a scatter would make it copy the whole (N, C) matrix first."""
    if torch.compiler.is_compiling():
        is_target = torch.arange(matrix.shape[1], device=matrix.device) == labels[:, None]
        matrix.copy_(torch.where(is_target, values[:, None], matrix))
    else:
        write_targets(matrix, labels, values)


class _SoftmaxPasses(NamedTuple):
    """The softmax's passes over the (N, C) logits, between the collectives: eager or compiled."""

    logits_and_max: Callable
    exp_and_sum: Callable
    gradient: Callable
    # exp_and_sum called per column chunk (eager); compiled, on the whole matrix: one kernel, and a chunk's
    # strides (a row longer than the chunk) would make it compile again
    chunked: bool


_EAGER_PASSES = _SoftmaxPasses(_logits_and_max, _exp_and_sum, _logit_gradient, chunked=True)


@functools.cache
def _compiled_passes() -> _SoftmaxPasses:
    """The passes compiled once per process (at their first call), each into one kernel. Dynamic shapes:
    sampling changes the number of columns from step to step, which must not compile again (inductor compiles
    a second kernel only where the width crosses one of its reduction thresholds, 4096 columns on a CPU).
    fullgraph: a pass that dynamo cannot take whole is an error, not a silent fall back to eager pieces."""
    compiled = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    return _SoftmaxPasses(*(compiled(function) for function in _EAGER_PASSES[:3]), chunked=False)


def _to_subcentres(grad: torch.Tensor, best: torch.Tensor, k: int) -> torch.Tensor:
    """(N, C) -> (N, C*K): each class's gradient at the sub-centre whose cosine was the class's, zeros elsewhere."""
    spread = grad.new_zeros((grad.shape[0], grad.shape[1], k))
    for sub in range(k):
        spread[:, :, sub] = torch.where(best == sub, grad, 0.0)
    return spread.view(grad.shape[0], -1)


def _summed(values: torch.Tensor) -> torch.Tensor:
    """Every rank's values added (each row's target cosine lives on one rank: zeros elsewhere)."""
    total = values.clone()
    _all_reduce(total, dist.ReduceOp.SUM)
    return total


def _backward_gemms(grad_cos: torch.Tensor, grad_loss: torch.Tensor, x: torch.Tensor, centres: torch.Tensor,
                    inv_norm: torch.Tensor, gemm_dtype: torch.dtype | None, want_x: bool, want_centres: bool):
    """(dL/dX, dL/dW before the normalisation's projection) from G = dL/dcos (N, C), consumed in place.

    Both are products with G / |w|. In float32/64 that scaling is done once, in place. In half
    precision G (times the loss scale) is cast once, and 1/|w| stays in float32: folded into the
    centres for dL/dX and applied to the rows of dL/dW after its GEMM, so that small centre norms
    cannot push a cast value past float16's range.
    """
    dtype = x.dtype
    if gemm_dtype is None:
        scaled = grad_cos.mul_(inv_norm * grad_loss)
        return (scaled @ centres if want_x else None), (scaled.t() @ x if want_centres else None)
    half = grad_cos.mul_(grad_loss).to(gemm_dtype)
    grad_x = (half @ (centres * inv_norm[:, None]).to(gemm_dtype)).to(dtype) if want_x else None
    grad_centres = (half.t() @ x.to(gemm_dtype)).to(dtype).mul_(inv_norm[:, None]) if want_centres else None
    return grad_x, grad_centres


def _column_chunks(matrix: torch.Tensor):
    step = max(1, COLUMN_CHUNK_ELEMENTS // max(1, matrix.shape[0]))
    for start in range(0, matrix.shape[1], step):
        yield matrix[:, start:start + step]


def _all_reduce(tensor: torch.Tensor, op) -> None:
    if is_initialized():
        dist.all_reduce(tensor, op=op)
