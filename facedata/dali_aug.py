"""arcface_torch's ``dali_aug``: low resolution, Gaussian blur, hue/saturation and grey, per view.

Upstream (``dali_data_iter`` in arcface_torch's dataset.py) runs these DALI operators on each
decoded image, in this order, each on its own coin:

- p 0.1: ``fn.resize`` to a side drawn uniformly from [int(112*0.5), int(112*0.8)) = [56, 89)
  pixels, then back to 112 (linear, antialiased when shrinking);
- p 0.2: ``fn.gaussian_blur`` with window 2w+1, w = round(uniform[1, 2)): 3 or 5 pixels, each half
  the time; sigma from the window as DALI (and OpenCV) derive it, (radius - 1) * 0.3 + 0.8;
- p 0.2: ``fn.hsv`` with hue + uniform[0, 20) degrees and saturation x uniform[1, 1.2). DALI's
  "hsv" is a linear map in YIQ space (hue rotates the I/Q plane, saturation scales it), not a
  conversion to HSV and back; we do the same, with DALI's matrices;
- p 0.1: grey, ``fn.hsv`` with saturation 0: R = G = B = 0.299 R + 0.587 G + 0.114 B.

The draws come from the sample's :class:`SampleRandom` (a fixed number per view, whatever the
coins say), so a view's augmentation depends only on (seed, epoch, index, view). The operations
work on uint8 (N, 3, H, W) tensors on any device and only with elementwise arithmetic (resizing
aside), so a batch of views gives exactly what the views give one at a time: the workers
augment a sample's views, the GPU decoding path a whole batch's, with the same results.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as nnf

from facedata.augment import SampleRandom

LOW_RES_P, LOW_RES_SIDE = 0.1, (56.0, 89.0)
BLUR_P, BLUR_WINDOWS = 0.2, (3, 5)
COLOUR_P, HUE_DEGREES, SATURATION = 0.2, (0.0, 20.0), (1.0, 1.2)
GREY_P = 0.1

# DALI's hsv operator (dali/operators/image/color/hsv.h): RGB -> YIQ and its precomputed inverse.
RGB_TO_YIQ = ((0.299, 0.587, 0.114), (0.596, -0.274, -0.321), (0.211, -0.523, 0.311))
YIQ_TO_RGB = ((1.0, 0.956, 0.621), (1.0, -0.272, -0.647), (1.0, -1.107, 1.705))
_RGB_TO_YIQ, _YIQ_TO_RGB = np.array(RGB_TO_YIQ), np.array(YIQ_TO_RGB)


@dataclass(frozen=True)
class ViewAugment:
    """What ``dali_aug`` does to one view; None / False where its coin said no."""

    low_res: int | None = None                         # side of the small copy, pixels
    blur: int | None = None                            # window, pixels
    hue_saturation: tuple[float, float] | None = None  # (degrees, factor)
    grey: bool = False


def draw_augments(rng: SampleRandom, num_views: int) -> list[ViewAugment]:
    """One :class:`ViewAugment` per view, each from 8 draws of ``rng`` whatever the coins say."""
    augments = []
    for _ in range(num_views):
        low_res, side = rng.random() < LOW_RES_P, rng.uniform(*LOW_RES_SIDE)
        blur, wide = rng.random() < BLUR_P, rng.random() < 0.5
        colour, hue, saturation = rng.random() < COLOUR_P, rng.uniform(*HUE_DEGREES), rng.uniform(*SATURATION)
        grey = rng.random() < GREY_P
        augments.append(ViewAugment(
            low_res=int(side + 0.5) if low_res else None,  # DALI rounds a fractional output size
            blur=BLUR_WINDOWS[wide] if blur else None,
            hue_saturation=(hue, saturation) if colour else None,
            grey=grey))
    return augments


def dali_augment(views: torch.Tensor, augments: Sequence[ViewAugment]) -> torch.Tensor:
    """uint8 (N, 3, H, W) views -> the same views with ``augments[n]`` applied to view n, in
    upstream's order (low resolution, blur, hue/saturation, grey). Writes into ``views``."""
    for n, aug in enumerate(augments):
        if aug.low_res is not None:
            views[n] = low_resolution(views[n:n + 1], aug.low_res)[0]
    for window in BLUR_WINDOWS:
        blurred = [n for n, aug in enumerate(augments) if aug.blur == window]
        _apply(views, blurred, partial(gaussian_blur, window=window))
    coloured = [n for n, aug in enumerate(augments) if aug.hue_saturation is not None]
    hues, saturations = zip(*(augments[n].hue_saturation for n in coloured)) if coloured else ((), ())
    _apply(views, coloured, partial(hue_saturation, hues=hues, saturations=saturations))
    _apply(views, [n for n, aug in enumerate(augments) if aug.grey], grey)
    return views


def _apply(views: torch.Tensor, chosen: list[int], operation) -> None:
    """views[chosen] = operation(views[chosen]), through index tensors: indexing with a Python list
    costs a hundred microseconds a call, more than most of the operations."""
    if chosen:
        index = torch.tensor(chosen, device=views.device)
        views.index_copy_(0, index, operation(views.index_select(0, index)))


def low_resolution(views: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> shrunk to side x side (antialiased) and enlarged back, both bilinear."""
    height, width = views.shape[-2:]
    # a second to import (torchvision imports its models too); only runs with dali_aug resize
    import torchvision.transforms.v2.functional as tvf  # noqa: PLC0415

    small = tvf.resize(views, [side, side], interpolation=tvf.InterpolationMode.BILINEAR, antialias=True)
    return tvf.resize(small, [height, width], interpolation=tvf.InterpolationMode.BILINEAR, antialias=True)


def gaussian_kernel(window: int) -> list[float]:
    """DALI's normalised 1-D Gaussian of ``window`` taps, sigma derived from the window as DALI does."""
    radius = (window - 1) // 2
    sigma = (radius - 1) * 0.3 + 0.8
    taps = [math.exp(-x * x / (2 * sigma * sigma)) for x in range(-radius, radius + 1)]
    return [t / sum(taps) for t in taps]


def gaussian_blur(views: torch.Tensor, window: int) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> blurred: separable, float32, borders mirrored without repeating the edge
    pixel (DALI's reflect-101), rounded back to uint8."""
    kernel = gaussian_kernel(window)
    radius = window // 2
    pixels = views.float()
    for axis in (-1, -2):  # rows first, then columns, as DALI goes from the innermost axis out
        padding = (radius, radius, 0, 0) if axis == -1 else (0, 0, radius, radius)
        padded = nnf.pad(pixels, padding, mode="reflect")
        size = pixels.shape[axis]
        pixels = padded.narrow(axis, 0, size) * kernel[0]
        for tap in range(1, window):
            pixels.add_(padded.narrow(axis, tap, size), alpha=kernel[tap])
    return _to_uint8(pixels)


def colour_matrix(hue: float, saturation: float) -> np.ndarray:
    """DALI's hsv transform (value 1) as a float64 (3, 3) matrix on RGB column vectors."""
    radians = math.radians(hue)
    cos, sin = math.cos(radians), math.sin(radians)
    rotate_scale = np.array([[1.0, 0.0, 0.0],
                             [0.0, cos * saturation, sin * saturation],
                             [0.0, -sin * saturation, cos * saturation]])
    return _YIQ_TO_RGB @ rotate_scale @ _RGB_TO_YIQ


def hue_saturation(views: torch.Tensor, hues: Sequence[float], saturations: Sequence[float]) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> view n with its hue turned by ``hues[n]`` degrees and its saturation
    scaled by ``saturations[n]`` (DALI's YIQ-space hsv)."""
    matrices = np.stack([colour_matrix(h, s) for h, s in zip(hues, saturations)])
    return _mix_channels(views, torch.as_tensor(matrices, dtype=torch.float32, device=views.device))


def grey(views: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> every channel the luma 0.299 R + 0.587 G + 0.114 B (DALI's hsv with saturation 0)."""
    pixels = views.float()
    red, green, blue = RGB_TO_YIQ[0]
    luma = pixels[:, 0] * red
    luma.add_(pixels[:, 1], alpha=green).add_(pixels[:, 2], alpha=blue)
    return _to_uint8(luma)[:, None].expand(-1, 3, -1, -1)


def _mix_channels(views: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """out[n, c] = sum_k matrices[n, c, k] * views[n, k], as elementwise float32 arithmetic (a matrix
    product's summation order could change with the batch size)."""
    pixels = views.float()
    weights = matrices[:, :, :, None, None]
    mixed = weights[:, :, 0] * pixels[:, None, 0]
    mixed.addcmul_(weights[:, :, 1], pixels[:, None, 1]).addcmul_(weights[:, :, 2], pixels[:, None, 2])
    return _to_uint8(mixed)


def _to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.round_().clamp_(0, 255).to(torch.uint8)
