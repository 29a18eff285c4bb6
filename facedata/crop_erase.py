"""Small-data augmentations per view: random resized crop (``crop_scale``) and random erasing (``erase_p``).

- Crop: a square whose area is a fraction drawn uniformly from ``crop_scale`` of the view's, at a
  uniformly drawn position inside the view, resized back to the view's size (bilinear, antialiased,
  as torchvision's ``RandomResizedCrop`` resizes). Square, so an aligned face keeps its proportions: one draw
  gives both a scale jitter (up to 1/sqrt(low)) and a shift jitter (up to the side minus the square's).
- Erasing (Zhong et al., "Random Erasing Data Augmentation", torchvision's ``RandomErasing``): with
  probability ``erase_p`` a rectangle of area fraction uniform in [0.02, 0.33] and aspect ratio
  (height / width) log-uniform in [0.3, 3.3], at a uniform position, filled with 0 (black): the
  constant of torchvision's ``RandomErasing(value=0)`` on unnormalised pixels and of AdaFace's
  occlusion by its crop augmentation. Where torchvision draws again for a rectangle that does not fit
  (a tall, large one), a side longer than the view's is cut to the view's, so the number of draws is fixed.

Both draw from the sample's :class:`SampleRandom` a fixed number of times per view, whatever the
coins say (3 for the crop, then 5 for the erasing, per view, both whenever either is on), so turning
one on leaves the other's draws as they were. Like dali_aug's operations they work on uint8
(N, 3, H, W) tensors on any device, and a batch of views gives exactly what its views give one at a time.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as nnf

from facedata.augment import SampleRandom

ERASE_AREA = (0.02, 0.33)  # fraction of the view (Zhong et al., torchvision's default scale)
ERASE_RATIO = (0.3, 3.3)   # height / width, drawn log-uniformly (torchvision's default ratio)
ERASE_VALUE = 0            # the fill, every channel


@dataclass(frozen=True)
class CropErase:
    """What crop_scale and erase_p do to one view; None where nothing is done."""

    crop: tuple[int, int, int] | None = None            # (top, left, side) of the square resized to the view
    erase: tuple[int, int, int, int] | None = None      # (top, left, height, width) of the rectangle filled


def draw_crop_erase(rng: SampleRandom, num_views: int, crop_scale: tuple[float, float], erase_p: float,
                    size: int) -> list[CropErase]:
    """One :class:`CropErase` per ``size`` x ``size`` view, each from 8 draws of ``rng``: the crop's area,
    top and left, then the erasing's coin, area, log aspect ratio, top and left."""
    low, high = crop_scale
    draws = []
    for _ in range(num_views):
        area, top, left = rng.uniform(low, high), rng.random(), rng.random()
        side = min(size, max(1, round(size * math.sqrt(area))))
        crop = None if side == size else (int(top * (size - side + 1)), int(left * (size - side + 1)), side)
        coin, erase_area = rng.random() < erase_p, rng.uniform(*ERASE_AREA) * size * size
        ratio = math.exp(rng.uniform(math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1])))
        top, left = rng.random(), rng.random()
        height = min(size, max(1, round(math.sqrt(erase_area * ratio))))
        width = min(size, max(1, round(math.sqrt(erase_area / ratio))))
        erase = (int(top * (size - height + 1)), int(left * (size - width + 1)), height, width) if coin else None
        draws.append(CropErase(crop, erase))
    return draws


def crop_resize(views: torch.Tensor, draws: Sequence[CropErase]) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> view n's square ``draws[n].crop`` resized back to H x W (bilinear, antialiased);
    the views of one square size resized in one call. Writes into ``views``."""
    height, width = views.shape[-2:]
    by_side: dict[int, list[int]] = {}
    for n, draw in enumerate(draws):
        if draw.crop is not None:
            by_side.setdefault(draw.crop[2], []).append(n)
    for chosen in by_side.values():
        squares = torch.stack([_square(views[n], draws[n].crop) for n in chosen])
        views.index_copy_(0, torch.tensor(chosen, device=views.device), resize(squares, height, width))
    return views


def resize(views: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 (N, 3, h, w) -> (N, 3, height, width), bilinear and antialiased, each view on its own (a batch
    gives what its views give one at a time), as torchvision's ``resize`` does it: on the CPU torch's uint8
    kernel (PIL's fixed-point arithmetic; given channels-last memory, its vectorised path, with the same
    pixels), elsewhere in float32, rounded."""
    if views.device.type == "cpu":
        return nnf.interpolate(views.contiguous(memory_format=torch.channels_last), size=(height, width),
                               mode="bilinear", antialias=True, align_corners=False).contiguous()
    return resize_in_float(views, height, width)


def resize_in_float(views: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """:func:`resize` off the CPU (torch has no uint8 kernel there): in float32, rounded to uint8."""
    resized = nnf.interpolate(views.float(), size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return resized.round_().clamp_(0, 255).to(torch.uint8)


def _square(view: torch.Tensor, crop: tuple[int, int, int]) -> torch.Tensor:
    top, left, side = crop
    return view[:, top:top + side, left:left + side]


def erase(views: torch.Tensor, draws: Sequence[CropErase]) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> view n's rectangle ``draws[n].erase`` set to ERASE_VALUE. Writes into ``views``."""
    for n, draw in enumerate(draws):
        if draw.erase is not None:
            top, left, height, width = draw.erase
            views[n, :, top:top + height, left:left + width] = ERASE_VALUE
    return views
