"""From face photo files to L2-normalised embeddings."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dataset import Preparation, PreparedFace, several_faces_line, stretch_warning
from utils.image import normalize

logger = logging.getLogger(__name__)


def prepared_face(path: str | Path, preparation: Preparation | None = None
                  ) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """A face photo file -> (3, 112, 112) float32 RGB in [-1, 1], prepared as every tool prepares photos
    (facedata/photos.py), and the photo's (width, height) when ``resize`` stretched it out of its aspect ratio
    (None otherwise): a tool reading many photos says that once, with their count (``stretch_warning``)."""
    return face_tensor((preparation or Preparation()).face(path))


def face_tensor(face: PreparedFace) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """``prepared_face``'s pair, from a face already prepared."""
    return normalize(torch.from_numpy(face.pixels.copy()).permute(2, 0, 1)), face.stretched_from


def read_face_image(path: str | Path, preparation: Preparation | None = None) -> torch.Tensor:
    """The photo prepared as a (3, 112, 112) tensor (``prepared_face``'s), with a logged warning when ``resize``
    changed its aspect ratio, and a note when the detector found several faces in it."""
    face = (preparation or Preparation()).face(path)
    if face.stretched_from is not None:
        logger.warning(stretch_warning([(str(path), face.stretched_from)], 1).removeprefix("warning: "))
    if face.crowded:
        logger.warning(several_faces_line([(str(path), face.faces_found)], 1).removeprefix("note: "))
    return face_tensor(face)[0]


@torch.no_grad()
def flip_fused_embeddings(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(N, 3, 112, 112) images in [-1, 1] -> (N, D) float32 unit-length embeddings of each image's and its
    mirror image's embeddings summed: what verification (Accuracy-Flip, the recorded threshold) scores."""
    weight = next(model.parameters(), None)  # None: a model run elsewhere (ONNX), which takes CPU tensors
    images = images.to(weight.device if weight is not None else "cpu")
    return F.normalize((model(images) + model(images.flip(3))).float(), dim=1)
