"""The face image every network sees: its size, and the one pixel normalisation shared by training,
evaluation and inference."""
from __future__ import annotations

import torch

IMAGE_SIZE = 112  # aligned face crops are IMAGE_SIZE x IMAGE_SIZE; a V-view record is IMAGE_SIZE x V*IMAGE_SIZE


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 RGB images (..., 3, H, W) -> float32 in [-1, 1], i.e. ``(x / 255 - 0.5) / 0.5``."""
    return images.float().div_(127.5).sub_(1.0)
