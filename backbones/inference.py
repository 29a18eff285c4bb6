"""From aligned face image files to L2-normalised embeddings."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError
from torch import nn

from utils.errors import FaceImageError
from utils.image import IMAGE_SIZE, normalize

logger = logging.getLogger(__name__)



def read_face_image(path: str | Path) -> torch.Tensor:
    """An aligned square face image file -> (3, 112, 112) float32 RGB in [-1, 1].

    Square images of another size are resized (bilinear); a non-square image is refused because
    squeezing it would distort the face (a 112x224 pair record must be split into views first).
    """
    path = Path(path)
    if not path.is_file():
        raise FaceImageError(f"image file {path} does not exist; check the path")
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise FaceImageError(f"{path} is not a readable image ({error}); pass a face crop in a common "
                             "format such as PNG or JPEG") from error
    width, height = image.size
    if width != height:
        raise FaceImageError(
            f"{path} is {width}x{height} (width x height), not square; pass an aligned face crop "
            f"of {IMAGE_SIZE}x{IMAGE_SIZE} (split multi-view records into their square views first)"
        )
    if width != IMAGE_SIZE:
        logger.warning("%s is %dx%d; resizing to %dx%d", path, width, height, IMAGE_SIZE, IMAGE_SIZE)
        image = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
    return normalize(pixels)


@torch.no_grad()
def unit_embeddings(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(N, 3, 112, 112) images in [-1, 1] -> (N, D) float32 unit-length embeddings (model in eval mode)."""
    device = next(model.parameters()).device
    return F.normalize(model(images.to(device)).float(), dim=1)
