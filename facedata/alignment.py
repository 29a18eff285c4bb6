"""Similarity alignment of five facial landmarks to the ArcFace 112x112 template (no cv2/skimage): how the
IJB evaluation aligns its faces and how every tool prepares a photo whose landmarks it is given
(facedata/photos.py)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from utils.image import IMAGE_SIZE

# Left eye, right eye, nose tip, left and right mouth corner in a 112x112 crop: insightface's
# 96x112 template shifted 8 px right (arcface_torch eval_ijbc.py / insightface face_align).
ARCFACE_TEMPLATE = np.array([
    [38.2946, 51.6963],
    [73.5318, 51.5014],
    [56.0252, 71.7366],
    [41.5493, 92.3655],
    [70.7299, 92.2041],
], dtype=np.float64)


def umeyama_similarity(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The 2x3 matrix of the scale-rotation-translation that maps ``src`` points onto ``dst``
    with the least squared error (Umeyama 1991, reflections excluded)."""
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    src_mean, dst_mean = src.mean(axis=0), dst.mean(axis=0)
    src_centered, dst_centered = src - src_mean, dst - dst_mean
    covariance = dst_centered.T @ src_centered / len(src)
    u, singular, vt = np.linalg.svd(covariance)
    # Flip the weakest axis if the best orthogonal map would be a reflection.
    sign = np.ones(2)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        sign[-1] = -1.0
    rotation = u @ np.diag(sign) @ vt
    src_variance = np.sum(src_centered ** 2) / len(src)
    if src_variance == 0:
        raise ValueError("the landmarks all sit on one point; a face needs five distinct landmarks")
    scale = float(singular @ sign) / src_variance
    translation = dst_mean - scale * rotation @ src_mean
    return np.hstack([scale * rotation, translation[:, None]])


def warp_affine(image: torch.Tensor, matrix: np.ndarray, size: int) -> torch.Tensor:
    """Output pixel (x, y) takes the bilinear sample at ``matrix^-1 (x, y)`` of ``image``
    (uint8 ``(3, H, W)``), pixel centres at integer coordinates, zeros outside; as cv2.warpAffine."""
    _, height, width = image.shape
    forward = np.vstack([matrix, [0.0, 0.0, 1.0]])
    inverse = np.linalg.inv(forward)[:2]
    ys, xs = np.meshgrid(np.arange(size, dtype=np.float64), np.arange(size, dtype=np.float64), indexing="ij")
    source = np.stack([xs, ys, np.ones_like(xs)], axis=-1) @ inverse.T  # (size, size, 2) source x, y
    # grid_sample with align_corners=True puts pixel 0 at -1 and pixel W-1 at +1.
    grid = np.empty_like(source)
    grid[..., 0] = source[..., 0] * 2.0 / max(width - 1, 1) - 1.0
    grid[..., 1] = source[..., 1] * 2.0 / max(height - 1, 1) - 1.0
    grid_tensor = torch.from_numpy(grid).float()[None]
    warped = F.grid_sample(image[None].float(), grid_tensor, mode="bilinear", padding_mode="zeros",
                           align_corners=True)
    return warped[0].round_().clamp_(0, 255).to(torch.uint8)


def align_face(image: torch.Tensor, landmarks: np.ndarray) -> torch.Tensor:
    """uint8 ``(3, H, W)`` photo + 5x2 landmarks (x, y) -> uint8 ``(3, 112, 112)`` aligned crop."""
    matrix = umeyama_similarity(np.asarray(landmarks, dtype=np.float64).reshape(5, 2), ARCFACE_TEMPLATE)
    return warp_affine(image, matrix, IMAGE_SIZE)
