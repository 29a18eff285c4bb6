"""Where samples come from: an insightface ``.rec/.idx`` pair, an image folder, or speed-mode noise.

A source numbers its samples 0..N-1 and, for each, gives the decoded image (or, from files, its
encoded bytes), the label, the samples of the same identity and a description for error messages. Identities are kept as
contiguous groups in an ordering of the samples, so "the other images of this identity" is one
slice, without a per-sample Python list even for millions of images.
"""
from __future__ import annotations

import logging
import os
from functools import cached_property, partial
from typing import Protocol

import numpy as np
import torch

from facedata.images import decode
from facedata.recordio import RecordReader, header_label, unpack
from utils.errors import DataError
from utils.image import IMAGE_SIZE

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


class Source(Protocol):
    """What the dataset needs from where its samples come from."""

    num_classes: int
    labels: np.ndarray | None  # every sample's label when known without decoding, else None
    identities: IdentityTable

    def __len__(self) -> int: ...

    def describe(self, index: int) -> str: ...

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        """(uint8 (3, H, W) image, label); the image must not be written to."""


class IdentityTable:
    """Groups of sample indices: ``order[bounds[g]:bounds[g + 1]]`` are the samples of group g."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray) -> None:
        self.order, self.bounds = order, bounds
        is_identity_order = np.array_equal(order, np.arange(len(order)))
        self._position = None if is_identity_order else np.argsort(order)

    @classmethod
    def from_labels(cls, labels: np.ndarray) -> IdentityTable:
        order = np.argsort(labels, kind="stable")
        bounds = np.searchsorted(labels[order], np.arange(labels.max() + 2 if len(labels) else 1))
        return cls(order, bounds)

    def members(self, index: int) -> np.ndarray:
        position = index if self._position is None else int(self._position[index])
        group = int(np.searchsorted(self.bounds, position, side="right")) - 1
        if group < 0 or group + 1 >= len(self.bounds):
            return np.array([index])
        return self.order[self.bounds[group]:self.bounds[group + 1]]


class RecSource:
    """An insightface ``train.rec``: key 0 a header (flag > 0: images 1..a-1, identity records a..b-1
    each holding its image key range), or a flat file where every record is an image."""

    def __init__(self, idx_path: str, rec_path: str) -> None:
        self.reader = RecordReader(idx_path, rec_path)
        header, payload = unpack(self.reader.read(0)) if 0 in self.reader else (None, b"")
        if header is not None and header.flag > 0:
            self._init_identity_layout(int(header.label[0]), int(header.label[1]))
        else:
            # A flag-0 key 0 with no payload is a header without a table; one with a payload is an image.
            self._init_flat_layout(include_key0=bool(payload))

    def _init_identity_layout(self, first_identity_key: int, end_key: int) -> None:
        self.keys = np.arange(1, first_identity_key, dtype=np.int64)
        ranges = np.array([unpack(self.reader.read(key))[0].label[:2] for key in range(first_identity_key, end_key)],
                          dtype=np.int64).reshape(-1, 2)
        contiguous = (len(ranges) == 0 or ranges[0, 0] == 1 and ranges[-1, 1] == first_identity_key
                      and np.array_equal(ranges[1:, 0], ranges[:-1, 1]))
        if not contiguous:
            raise DataError(f"{self.reader.rec_path}: the identity records (keys {first_identity_key}..{end_key - 1}) "
                            f"do not cover image keys 1..{first_identity_key - 1} in consecutive ranges; "
                            "re-pack the dataset with tools/pack_rec.py")
        self.num_classes = len(ranges)
        self.labels = None  # per-image labels are only read with the images
        # Image key k is sample k - 1, so the identity ranges are already groups in sample order.
        self.identities = IdentityTable(np.arange(len(self.keys)), np.append(ranges[:, 0], first_identity_key) - 1)

    def _init_flat_layout(self, include_key0: bool) -> None:
        self.keys = np.asarray([k for k in self.reader.keys if k != 0 or include_key0], dtype=np.int64)
        log.info("%s has no identity table; reading %d record headers for labels", self.reader.rec_path,
                 len(self.keys))
        labels = np.array([header_label(self.reader.read_header(int(k))) for k in self.keys], dtype=np.int64)
        if len(labels) == 0:
            raise DataError(f"{self.reader.rec_path} holds no image records; pack a dataset with tools/pack_rec.py")
        if labels.min() < 0:
            bad = int(np.argmin(labels))
            raise DataError(f"{self.describe(bad)} has negative label {labels[bad]}; labels must be 0..C-1, re-pack")
        self.num_classes = int(labels.max()) + 1
        self.labels = labels
        self.identities = IdentityTable.from_labels(labels)

    def __len__(self) -> int:
        return len(self.keys)

    def describe(self, index: int) -> str:
        return f"{self.reader.rec_path} record key {int(self.keys[index])}"

    def read(self, index: int) -> tuple[bytes, int]:
        header, payload = unpack(self.reader.read(int(self.keys[index])))
        return payload, int(header_label(header))

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        payload, label = self.read(index)
        return decode(payload, partial(self.describe, index)), label


class FolderSource:
    """``root/<identity>/<image>``: one sub-folder per identity, classes numbered in sorted order."""

    def __init__(self, root: str) -> None:
        self.root = root
        paths, counts = [], []
        for name in sorted(os.listdir(root)):
            folder = os.path.join(root, name)
            if not os.path.isdir(folder):
                continue
            images = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_SUFFIXES))
            if images:
                paths += [os.path.join(folder, f) for f in images]
                counts.append(len(images))
        if not paths:
            raise DataError(f"{root} holds neither train.rec/train.idx nor identity sub-folders with images "
                            f"({', '.join(IMAGE_SUFFIXES)}); point the dataset path at one of those")
        self.paths = paths
        self.num_classes = len(counts)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        self.labels = np.repeat(np.arange(len(counts)), counts)
        self.identities = IdentityTable(np.arange(len(paths)), bounds)

    def __len__(self) -> int:
        return len(self.paths)

    def describe(self, index: int) -> str:
        return f"image {self.paths[index]}"

    def pack_first(self, views: int) -> str:
        """What to do with photos that are not already 112x112 faces (`views` side by side): pack the folder,
        which prepares every photo, and train on the records."""
        packed = f"{self.root.rstrip(os.sep)}_packed"
        return (f"an image folder trains on photos that are {IMAGE_SIZE}x{views * IMAGE_SIZE} faces already; pack "
                f"it first, which prepares every photo: python -m tools.pack_rec {self.root} {packed} --views "
                f"{views} --crop (or --resize, --pad, --landmarks FILE), then train with --set rec={packed}")

    def read(self, index: int) -> tuple[bytes, int]:
        with open(self.paths[index], "rb") as f:
            return f.read(), int(self.labels[index])

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        payload, label = self.read(index)
        return decode(payload, partial(self.describe, index)), label


class SyntheticSource:
    """arcface_torch's speed mode: one fixed random image for every sample, nothing decoded."""

    DEFAULT_LENGTH = 1_000_000

    def __init__(self, num_classes: int, views_per_image: int, seed: int, length: int = DEFAULT_LENGTH) -> None:
        self.length = length
        generator = torch.Generator().manual_seed(seed)
        self.image = torch.randint(0, 256, (3, IMAGE_SIZE, IMAGE_SIZE * views_per_image), dtype=torch.uint8,
                                   generator=generator)
        self.num_classes = num_classes
        self.labels = None

    @cached_property
    def identities(self) -> IdentityTable:
        """Sample i belongs to identity i % num_classes (built only when the identity view source asks)."""
        return IdentityTable.from_labels(np.arange(self.length) % self.num_classes)

    def __len__(self) -> int:
        return self.length

    def describe(self, index: int) -> str:
        return f"synthetic sample {index}"

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        return self.image, index % self.num_classes  # shared: the dataset copies views, never writes here


def classes_in_header(rec: str) -> int | None:
    """The number of identities the header record of config key ``rec``'s train.rec gives (insightface's
    layout: key 0's label (a, b), identities a..b-1), read alone; None when there is no such header or it
    cannot be read (a dry run plans without it, and training then reads the data whole)."""
    rec_path, idx_path = os.path.join(rec, "train.rec"), os.path.join(rec, "train.idx")
    if not (os.path.isfile(rec_path) and os.path.isfile(idx_path)):
        return None
    try:
        reader = RecordReader(idx_path, rec_path)
        header = unpack(reader.read(0))[0] if 0 in reader else None
    except (DataError, OSError, ValueError):
        return None
    if header is None or header.flag <= 0:
        return None
    return int(header.label[1]) - int(header.label[0])
