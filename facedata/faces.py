"""The face dataset: V views per sample from a source, built by :func:`build_dataset`."""
from __future__ import annotations

import logging
import os
from functools import partial
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from facedata.augment import SampleRandom, assemble, coins, jitter
from facedata.dali_aug import dali_augment, draw_augments
from facedata.errors import DataError
from facedata.images import BadImageError, split_views
from facedata.sources import FolderSource, RecSource, Source, SyntheticSource

log = logging.getLogger(__name__)

ViewSource = Literal["record", "identity", "augment"]  # the config loader checks the user's choice


class FaceDataset(Dataset):
    """``ds[i] -> (images uint8 (V, 3, 112, 112), label int64 scalar)``.

    ``load(index, epoch)`` is the same with the epoch's randomness; the loader calls it so that a
    sample's flips and view draws depend only on (seed, epoch, index).
    """

    def __init__(self, source: Source, num_views: int, view_source: ViewSource, num_classes: int, flip: bool,
                 skip_bad_records: bool, seed: int, dali_aug: bool = False) -> None:
        self.source = source
        self.num_views, self.view_source, self.num_classes = num_views, view_source, num_classes
        self.flip, self.skip_bad_records, self.seed, self.dali_aug = flip, skip_bad_records, seed, dali_aug
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, label, _ = self.load(index, epoch=0)
        return images, torch.tensor(label, dtype=torch.int64)

    def load(self, index: int, epoch: int) -> tuple[torch.Tensor, int, int]:
        """(images, label, records skipped to produce them); a bad record is replaced by the next
        sample (deterministically) when ``skip_bad_records`` is set."""
        skipped = 0
        for attempt in range(len(self)):
            candidate = (index + attempt) % len(self)
            try:
                images, label = self._views(candidate, epoch)
                return images, label, skipped
            except BadImageError as err:
                if not self.skip_bad_records:
                    raise
                skipped += 1
                self.skipped += 1
                log.warning("skipping a bad record: %s (%d skipped so far in process %d)", err, self.skipped,
                            os.getpid())
        raise DataError(f"every sample of the dataset failed to decode (the last: {self.source.describe(index)}); "
                        "check that the dataset path points at the right files")

    def _views(self, index: int, epoch: int) -> tuple[torch.Tensor, int]:
        rng = SampleRandom(self.seed, epoch, index)
        image, label = self._checked(index)
        if self.view_source == "record":
            views = split_views(image, self.num_views, partial(self.source.describe, index))
        elif self.view_source == "identity":
            views = [self._single_view(image, index)] + [self._same_identity_view(index, label, other)
                                                         for other in self._draw_others(index, rng)]
        else:  # "augment"
            view = self._single_view(image, index)
            views = [jitter(view, rng) for _ in range(self.num_views)]
        flips = coins(rng, self.num_views) if self.flip else [False] * self.num_views
        images = assemble(views, flips)
        if self.dali_aug:  # drawn after the flips, so that turning it on leaves the flips as they were
            images = dali_augment(images, draw_augments(rng, self.num_views))
        return images, label

    def _checked(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.source.load(index)
        if not 0 <= label < self.num_classes:
            raise DataError(f"{self.source.describe(index)} has label {label}, outside 0..{self.num_classes - 1} "
                            f"(num_classes={self.num_classes}); set num_classes to at least {label + 1} "
                            "or re-pack the dataset with labels 0..C-1")
        return image, label

    def _draw_others(self, index: int, rng: SampleRandom) -> list[int]:
        """The other views' samples: other images of the identity (the anchor itself when alone)."""
        members = self.source.identities.members(index)
        others = members[members != index]
        if len(others) == 0:
            return [index] * (self.num_views - 1)
        return [int(others[i]) for i in rng.picks(len(others), self.num_views - 1)]

    def _same_identity_view(self, anchor: int, anchor_label: int, index: int) -> np.ndarray:
        image, label = self._checked(index)
        if label != anchor_label:
            raise DataError(f"{self.source.describe(index)} has label {label} but sits in the identity of "
                            f"{self.source.describe(anchor)} (label {anchor_label}); the identity table disagrees "
                            "with the labels, re-pack the dataset with tools/pack_rec.py")
        return self._single_view(image, index)

    def _single_view(self, image: torch.Tensor, index: int) -> np.ndarray:
        fix = (f"view_source={self.view_source!r} takes one view per record; use view_source='record' "
               "for records that hold several views side by side")
        return split_views(image, 1, partial(self.source.describe, index), fix)[0]


def _source_for(path: str, num_views: int, view_source: ViewSource, num_classes: int | None, seed: int) -> Source:
    if path == "synthetic":
        if num_classes is None:
            raise DataError("the synthetic speed mode needs num_classes; set num_classes in the config")
        return SyntheticSource(num_classes, num_views if view_source == "record" else 1, seed)
    if path.endswith(".rec"):
        return RecSource(path[:-len(".rec")] + ".idx", path)
    if not os.path.isdir(path):
        raise DataError(f"dataset path {path} does not exist; set rec to a folder holding train.rec/train.idx, "
                        "an image folder with one sub-folder per identity, or 'synthetic'")
    rec = os.path.join(path, "train.rec")
    if os.path.exists(rec) or os.path.exists(os.path.join(path, "train.idx")):
        return RecSource(os.path.join(path, "train.idx"), rec)
    return FolderSource(path)


def build_dataset(path: str, num_views: int = 1, view_source: ViewSource = "record", num_classes: int | None = None,
                  flip: bool = True, skip_bad_records: bool = False, seed: int = 0, dali_aug: bool = False
                  ) -> FaceDataset:
    """A dataset of ``num_views`` views per sample from a ``.rec`` folder, an image folder or "synthetic".

    ``num_classes``, when given, must cover every label of the data (DataError otherwise). ``dali_aug``
    adds arcface_torch's DALI augmentation to every view (facedata/dali_aug.py), after the flip.
    """
    if not isinstance(num_views, int) or num_views < 1:
        raise DataError(f"num_views must be a positive integer, got {num_views!r}; set it to 1 for plain datasets")
    path = os.fspath(path)
    source = _source_for(path, num_views, view_source, num_classes, seed)
    if num_classes is not None and source.labels is not None and source.labels.max() >= num_classes:
        bad = int(np.argmax(source.labels >= num_classes))
        raise DataError(f"{source.describe(bad)} has label {source.labels[bad]} but num_classes={num_classes}; "
                        f"set num_classes = {source.num_classes} in the config or re-pack the dataset")
    if num_classes is not None and source.num_classes > num_classes:
        raise DataError(f"{path} holds {source.num_classes} classes (labels 0..{source.num_classes - 1}) but "
                        f"num_classes={num_classes}; set num_classes = {source.num_classes} in the config")
    if num_classes is not None and num_classes > source.num_classes:
        log.info("%s holds %d classes; the classifier gets num_classes=%d as configured",
                 path, source.num_classes, num_classes)
    return FaceDataset(source, num_views, view_source, source.num_classes if num_classes is None else num_classes,
                       flip, skip_bad_records, seed, dali_aug)
