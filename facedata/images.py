"""Decoding record payloads to uint8 RGB tensors and cutting them into square views."""
from __future__ import annotations

from collections.abc import Callable

import torch

from facedata.recordio import BadRecordError
from utils.errors import DataError
from utils.image import IMAGE_SIZE


def image_io():
    """torchvision.io, which also registers the torch.ops.image decoders. Imported when a data set is built (before
    its workers fork, so that they share it) or by the first decode: it takes about a second (torchvision imports
    its models and ops with it), which a process that never decodes (a refused start, --dry-run, --help) does not
    pay."""
    import torchvision.io  # noqa: PLC0415 (a second to import; only processes that decode need it)

    return torchvision.io


class BadImageError(BadRecordError):
    """A payload that no decoder accepts (a per-record problem ``skip_bad_records`` may skip)."""


def decode(payload: bytes, where: Callable[[], str]) -> torch.Tensor:
    """JPEG/PNG bytes -> uint8 (3, H, W) RGB; grayscale and alpha images are converted to RGB.

    ``where()`` describes the record for error messages (only called when there is an error).
    """
    if not payload:
        raise BadImageError(f"{where()} holds no image bytes", "re-pack the dataset or pass skip_bad_records=True")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    io = image_io()
    try:
        # JPEG goes straight to the op behind torchvision's decode_jpeg (libjpeg-turbo, the decoder
        # cv2 uses too): the public wrapper adds a deprecation warning and usage logging per call,
        # a sizeable share of a 112x112 decode. decode_image sniffs everything else (PNG, WebP, GIF).
        if is_jpeg(payload):
            return torch.ops.image.decode_jpeg(data, io.ImageReadMode.RGB.value, False)
        return io.decode_image(data, mode=io.ImageReadMode.RGB)
    except RuntimeError as err:
        raise BadImageError(f"{where()} is not a decodable image ({str(err).splitlines()[0]})",
                            "re-pack the dataset or pass skip_bad_records=True to skip such records") from None


def is_jpeg(payload: bytes) -> bool:
    return payload[:2] == b"\xff\xd8"


def decode_jpegs(payloads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """JPEG bytes (1-D uint8 CPU tensors) -> uint8 (3, H, W) RGB images on ``device``: one batched
    nvJPEG call on a GPU, libjpeg-turbo one by one on the CPU (RuntimeError for a bad one).

    What torchvision.io.decode_jpeg(payloads, device=...) does, minus its per-call deprecation warning.
    """
    rgb = image_io().ImageReadMode.RGB.value
    if device.type == "cuda":
        return torch.ops.image.decode_jpegs_cuda(payloads, rgb, device)
    return [torch.ops.image.decode_jpeg(payload, rgb, False) for payload in payloads]


def split_views(image: torch.Tensor, num_views: int, where: Callable[[], str], fix: str | None = None
                ) -> list[torch.Tensor]:
    """(3, H, V*H) on any device -> V views (3, H, H), no copy: the square views a record holds side by side.

    ``where()`` describes the record and ``fix`` what to change when it does not hold V views.
    """
    _, height, width = image.shape
    if width != num_views * height:
        fix = fix or (f"set num_views to {width // height}" if width % height == 0
                      else "re-pack it with tools/pack_rec.py")
        raise DataError(f"{where()} is {height}x{width} (HxW), not {num_views} square view(s) side by side "
                        f"({height}x{num_views * height}); {fix}")
    if height != IMAGE_SIZE:
        raise DataError(f"{where()} holds {height}x{height} views but training needs {IMAGE_SIZE}x{IMAGE_SIZE}; "
                        "re-pack with tools/pack_rec.py, which resizes or pads to "
                        f"{IMAGE_SIZE}x{IMAGE_SIZE}")
    return [image[:, :, v * height:(v + 1) * height] for v in range(num_views)]
