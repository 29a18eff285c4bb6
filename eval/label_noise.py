"""Noisy labels found as sub-center ArcFace finds them (Deng et al., ECCV 2020): each class's dominant sub-centre
and every record's angle to it.

A class trained with K sub-centres (margin_family = "subcenter") gathers its clean samples around one of them, the
dominant one, which most of its samples are nearest to; a noisy sample (someone else's photo under this label)
sits near another sub-centre or far from all of them. Sub-center ArcFace drops the samples farther than an angle
(75 degrees in the paper) from their class's dominant sub-centre.

A record holding V views (two photos side by side) is judged as one sample: its embedding is the mean of its
views' unit embeddings, normalised again, so that one threshold means the same for records of one and of two views
and a record is kept or dropped whole. Every view's own angle to the dominant sub-centre is given beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_ANGLE = 75.0  # degrees: the paper's threshold


@dataclass(frozen=True)
class Judged:
    """Records of classes 0..C-1 against those classes' K sub-centres."""

    nearest: np.ndarray      # (N,) the sub-centre of its class each record is nearest to
    dominant: np.ndarray     # (C,) each class's dominant sub-centre (the lowest index among ties; 0 without records)
    angle: np.ndarray        # (N,) degrees between each record's embedding and its class's dominant sub-centre
    view_angles: np.ndarray  # (N, V) the same for each view of the record


def unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (float64)."""
    vectors = np.asarray(vectors, dtype=np.float64)
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


def subcentre_cosines(view_embeddings: np.ndarray, classes: np.ndarray, centres: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Cosines of records (N, K) and of their views (N, V, K) with their class's K sub-centres, from the views'
    embeddings (N, V, D), the records' classes (N,) in 0..C-1 and the sub-centres (C, K, D). A batch at a time:
    what a class's dominant sub-centre is needs every record of the class, but only these N x K cosines of each."""
    views = unit(view_embeddings)
    own = unit(centres[classes])                             # (N, K, D): each record's class's sub-centres
    return np.einsum("nkd,nd->nk", own, unit(views.mean(axis=1))), np.einsum("nkd,nvd->nvk", own, views)


def judge(record_cos: np.ndarray, view_cos: np.ndarray, classes: np.ndarray, num_classes: int) -> Judged:
    """Each class's dominant sub-centre and each record's angle to it, from subcentre_cosines' cosines of every
    record of classes 0..num_classes-1."""
    rows = np.arange(len(classes))
    k = record_cos.shape[1]
    nearest = record_cos.argmax(axis=1)
    votes = np.bincount(classes * k + nearest, minlength=num_classes * k).reshape(num_classes, k)
    dominant = votes.argmax(axis=1)
    chosen = dominant[classes]
    return Judged(nearest=nearest, dominant=dominant, angle=_degrees(record_cos[rows, chosen]),
                  view_angles=_degrees(view_cos[rows, :, chosen]))


def _degrees(cos: np.ndarray) -> np.ndarray:
    return np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))


def kept(angle: np.ndarray, threshold: float) -> np.ndarray:
    """Records within `threshold` degrees of their dominant sub-centre (insightface's drop.py keeps cos > cos(t))."""
    return angle < threshold
