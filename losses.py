"""Margin functions: the logit a target class gets from its cosine, and the margin families.

A family is one class with the ``MarginFamily`` interface (a ``typing.Protocol``, below, each method
documented there), chosen by the config key ``margin_family``: partial_fc.py's sharded softmax calls
``bind(state, rows, target_cos)`` once per forward, with the family's state (a small float tensor the
classifier keeps: EMAs), what it may read of the global batch (``GlobalRows``) and, for the families that
ask, every row's target cosine; it returns that forward's ``Margin``, whose ``target_logit(cos)`` gives each
row's target logit and ``modulate(cos, slope)`` (where ``modulates_negatives``) rewrites non-target cosines
in place. Each family also declares, as a ``Family``, what the configuration, the memory plan and eval.compare
need to know of it (margin_families.py registers the declarations). The families:

- ``CombinedMarginLoss`` (arcface_torch's ``margin_list``), stateless; sub-center ArcFace is this margin
  over ``K`` sub-centres per class (partial_fc.py takes the max cosine over them);
- ``AdaFaceMargin``: each row's margin from its feature norm, standardised by EMAs of the global batch's
  norm mean and std;
- ``CurricularMargin``: hard negatives modulated by ``t``, an EMA of the global batch's mean target cosine;
- ``ElasticMargin``: each row's margin drawn from N(m, sigma), ArcFace- or CosFace-style, from a stream
  indexed by (step, global sample, view); optionally assigned by target cosine (ElasticFace+).

``CombinedMarginLoss(s, m1, m2, m3)`` turns cosines into logits: every column gets ``s * cos``
except the target, which gets ``s * (phi(cos) - m3)`` with ``phi(cos) = cos(m1 * theta + m2)``,
``theta = acos(cos)``. ArcFace is (1, 0.5, 0), CosFace (1, 0, 0.4), SphereFace-style m1 > 1.

Two places where the textbook formula breaks, and what we do instead:
- ``acos`` has an infinite derivative at cos = +-1 and rounding can push cosines past +-1 (the NaN
  in the original report): cosines are clamped to ``[-1 + eps, 1 - eps]`` before ``acos``.
- Past ``theta* = (pi - m2) / m1`` the angle ``m1 * theta + m2`` exceeds pi and ``cos`` turns back
  up, so a worse prediction would get a *better* target logit. There we continue linearly in cos
  from ``phi(cos(theta*)) = -1`` with slope 1: the logit stays continuous and increasing in cos.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

import torch

from utils.config import ANGLE, NOT_NEGATIVE, RATE, KeyRule

CLAMP_EPS = 1e-7


@dataclass(frozen=True)
class GlobalRows:
    """What a family may read of one forward's rows besides their cosines: every rank's rows of every
    view, ordered (rank, view, sample) as the sharded softmax holds them."""

    world_size: int
    num_views: int
    batch: int                        # samples per rank
    norms: torch.Tensor | None = None  # each row's feature norm before normalisation, detached (reads_norms)
    seed: int = 0                     # the classifier's seed (ElasticFace's draws)
    step: int = 0                     # forwards the classifier ran before this one (ElasticFace's draws)

    @property
    def num_rows(self) -> int:
        return self.world_size * self.num_views * self.batch


class Margin(Protocol):
    """One forward's margin, as ``MarginFamily.bind`` returns it; the sharded softmax reads only this.

    The flags default off (a class that subclasses this protocol inherits them); a margin that sets one
    implements the method it enables."""

    s: float  # every logit's scale: non-target logits are s * cos
    interclass_filtering_threshold: float = 0.0  # > 0: ``filtered`` is called
    modulates_negatives: bool = False  # True: ``modulate`` is called

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        """Every row's target logit from its target cosine (N,), rows in the sharded softmax's order
        (rank, view, sample). Differentiable: its derivative is taken by autograd on these (N,) values and
        is the gradient the target cosine gets (a straight-through margin returns a surrogate's)."""
        ...

    def filtered(self, cos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A boolean (N, C) mask of the non-target cosines to zero, with their gradient (label noise);
        called only when ``interclass_filtering_threshold > 0``. Labels of -1: no target among the columns."""
        ...

    def modulate(self, cos: torch.Tensor, slope: torch.Tensor) -> None:
        """Rewrite a column chunk of the (N, C) cosines in place into the values that ``s`` scales, and
        write d(new)/d(cos) into ``slope`` (same shape); targets are overwritten afterwards, so their values
        here do not matter. Called only when ``modulates_negatives``."""
        ...


class MarginFamily(Protocol):
    """What ``PartialFC`` takes: a margin family. A new family is one class with these members (subclass
    this protocol to inherit the flags' defaults), and its ``Family`` declaration registered in
    margin_families.py."""

    reads_norms: bool = False  # True: ``bind`` gets ``rows.norms``, every row's feature norm (one all-gather)
    reads_target_cos: bool = False  # True: ``bind`` gets every row's target cosine (one all-reduce)

    def initial_state(self) -> list[float]:
        """The family's state at step 0 as floats ([] when stateless). PartialFC keeps it in its
        ``margin_state`` buffer, the same on every rank, and the checkpoint saves and restores it."""
        ...

    def bind(self, state: torch.Tensor, rows: GlobalRows, target_cos: torch.Tensor | None) -> Margin:
        """This forward's margin. Update ``state`` (float32, in place) from the global batch first: every
        rank calls this with the same global values, so the state stays replicated. ``target_cos`` (N,) is
        every row's target cosine when ``reads_target_cos``, else None. Runs under no_grad."""
        ...


class CombinedMarginLoss(MarginFamily, Margin):
    """Cosines (N, C) and labels (N,) -> margin logits (N, C).

    A label of -1 means "this row's target is not among these columns" (it lives on another
    rank's shard or is the padding of a sampled subset): the row gets plain ``s * cos``.

    ``straight_through=True`` reproduces arcface_torch's ArcFace: the margin changes the target
    logit's value only and its gradient is that of ``s * cos`` (the published recipes use it).
    ``interclass_filtering_threshold > 0`` zeroes non-target cosines above the threshold (and their
    gradient), as arcface_torch does to ignore likely label noise.
    """

    def __init__(self, s: float = 64.0, m1: float = 1.0, m2: float = 0.5, m3: float = 0.0,
                 interclass_filtering_threshold: float = 0.0, straight_through: bool = False):
        if s <= 0:
            raise ValueError(f"margin scale s={s} must be positive (arcface_torch uses 64)")
        if m1 <= 0:
            raise ValueError(f"multiplicative margin m1={m1} must be positive (1.0 disables it)")
        if not 0.0 <= m2 < math.pi:
            raise ValueError(f"additive angular margin m2={m2} must lie in [0, pi) (ArcFace uses 0.5)")
        self.s = float(s)
        self.m1 = float(m1)
        self.m2 = float(m2)
        self.m3 = float(m3)
        self.interclass_filtering_threshold = float(interclass_filtering_threshold)
        self.straight_through = bool(straight_through)
        self._angular = not (self.m1 == 1.0 and self.m2 == 0.0)
        theta_star = (math.pi - self.m2) / self.m1
        self._cos_theta_star = math.cos(theta_star) if theta_star < math.pi else -1.0

    def __repr__(self) -> str:
        return (f"CombinedMarginLoss(s={self.s}, m1={self.m1}, m2={self.m2}, m3={self.m3}, "
                f"interclass_filtering_threshold={self.interclass_filtering_threshold}, "
                f"straight_through={self.straight_through})")

    def initial_state(self) -> list[float]:
        return []

    def bind(self, state: torch.Tensor, rows: GlobalRows, target_cos: torch.Tensor | None) -> CombinedMarginLoss:
        """The margin of one forward: the same for every row and step."""
        return self

    def phi(self, cos: torch.Tensor) -> torch.Tensor:
        """``cos(m1 * theta + m2)``, made finite at +-1 and monotonic past theta* (module docstring)."""
        if not self._angular:
            return cos
        wide = cos.to(torch.promote_types(cos.dtype, torch.float32))  # half-precision acos/cos wobble
        theta = torch.acos(wide.clamp(-1.0 + CLAMP_EPS, 1.0 - CLAMP_EPS))
        angular = torch.cos(self.m1 * theta + self.m2)
        linear = wide - self._cos_theta_star - 1.0
        return torch.where(wide >= self._cos_theta_star, angular, linear).to(cos.dtype)

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        """The target logit for target cosines; differentiable with the configured gradient."""
        margin_logit = self.s * (self.phi(cos) - self.m3)
        if self.straight_through:
            plain = self.s * cos
            return plain + (margin_logit - plain).detach()
        return margin_logit

    def filtered(self, cos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Non-target cosines above the inter-class threshold, as a boolean mask (N, C)."""
        dirty = cos.detach() > self.interclass_filtering_threshold
        write_targets(dirty, labels, torch.zeros_like(labels, dtype=torch.bool))
        return dirty

    def __call__(self, cos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.interclass_filtering_threshold > 0:
            cos = cos.masked_fill(self.filtered(cos, labels), 0.0)
        rows = torch.nonzero(labels >= 0).squeeze(1)
        cols = labels[rows]
        logits = self.s * cos
        return logits.index_put((rows, cols), self.target_logit(cos[rows, cols]))


def _ema(slot: torch.Tensor, value: torch.Tensor, rate: float) -> None:
    """``slot <- rate * value + (1 - rate) * slot`` in place. A non-finite value (a batch whose loss the loop
    will skip) leaves the slot as it was, so one bad step cannot poison every later margin."""
    new = rate * value.to(slot.dtype) + (1.0 - rate) * slot
    slot.copy_(torch.where(torch.isfinite(new), new, slot))


class _RowMargin(Margin):
    """One forward's margin whose target logit depends on the row (AdaFace, ElasticFace): ``target(cos)``
    is called on every row's target cosine, in the sharded softmax's row order."""

    def __init__(self, s: float, target):
        self.s, self._target = s, target

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        return self._target(cos)


class AdaFaceMargin(MarginFamily):
    """AdaFace (Kim et al., CVPR 2022): the margin of each row adapts to its image quality, read from its
    feature norm.

    Row i's target logit is ``s * (cos(clip(theta_i - m * z_i, eps, pi - eps)) - m - m * z_i)`` with
    ``z_i = clip(h * (n_i - mu) / (sigma + eps), -1, 1)``: ``n_i`` is the row's feature norm before
    normalisation, clipped to [0.001, 100] and detached, ``mu`` and ``sigma`` are EMAs (rate ``t_alpha``)
    of the norms' mean and unbiased std, updated with this batch before use, from (20, 100), and
    ``theta_i`` is the angle of the target cosine clamped to [-1 + eps, 1 - eps], eps = 1e-3, as the
    authors' head computes them. z = -1 (a low norm, a hard image) gives ArcFace's angular margin m,
    z = +1 an angular -m and an additive 2m.

    The batch is the global one, every rank's rows of every view (the authors' head reads each GPU's own
    batch): the margins then depend on the data alone, not on how many processes share the batch, so a
    run means the same on 1 or 64 processes and resumes on another number of them unchanged. Non-target
    cosines are not clamped as the authors' are (to +-(1 - eps)): they keep their gradient there.
    """

    reads_norms = True
    EPS = 1e-3
    NORM_RANGE = (0.001, 100.0)
    INITIAL_MEAN, INITIAL_STD = 20.0, 100.0

    def __init__(self, s: float = 64.0, m: float = 0.4, h: float = 0.333, t_alpha: float = 0.01):
        self.s, self.m, self.h, self.t_alpha = float(s), float(m), float(h), float(t_alpha)

    def __repr__(self) -> str:
        return f"AdaFaceMargin(s={self.s}, m={self.m}, h={self.h}, t_alpha={self.t_alpha})"

    def initial_state(self) -> list[float]:
        return [self.INITIAL_MEAN, self.INITIAL_STD]  # the norms' mean and std

    def bind(self, state: torch.Tensor, rows: GlobalRows, target_cos: torch.Tensor | None) -> _RowMargin:
        norms = rows.norms.clamp(*self.NORM_RANGE)
        _ema(state[0], norms.mean(), self.t_alpha)
        _ema(state[1], norms.std(), self.t_alpha)
        mean, std = state[0].to(norms.dtype), state[1].to(norms.dtype)
        z = ((norms - mean) / (std + self.EPS) * self.h).clamp(-1.0, 1.0)
        s, m, eps = self.s, self.m, self.EPS

        def target(cos: torch.Tensor) -> torch.Tensor:
            theta = torch.acos(cos.clamp(-1.0 + eps, 1.0 - eps))
            return s * (torch.cos((theta - m * z).clamp(eps, math.pi - eps)) - m - m * z)
        return _RowMargin(s, target)


class CurricularMargin(MarginFamily):
    """CurricularFace (Huang et al., CVPR 2020): ArcFace's target, and hard negatives weighted up as
    training goes on.

    Target: ``s * cos(theta + m)``, or ``s * (cos - m sin m)`` where theta + m would pass pi (the authors'
    fallback). A non-target cosine c_j of a row is hard when c_j > cos(theta_y + m), the row's target with
    its margin; its logit is then ``s * c_j * (t + c_j)`` (gradient ``s * (t + 2 c_j)``), else ``s * c_j``.
    ``t`` is an EMA (rate ``alpha``, from 0) of the mean target cosine over the global batch, every rank's
    rows of every view, updated with this batch before use (the authors: their GPU's batch).
    """

    reads_target_cos = True

    def __init__(self, s: float = 64.0, m: float = 0.5, alpha: float = 0.01):
        self.s, self.m, self.alpha = float(s), float(m), float(alpha)

    def __repr__(self) -> str:
        return f"CurricularMargin(s={self.s}, m={self.m}, alpha={self.alpha})"

    def initial_state(self) -> list[float]:
        return [0.0]  # t

    def bind(self, state: torch.Tensor, rows: GlobalRows, target_cos: torch.Tensor | None) -> _CurricularStep:
        _ema(state[0], target_cos.mean(), self.alpha)
        return _CurricularStep(self, state[0].to(target_cos.dtype), target_cos)


class _CurricularStep(Margin):
    """CurricularMargin for one forward: its t and each row's hardness threshold cos(theta_y + m)."""

    modulates_negatives = True

    def __init__(self, margin: CurricularMargin, t: torch.Tensor, target_cos: torch.Tensor):
        self.s, self.m, self.t = margin.s, margin.m, t
        c = target_cos.clamp(-1.0, 1.0)
        self.threshold = c * math.cos(self.m) - torch.sqrt(1.0 - c * c) * math.sin(self.m)
        self._fallback_below = math.cos(math.pi - self.m)

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        angular = torch.cos(torch.acos(cos.clamp(-1.0 + CLAMP_EPS, 1.0 - CLAMP_EPS)) + self.m)
        return self.s * torch.where(cos > self._fallback_below, angular, cos - self.m * math.sin(self.m))

    def modulate(self, cos: torch.Tensor, slope: torch.Tensor) -> None:
        """Columns of the (N, C) cosines in place: hard ones become c (t + c); ``slope`` gets d/dc (1 elsewhere)."""
        hard = cos > self.threshold[:, None]
        factor = torch.where(hard, cos + self.t, 1.0)  # c (t + c) = c * factor
        slope.copy_(torch.where(hard, factor + cos, 1.0))
        cos.mul_(factor)


ELASTIC_DEFAULTS = {  # (m, std, std of the "+" variant): the authors' settings
    "arc": (0.5, 0.05, 0.0175),
    "cos": (0.35, 0.05, 0.02),
}


class ElasticMargin(MarginFamily):
    """ElasticFace (Boutros et al., CVPRW 2022): each row's margin m_i drawn from N(m, std) at every step.

    ``kind="arc"``: target ``s * cos(theta + m_i)`` (past theta = pi - m_i, continued linearly as
    CombinedMarginLoss does); ``kind="cos"``: ``s * (cos - m_i)``. ``plus`` (ElasticFace+): the step's
    draws are sorted and handed out by target cosine, the row with the largest target cosine getting the
    smallest margin, over the global batch.

    The draws: for forward ``step``, a generator on the rows' device seeded with
    ``seed * 1_000_003 + step`` draws ``G * V`` float32 normals (G: the global batch's samples, V: views);
    global sample g (rank * batch + its position) of view v takes draw ``g * V + v``. A sample's margins
    therefore do not depend on the number of processes (nor on the device's shard of the batch).
    """

    def __init__(self, s: float = 64.0, kind: str = "arc", m: float | None = None, std: float | None = None,
                 plus: bool = False):
        if kind not in ELASTIC_DEFAULTS:
            raise ValueError(f"ElasticMargin kind={kind!r} must be 'arc' or 'cos'")
        mean, spread, spread_plus = ELASTIC_DEFAULTS[kind]
        self.s, self.kind, self.plus = float(s), kind, bool(plus)
        self.m = mean if m is None else float(m)
        self.std = (spread_plus if plus else spread) if std is None else float(std)
        self.reads_target_cos = self.plus

    def __repr__(self) -> str:
        return f"ElasticMargin(s={self.s}, kind={self.kind!r}, m={self.m}, std={self.std}, plus={self.plus})"

    def initial_state(self) -> list[float]:
        return []

    def draws(self, rows: GlobalRows, device: torch.device) -> torch.Tensor:
        """This forward's margin of every row, in row order (rank, view, sample)."""
        generator = torch.Generator(device=device).manual_seed(rows.seed * 1_000_003 + rows.step)
        drawn = torch.randn(rows.world_size * rows.batch * rows.num_views, generator=generator, device=device)
        by_row = drawn.view(rows.world_size, rows.batch, rows.num_views).transpose(1, 2).reshape(-1)
        return by_row * self.std + self.m

    def bind(self, state: torch.Tensor, rows: GlobalRows, target_cos: torch.Tensor | None) -> _RowMargin:
        margins = self.draws(rows, state.device)
        if self.plus:
            order = torch.sort(target_cos, descending=True, stable=True)[1]
            margins = torch.empty_like(margins).index_copy_(0, order, torch.sort(margins)[0])
        s = self.s
        if self.kind == "cos":
            return _RowMargin(s, lambda cos: s * (cos - margins.to(cos.dtype)))

        def target(cos: torch.Tensor) -> torch.Tensor:
            m = margins.to(cos.dtype)
            angular = torch.cos(torch.acos(cos.clamp(-1.0 + CLAMP_EPS, 1.0 - CLAMP_EPS)) + m)
            below = -torch.cos(m.clamp_min(0.0))  # cos(pi - m_i): where theta + m_i reaches pi
            return s * torch.where(cos >= below, angular, cos - below - 1.0)
        return _RowMargin(s, target)


@dataclass(frozen=True)
class Family:
    """What one value of the config key ``margin_family`` declares: the config checks, the memory plan, the
    start-up log and eval.compare read this instead of comparing family names. margin_families.py registers each.
    """

    name: str                                           # margin_family's value
    build: Callable[[SimpleNamespace], MarginFamily]    # the margin from a config (margin_scale and its own keys)
    keys: tuple[KeyRule, ...] = ()                      # its own keys' ranges (and type and default if new)
    shown: tuple[str, ...] = ()                         # keys eval.compare shows beside margin_scale
    centres_key: str | None = None                      # the key giving centres per class (sub-centres); None: one
    negatives_buffers: int = 0                          # (N, C) float32 buffers the softmax's forward keeps beside
                                                        # the cosines (the memory plan's logits_buffer)
    filters_negatives: bool = False                     # honours interclass_filtering_threshold

    def centres_per_class(self, cfg: SimpleNamespace) -> int:
        return getattr(cfg, self.centres_key) if self.centres_key else 1


def _combined(cfg: SimpleNamespace) -> CombinedMarginLoss:
    return CombinedMarginLoss(cfg.margin_scale, *cfg.margin_list, cfg.interclass_filtering_threshold,
                              straight_through=cfg.straight_through_margin)


# The families of this file; configs/base.py documents their keys.
COMBINED = Family("combined", _combined, shown=("margin_list",), filters_negatives=True)
SUBCENTER = Family("subcenter", _combined, keys=(KeyRule("subcenter_k", lambda v: 2 <= v <= 255,
                                                         "an integer from 2 to 255", "3 (the paper's)"),),
                   shown=("margin_list",), centres_key="subcenter_k", filters_negatives=True)
ADAFACE = Family("adaface", lambda cfg: AdaFaceMargin(cfg.margin_scale, cfg.adaface_m, cfg.adaface_h,
                                                      cfg.adaface_t_alpha),
                 keys=(KeyRule("adaface_m", *ANGLE, "0.4 (the paper's)"),
                       KeyRule("adaface_h", *NOT_NEGATIVE, "0.333 (the paper's)"),
                       KeyRule("adaface_t_alpha", *RATE, "0.01 (the paper's)")))
CURRICULAR = Family("curricular", lambda cfg: CurricularMargin(cfg.margin_scale, cfg.curricular_m,
                                                               cfg.curricular_alpha),
                    keys=(KeyRule("curricular_m", *ANGLE, "0.5 (the paper's)"),
                          KeyRule("curricular_alpha", *RATE, "0.01 (the paper's)")),
                    negatives_buffers=1)  # the hard negatives' derivative, from modulate to the backward
_ELASTIC_KEYS = (KeyRule("elastic_m", *ANGLE, "None (the paper's)"),
                 KeyRule("elastic_std", *NOT_NEGATIVE, "None (the paper's)"))
ELASTIC_ARC = Family("elastic_arc", lambda cfg: ElasticMargin(cfg.margin_scale, "arc", cfg.elastic_m, cfg.elastic_std,
                                                              cfg.elastic_plus), keys=_ELASTIC_KEYS)
ELASTIC_COS = Family("elastic_cos", lambda cfg: ElasticMargin(cfg.margin_scale, "cos", cfg.elastic_m, cfg.elastic_std,
                                                              cfg.elastic_plus), keys=_ELASTIC_KEYS)


# The target of each row is read and written through gather/scatter over every row, not through the rows
# that have one (nonzero, boolean masks): an output whose shape depends on the data makes the host wait
# for the device.


def read_targets(matrix: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``matrix[n, labels[n]]`` for every row n (N,); 0 for rows whose label is -1 (target not here)."""
    if not matrix.shape[1]:
        return matrix.new_zeros(matrix.shape[0])
    values = matrix.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
    return torch.where(labels >= 0, values, 0)


def write_targets(matrix: torch.Tensor, labels: torch.Tensor, values: torch.Tensor) -> None:
    """``matrix[n, labels[n]] = values[n]`` in place for the rows whose label is not -1; other rows untouched."""
    if not matrix.shape[1]:
        return
    columns = labels.clamp_min(0)[:, None]  # rows without a target write back what their column 0 holds
    kept = matrix.gather(1, columns).squeeze(1)
    matrix.scatter_(1, columns, torch.where(labels >= 0, values, kept)[:, None])
