"""Where the V views of a sample come from (config key `view_source`): one class per source, holding
everything that differs between them. A new source is a subclass here, added to `VIEW_SOURCES`, and
its name in the `view_source` Literal of configs/base.py.

Each source draws any randomness from the `SampleRandom` it is given (keyed on seed, epoch and
sample index), so that batches stay independent of the number of workers and of resume points.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from facedata.augment import SampleRandom, jitter
from facedata.sources import Source


class ViewSource:
    """How a sample's views are made from its record (and, for some sources, other records)."""

    name: str
    # Why the training process cannot decode this source's samples on the GPU (dali=True), or None
    # when it can: the GPU path decodes every record's image, cuts it into views and flips them.
    gpu_decode_refusal: str | None = None

    def views_per_image(self, num_views: int) -> int:
        """How many views one record's image holds side by side."""
        return 1

    def other_samples(self, source: Source, index: int, num_views: int, rng: SampleRandom) -> list[int]:
        """The other records whose views join sample `index`'s (drawn before the views are finished)."""
        return []

    def finish(self, views: list[np.ndarray | torch.Tensor], num_views: int,
               rng: SampleRandom) -> Sequence[np.ndarray | torch.Tensor]:
        """The sample's `num_views` views from those cut out of its records."""
        return views


class RecordViews(ViewSource):
    """The record's image holds the V views side by side (a 112 x 112V record)."""

    name = "record"

    def views_per_image(self, num_views: int) -> int:
        return num_views


class IdentityViews(ViewSource):
    """View 1 is the record; the others are other images of its identity (the record again when alone)."""

    name = "identity"

    def other_samples(self, source: Source, index: int, num_views: int, rng: SampleRandom) -> list[int]:
        members = source.identities.members(index)
        others = members[members != index]
        if len(others) == 0:
            return [index] * (num_views - 1)
        return [int(others[i]) for i in rng.picks(len(others), num_views - 1)]


class AugmentViews(ViewSource):
    """V independent augmentations (shift, brightness, contrast) of the record's one image."""

    name = "augment"
    gpu_decode_refusal = "view_source='augment' jitters decoded pixels in the data workers"

    def finish(self, views, num_views, rng):
        return [jitter(views[0], rng) for _ in range(num_views)]


VIEW_SOURCES: dict[str, ViewSource] = {source.name: source for source in (RecordViews(), IdentityViews(),
                                                                          AugmentViews())}
