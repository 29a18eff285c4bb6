"""Writing insightface-layout ``.rec/.idx`` datasets: prepared faces (facedata/photos.py), views side by side."""
from __future__ import annotations

import io
import os
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageFile

from facedata.photos import Preparation, prepare_or_skip
from facedata.recordio import IRHeader, RecordWriter, encode_parts, pack
from utils.errors import DataError, located

FORMATS = ("jpeg", "png")
# Every file name ending Pillow decodes itself (.pgm, .ppm, .gif, ... beside the usual ones), not a list of our
# own: tools.inference reads any of them, so packing refusing one would be a surprise. Left out: save-only formats,
# stubs that need a handler Pillow lacks (HDF5, GRIB, WMF), video (MPEG) and EPS (needs Ghostscript), so that a
# video or data file beside the photos is not taken for one.
_NOT_PHOTOS = {"MPEG", "EPS"}


def _decoded_by_pillow(name: str) -> bool:
    factory = Image.OPEN.get(name, (None,))[0]
    return factory is not None and name not in _NOT_PHOTOS and not (
        isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile))


PACKABLE_SUFFIXES = tuple(sorted(suffix for suffix, name in Image.registered_extensions().items()
                                 if _decoded_by_pillow(name)))
PACKABLE_SAID = "a format Pillow reads: .jpg, .png, .webp, .bmp, .tif, .pgm, ..."


def encode(pixels: np.ndarray, image_format: str = "jpeg", quality: int = 95) -> bytes:
    """uint8 RGB (H, W, 3) -> JPEG (the insightface default) or lossless PNG bytes."""
    out = io.BytesIO()
    if image_format == "jpeg":
        Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    elif image_format == "png":
        Image.fromarray(pixels).save(out, format="PNG", compress_level=1)
    else:
        raise ValueError(f"image format {image_format!r} is not one of {FORMATS}")
    return out.getvalue()


def side_by_side(views: Sequence[np.ndarray]) -> np.ndarray:
    """V square (H, H, 3) views -> one (H, V*H, 3) record image."""
    return np.concatenate(list(views), axis=1)


class InsightfaceWriter:
    """``train.rec/.idx`` in insightface's layout, one identity at a time.

    Image records get keys 1..a-1 (label = the identity's class), identity records keys a..b-1
    (label = that identity's image key range), and key 0 a header with label (a, b). The header
    is written first as a placeholder and filled in on close, so it sits at offset 0 as mxnet's
    tools put it.
    """

    def __init__(self, out_dir: str, prefix: str = "train") -> None:
        self._made_folder = None if os.path.isdir(out_dir) else out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.rec_path = os.path.join(out_dir, f"{prefix}.rec")
        self.idx_path = os.path.join(out_dir, f"{prefix}.idx")
        self._writer = RecordWriter(self.idx_path, self.rec_path)
        self._writer.write(0, self._header(0, 0))
        self._ranges: list[tuple[int, int]] = []
        self._next_key = 1

    @staticmethod
    def _header(first_identity_key: int, end_key: int) -> bytes:
        return pack(IRHeader(0, [first_identity_key, end_key], 0, 0), b"")

    @property
    def num_records(self) -> int:
        return self._next_key - 1

    def write_identity(self, payloads: Sequence[bytes]) -> int:
        """Write one identity's encoded images; returns the class label it got (0, 1, 2, ...)."""
        label, start = len(self._ranges), self._next_key
        for payload in payloads:
            self._writer.write(self._next_key, pack(IRHeader(0, float(label), self._next_key, 0), payload))
            self._next_key += 1
        self._ranges.append((start, self._next_key))
        return label

    def close(self) -> None:
        first_identity_key = self._next_key
        for key, (start, end) in enumerate(self._ranges, first_identity_key):
            self._writer.write(key, pack(IRHeader(0, [start, end], key, 0), b""))
        self._writer.close()
        header = encode_parts(self._header(first_identity_key, first_identity_key + len(self._ranges)))
        with open(self.rec_path, "r+b") as rec:
            rec.write(header)  # same size as the placeholder: a flag-2 header never holds the magic

    def __enter__(self) -> InsightfaceWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
            return
        # A half-written dataset would load as a smaller, valid-looking one: leave nothing behind, not even the
        # folder made for it (an empty one would hold up the next try's --output).
        self._writer.close()
        os.remove(self.rec_path)
        os.remove(self.idx_path)
        if self._made_folder is not None and not os.listdir(self._made_folder):
            os.rmdir(self._made_folder)


def check_output(out_dir: str, names: Sequence[str], overwrite: bool) -> None:
    """Refuse to replace existing dataset files unless asked to."""
    existing = [name for name in names if os.path.exists(os.path.join(out_dir, name))]
    if existing and not overwrite:
        raise DataError(f"{out_dir} already holds {', '.join(existing)}; choose another output folder or pass "
                        "--overwrite")


def scan_identities(root: str) -> list[tuple[str, list[str]]]:
    """(identity name, sorted image paths) for every sub-folder of ``root`` that holds images."""
    if not os.path.isdir(root):
        raise DataError(f"input folder {located(root)} does not exist; pass a folder with one sub-folder per identity")
    identities = []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if os.path.isdir(folder):
            images = sorted(f for f in os.listdir(folder) if f.lower().endswith(PACKABLE_SUFFIXES))
            if images:
                identities.append((name, [os.path.join(folder, f) for f in images]))
    if not identities:
        raise DataError(f"{root} has no sub-folders with images ({PACKABLE_SAID}); "
                        "put each identity's images in a sub-folder of its own")
    return identities


def empty_folders(root: str) -> list[str]:
    """The sub-folders of ``root`` that hold no image (scan_identities leaves them out), sorted."""
    return [name for name in sorted(os.listdir(root)) if os.path.isdir(os.path.join(root, name))
            and not any(f.lower().endswith(PACKABLE_SUFFIXES) for f in os.listdir(os.path.join(root, name)))]


def skipped_folders_line(root: str) -> str | None:
    """One line naming the image-less sub-folders of ``root`` a tool skipped, or None when there are none."""
    empty = empty_folders(root)
    if not empty:
        return None
    return (f"skipped {len(empty)} sub-folder(s) of {root} without images ({PACKABLE_SAID}): "
            f"{', '.join(empty[:10])}{' ...' if len(empty) > 10 else ''}")


def group_views(paths: list[str], views: int) -> list[list[str]]:
    """An identity's images V at a time; the last group is topped up with the first images, so
    every record holds V different images whenever the identity has at least V."""
    groups = [paths[i:i + views] for i in range(0, len(paths), views)]
    groups[-1] += paths[:views - len(groups[-1])]
    return groups


def pack_identity(paths: list[str], views: int, preparation: Preparation, image_format: str, quality: int,
                  skip_bad: bool = False
                  ) -> tuple[list[bytes], list[tuple[str, tuple[int, int]]], list[str], set[tuple[int, int]],
                             list[tuple[str, int]]]:
    """One identity's encoded records, the photos ``resize`` stretched out of their aspect ratio
    (name, (width, height)), each once, with ``skip_bad``, why each photo left out could not be prepared
    (without it, the first such photo raises its FaceImageError), the (width, height) sizes of the photos
    fitted (for the preparation record), and the photos in which the detector found several faces (name, how
    many). No records when fewer than ``views`` photos are left."""
    skipped: list[str] | None = [] if skip_bad else None
    prepared = {path: prepare_or_skip(preparation, path, skipped) for path in paths}
    faces = {path: face for path, face in prepared.items() if face is not None}
    kept = [path for path in paths if path in faces]
    records = [encode(side_by_side([faces[path].pixels for path in group]), image_format, quality)
               for group in group_views(kept, views)] if len(kept) >= views else []
    return (records, [(path, face.stretched_from) for path, face in faces.items() if face.stretched_from],
            skipped or [], {face.photo_size for face in faces.values() if face.photo_size},
            [(path, face.faces_found) for path, face in faces.items() if face.crowded])
