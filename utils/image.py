"""The one pixel normalisation shared by training, evaluation and inference."""
from __future__ import annotations

import torch


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 RGB images (..., 3, H, W) -> float32 in [-1, 1], i.e. ``(x / 255 - 0.5) / 0.5``."""
    return images.float().div_(127.5).sub_(1.0)
