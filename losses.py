"""Margin functions: the logit a target class gets from its cosine.

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

import torch

CLAMP_EPS = 1e-7


class CombinedMarginLoss:
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
