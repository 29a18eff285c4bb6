"""experiments.noisy_labels' own arithmetic: the labels it corrupts on purpose (read back record by record) and
the precision and recall it reports (hand-worked numbers). The runs themselves are train.py's and tools.clean_rec's,
tested where they live."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from dataset import RecordReader, unpack
from experiments.noisy_labels import Found, corrupt


def records(folder) -> list[tuple[int, bytes]]:
    """(label, image bytes) of every image record, in key order."""
    reader = RecordReader(str(folder / "train.idx"), str(folder / "train.rec"))
    first_identity = int(unpack(reader.read(0))[0].label[0])
    return [(int(header.label), payload) for header, payload in (unpack(reader.read(key))
                                                                  for key in range(1, first_identity))]


def test_the_moved_photos_are_the_ones_noise_json_names_and_nothing_else_changed(data, tmp_path):
    """20 people of 2 records each: half their records (20) move, each to another person; the others keep theirs,
    numbered in the old order."""
    noisy = corrupt(data, tmp_path / "noisy", 0.5, seed=3)
    truth = json.loads((noisy / "noise.json").read_text())
    before, after = records(data), records(noisy)
    assert Counter(payload for _, payload in after) == Counter(payload for _, payload in before)
    assert len(truth["moved_keys"]) == 20 and truth["records"] == 40
    person = {payload: label for label, payload in before}
    moved = set(truth["moved_keys"])
    stayed: dict[int, set[int]] = {label: set() for label, _ in after}  # the people whose own photos each class holds
    for key, (label, payload) in enumerate(after, 1):
        if key not in moved:
            stayed[label].add(person[payload])
    # each class holds one person's own photos, in the people's old order
    assert all(len(people) <= 1 for people in stayed.values())
    owners = [next(iter(people)) for _, people in sorted(stayed.items()) if people]
    assert owners == sorted(owners) and len(set(owners)) == len(owners)
    for key in moved:
        label, payload = after[key - 1]
        assert person[payload] not in stayed[label]  # moved to someone else
    labels = [label for label, _ in after]
    assert labels == sorted(labels) and sorted(set(labels)) == list(range(truth["classes"]))


def test_precision_recall_and_noise_left_by_hand():
    """Angles 10, 80, 85, 30 and 90 degrees, the photos at 80 and 30 moved: at 75, 80 / 85 / 90 are dropped, one
    of them moved (precision 1/3), one of the two moved caught (recall 1/2), one moved left among the 2 kept."""
    found = Found(1, np.array([10.0, 80, 85, 30, 90]), np.array([False, True, False, True, False]),
                  np.array([1, 2, 2, 2, 1]))
    assert found.at(75) == pytest.approx((1 / 3, 1 / 2, 1 / 2, 3 / 5))
    assert found.at(95) == pytest.approx((0, 0, 2 / 5, 0))
