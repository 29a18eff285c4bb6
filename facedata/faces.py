"""The face dataset: V views per sample from a source, built by :func:`build_dataset`."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
from torch.utils.data import Dataset

from facedata.augment import SampleRandom, assemble, coins
from facedata.crop_erase import CropErase, crop_resize, draw_crop_erase, erase
from facedata.dali_aug import ViewAugment, dali_augment, draw_augments
from facedata.images import decode, image_io, is_jpeg, split_views
from facedata.recordio import BadRecordError
from facedata.sources import FolderSource, RecSource, Source, SyntheticSource
from facedata.view_sources import VIEW_SOURCES
from utils.errors import DataError
from utils.image import IMAGE_SIZE

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Encoded:
    """One sample as the workers hand it over when the training process decodes (facedata/device_decode.py)."""

    index: int                          # the sample asked for: load(index, epoch) rebuilds it on the CPU
    epoch: int
    label: int
    pieces: list[bytes | torch.Tensor]  # JPEG bytes, or the decoded (3, H, W) image of another format
    piece_indices: list[int]            # the sample each piece is the image of
    flips: list[bool]
    augments: list[ViewAugment] | None
    crop_erase: list[CropErase] | None = None
    skipped: int = 0


class FaceDataset(Dataset):
    """``ds[i] -> (images uint8 (V, 3, 112, 112), label int64 scalar)``.

    ``load(index, epoch)`` is the same with the epoch's randomness; the loader calls it so that a
    sample's flips and view draws depend only on (seed, epoch, index). ``encoded(index, epoch)`` is
    the same sample with its images left encoded, for decoding in the training process.
    """

    def __init__(self, source: Source, num_views: int, view_source: str, num_classes: int, flip: bool,
                 skip_bad_records: bool, seed: int, dali_aug: bool = False,
                 crop_scale: tuple[float, float] = (1.0, 1.0), erase_p: float = 0.0) -> None:
        self.source = source
        self.num_views, self.view_source, self.num_classes = num_views, VIEW_SOURCES[view_source], num_classes
        self.flip, self.skip_bad_records, self.seed, self.dali_aug = flip, skip_bad_records, seed, dali_aug
        self.crop_scale, self.erase_p = tuple(crop_scale), erase_p
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, label, _ = self.load(index, epoch=0)
        return images, torch.tensor(label, dtype=torch.int64)

    def load(self, index: int, epoch: int) -> tuple[torch.Tensor, int, int]:
        """(images, label, records skipped to produce them); a bad record is replaced by the next
        sample (deterministically) when ``skip_bad_records`` is set."""
        (images, label), skipped = self._first_good(index, epoch, self._views)
        return images, label, skipped

    def encoded(self, index: int, epoch: int) -> Encoded:
        """``load(index, epoch)`` before decoding: the JPEG bytes and the sample's draws (see
        facedata/device_decode.py). Other image formats are decoded here, so that a bad one is
        skipped as ``load`` skips it; a bad JPEG is found by the decoder, which falls back to ``load``."""
        sample, skipped = self._first_good(index, epoch, self._encoded)
        return replace(sample, index=index, skipped=skipped)

    @property
    def crops_or_erases(self) -> bool:
        """Whether crop_scale or erase_p is on (facedata/crop_erase.py): each view then has its draws."""
        return self.crop_scale != (1.0, 1.0) or self.erase_p > 0

    def encoded_refusal(self) -> str | None:
        """Why this dataset's samples cannot be handed over encoded, or None when they can."""
        if not isinstance(self.source, (RecSource, FolderSource)):
            return "the synthetic speed mode decodes nothing"
        return self.view_source.gpu_decode_refusal

    def cut(self, image: torch.Tensor, index: int) -> list[torch.Tensor]:
        """The views sample ``index``'s decoded image holds (all V for view_source 'record', else one),
        on the image's device; DataError naming the record when its shape does not fit."""
        count = self.view_source.views_per_image(self.num_views)
        if isinstance(self.source, FolderSource) and tuple(image.shape[1:]) != (IMAGE_SIZE, count * IMAGE_SIZE):
            # Photos, not records: packing prepares them (crop, pad, landmarks...), training does not.
            raise DataError(f"{self.source.describe(index)} is {image.shape[1]}x{image.shape[2]} (HxW); "
                            f"{self.source.pack_first(count)}")
        fix = None if count == self.num_views else (
            f"view_source={self.view_source.name!r} takes one view per record; use view_source='record' for "
            "records that hold several views side by side")
        return split_views(image, count, partial(self.source.describe, index), fix)

    def _first_good(self, index: int, epoch: int, make):
        """(``make(candidate, epoch)``, records skipped) for the first candidate from ``index`` on whose
        image decodes; only ``index`` itself unless ``skip_bad_records``."""
        skipped = 0
        for attempt in range(len(self)):
            candidate = (index + attempt) % len(self)
            try:
                return make(candidate, epoch), skipped
            except BadRecordError as err:  # the next indexed record is read from its own offset: a resync
                if not self.skip_bad_records:
                    raise
                skipped += 1
                self.skipped += 1
                log.warning("skipping a bad record: %s (%d skipped so far in process %d)", err.problem, self.skipped,
                            os.getpid())
        raise DataError(f"every sample of the dataset failed to decode (the last: {self.source.describe(index)}); "
                        "check that the dataset path points at the right files")

    def _views(self, index: int, epoch: int) -> tuple[torch.Tensor, int]:
        rng = SampleRandom(self.seed, epoch, index)
        image, label = self.source.load(index)
        self._check_label(index, label)
        views = self.cut(image, index)
        for other in self._others(index, rng):
            other_image, other_label = self.source.load(other)
            self._check_same_identity(index, label, other, other_label)
            views += self.cut(other_image, other)
        views = self.view_source.finish(views, self.num_views, rng)
        flips, augments, crop_erase = self._finishing_draws(rng)
        return self.augment(assemble(views, flips), augments, crop_erase), label

    def augment(self, views: torch.Tensor, augments: list[ViewAugment] | None,
                crop_erase: list[CropErase] | None) -> torch.Tensor:
        """uint8 (N, 3, H, W) flipped views -> cropped (crop_scale), dali_aug'ed, erased (erase_p), in that
        order, with each view's draws; the workers call it on a sample's views, the training process's
        decoding (facedata/device_decode.py) on a batch's. Writes into ``views``."""
        if crop_erase is not None:
            views = crop_resize(views, crop_erase)
        if augments is not None:
            views = dali_augment(views, augments)
        if crop_erase is not None:
            views = erase(views, crop_erase)
        return views

    def _encoded(self, index: int, epoch: int) -> Encoded:
        rng = SampleRandom(self.seed, epoch, index)
        payload, label = self.source.read(index)
        self._check_label(index, label)
        pieces, piece_indices = [self._piece(payload, index)], [index]
        for other in self._others(index, rng):
            other_payload, other_label = self.source.read(other)
            self._check_same_identity(index, label, other, other_label)
            pieces.append(self._piece(other_payload, other))
            piece_indices.append(other)
        flips, augments, crop_erase = self._finishing_draws(rng)
        return Encoded(index, epoch, label, pieces, piece_indices, flips, augments, crop_erase)

    def _piece(self, payload: bytes, index: int) -> bytes | torch.Tensor:
        return payload if is_jpeg(payload) else decode(payload, partial(self.source.describe, index))

    def _finishing_draws(self, rng: SampleRandom
                         ) -> tuple[list[bool], list[ViewAugment] | None, list[CropErase] | None]:
        """The flips, then (dali_aug) the augmentations, then (crop_scale or erase_p) the crops and
        erasings: each drawn after the ones before, so that turning one on leaves those as they were."""
        flips = coins(rng, self.num_views) if self.flip else [False] * self.num_views
        augments = draw_augments(rng, self.num_views) if self.dali_aug else None
        crop_erase = (draw_crop_erase(rng, self.num_views, self.crop_scale, self.erase_p, IMAGE_SIZE)
                      if self.crops_or_erases else None)
        return flips, augments, crop_erase

    def _check_label(self, index: int, label: int) -> None:
        if not 0 <= label < self.num_classes:
            raise DataError(f"{self.source.describe(index)} has label {label}, outside 0..{self.num_classes - 1} "
                            f"(num_classes={self.num_classes}); set num_classes to at least {label + 1} "
                            "or re-pack the dataset with labels 0..C-1")

    def _check_same_identity(self, anchor: int, anchor_label: int, index: int, label: int) -> None:
        if label != anchor_label:
            raise DataError(f"{self.source.describe(index)} has label {label} but sits in the identity of "
                            f"{self.source.describe(anchor)} (label {anchor_label}); the identity table disagrees "
                            "with the labels, re-pack the dataset with tools/pack_rec.py")

    def _others(self, index: int, rng: SampleRandom) -> list[int]:
        """The samples whose images give the other views (view_source 'identity'), none otherwise."""
        return self.view_source.other_samples(self.source, index, self.num_views, rng)


def _source_for(path: str, num_views: int, view_source: str, num_classes: int | None, seed: int,
                num_samples: int | None) -> Source:
    if path == "synthetic":
        if num_classes is None:
            raise DataError("the synthetic speed mode needs num_classes; set num_classes in the config")
        return SyntheticSource(num_classes, VIEW_SOURCES[view_source].views_per_image(num_views), seed,
                               num_samples or SyntheticSource.DEFAULT_LENGTH)
    if path.endswith(".rec"):
        return RecSource(path[:-len(".rec")] + ".idx", path)
    if not os.path.isdir(path):
        raise DataError(f"dataset path {path} does not exist; set rec to a folder holding train.rec/train.idx, "
                        "an image folder with one sub-folder per identity, or 'synthetic'")
    rec = os.path.join(path, "train.rec")
    if os.path.exists(rec) or os.path.exists(os.path.join(path, "train.idx")):
        return RecSource(os.path.join(path, "train.idx"), rec)
    return FolderSource(path)


def build_dataset(path: str, num_views: int = 1, view_source: str = "record", num_classes: int | None = None,
                  flip: bool = True, skip_bad_records: bool = False, seed: int = 0, dali_aug: bool = False,
                  num_samples: int | None = None, crop_scale: tuple[float, float] = (1.0, 1.0),
                  erase_p: float = 0.0) -> FaceDataset:
    """A dataset of ``num_views`` views per sample from a ``.rec`` folder, an image folder or "synthetic".

    ``num_classes``, when given, must cover every label of the data (DataError otherwise). ``dali_aug``
    adds arcface_torch's DALI augmentation to every view (facedata/dali_aug.py), after the flip;
    ``crop_scale`` (a random resized square crop) and ``erase_p`` (random erasing) the small-data
    augmentations of facedata/crop_erase.py, the crop before dali_aug, the erasing after it.
    ``num_samples`` (arcface_torch's ``num_image``), when given, is how many samples the data must hold,
    and the length of the synthetic speed mode.
    """
    if not isinstance(num_views, int) or num_views < 1:
        raise ValueError(f"num_views must be a positive integer, got {num_views!r}")
    path = os.fspath(path)
    source = _source_for(path, num_views, view_source, num_classes, seed, num_samples)
    if num_samples is not None and len(source) != num_samples:
        raise DataError(f"{path} holds {len(source)} samples but num_image={num_samples}; set num_image = "
                        f"{len(source)} (or None) in the config")
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
    image_io()  # the decoders, imported here before the data workers fork: each would import them again
    return FaceDataset(source, num_views, view_source, source.num_classes if num_classes is None else num_classes,
                       flip, skip_bad_records, seed, dali_aug, crop_scale, erase_p)
