"""Per-view augmentation whose randomness is a pure function of (seed, epoch, sample index).

Drawing from worker RNG state would make a sample depend on which worker produced it and on where
a run was resumed; keying a fresh stream on the sample instead makes every epoch reproducible
with any ``num_workers`` and from any resume point.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

MAX_SHIFT = 8            # pixels of translation in "augment" views
BRIGHTNESS = (0.8, 1.2)  # multiplicative ranges for "augment" views
CONTRAST = (0.8, 1.2)

_MASK = (1 << 64) - 1


def _splitmix64(state: int) -> int:
    z = (state + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class SampleRandom:
    """A small random stream keyed on (seed, epoch, index): splitmix64 over a counter.

    A handful of draws per sample is all augmentation needs; this costs a few microseconds where
    building a numpy Generator per sample costs tens, on a path that runs for every image.
    """

    def __init__(self, seed: int, epoch: int, index: int) -> None:
        self._state = _splitmix64(_splitmix64(_splitmix64(seed & _MASK) ^ (epoch & _MASK)) ^ (index & _MASK))

    def bits(self) -> int:
        """64 random bits."""
        self._state = (self._state + 1) & _MASK
        return _splitmix64(self._state)

    def random(self) -> float:
        """Uniform in [0, 1)."""
        return (self.bits() >> 11) * (1.0 / (1 << 53))

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * self.random()

    def below(self, n: int) -> int:
        """Uniform integer in [0, n) (the modulo bias is below 2**-40 for any realistic n)."""
        return self.bits() % n

    def picks(self, n: int, k: int) -> list[int]:
        """k positions in [0, n): all different while k <= n, then the same again in a new order."""
        picked: list[int] = []
        while len(picked) < k:
            pool = list(range(n))
            for i in range(min(n, k - len(picked))):
                j = i + self.below(n - i)
                pool[i], pool[j] = pool[j], pool[i]
                picked.append(pool[i])
        return picked


def coins(rng: SampleRandom, count: int) -> list[bool]:
    """``count`` fair coin flips (one per view: the horizontal-flip decisions)."""
    flips: list[bool] = []
    while len(flips) < count:
        bits = rng.bits()
        flips += [bool(bits >> i & 1) for i in range(min(64, count - len(flips)))]
    return flips


def assemble(views: Sequence[np.ndarray | torch.Tensor], flips: Sequence[bool]) -> torch.Tensor:
    """(3, H, W) uint8 CPU views of any memory layout -> one new contiguous (V, 3, H, W) tensor, view v
    mirrored horizontally where ``flips[v]``.

    One numpy copy does layout, flip and stacking together: decoders hand back (H, W, 3) memory,
    and numpy mirrors through a negative stride for free. numpy also never spreads such a small
    copy over threads, which torch does in a multi-threaded main process at a thousand times the cost.
    """
    out = np.empty((len(views), *views[0].shape), dtype=np.uint8)
    for v, (view, flip) in enumerate(zip(views, flips)):
        pixels = np.asarray(view)
        out[v] = pixels[:, :, ::-1] if flip else pixels
    return torch.from_numpy(out)


def jitter(pixels: np.ndarray | torch.Tensor, rng: SampleRandom) -> np.ndarray:
    """One "augment" view: a random shift (edges repeated), brightness and contrast of (3, H, W) uint8."""
    pixels = np.asarray(pixels)
    _, height, width = pixels.shape
    dy, dx = rng.below(2 * MAX_SHIFT + 1) - MAX_SHIFT, rng.below(2 * MAX_SHIFT + 1) - MAX_SHIFT
    rows = np.clip(np.arange(height) - dy, 0, height - 1)
    cols = np.clip(np.arange(width) - dx, 0, width - 1)
    shifted = pixels[:, rows][:, :, cols].astype(np.float32)
    brightness, contrast = rng.uniform(*BRIGHTNESS), rng.uniform(*CONTRAST)
    mean = shifted.mean()
    out = (shifted - mean) * np.float32(contrast) + np.float32(mean * brightness)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)
