"""Per-view augmentation whose randomness is a pure function of (seed, epoch, sample index).

Drawing from worker RNG state would make a sample depend on which worker produced it and on where
a run was resumed; keying a fresh generator on the sample instead makes every epoch reproducible
with any ``num_workers`` and from any resume point.
"""
from __future__ import annotations

import numpy as np
import torch

MAX_SHIFT = 8            # pixels of translation in "augment" views
BRIGHTNESS = (0.8, 1.2)  # multiplicative ranges for "augment" views
CONTRAST = (0.8, 1.2)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, index])


def flip_views(views: torch.Tensor, flips: np.ndarray) -> torch.Tensor:
    """Mirror (horizontally) the views of (V, 3, H, W) whose entry in ``flips`` is true."""
    if flips.any():
        chosen = torch.from_numpy(np.flatnonzero(flips))
        views[chosen] = views[chosen].flip(-1)
    return views


def jitter(view: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """One "augment" view: a random shift (edges repeated), brightness and contrast of (3, H, W) uint8."""
    _, height, width = view.shape
    dy, dx = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, size=2)
    rows = torch.arange(height).sub_(int(dy)).clamp_(0, height - 1)
    cols = torch.arange(width).sub_(int(dx)).clamp_(0, width - 1)
    shifted = view[:, rows][:, :, cols].float()
    brightness, contrast = rng.uniform(*BRIGHTNESS), rng.uniform(*CONTRAST)
    mean = shifted.mean()
    out = (shifted - mean).mul_(contrast).add_(mean * brightness)
    return out.round_().clamp_(0, 255).to(torch.uint8)
