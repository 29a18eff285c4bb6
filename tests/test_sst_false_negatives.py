"""experiments.sst_false_negatives against every draw of a sampler small enough to enumerate."""
import itertools

import numpy as np
import pytest

from experiments.sst_false_negatives import false_negatives, shallow


def enumerated(sizes: list[int], others: int) -> tuple[float, float]:
    """Every record as the probe, every set of ``others`` of the remaining records equally likely: the mean count
    of its identity among them, and the share of (probe, draw) cases with at least one."""
    labels = [identity for identity, size in enumerate(sizes) for _ in range(size)]
    counts = []
    for probe, label in enumerate(labels):
        rest = labels[:probe] + labels[probe + 1:]
        counts += [sum(other == label for other in draw) for draw in itertools.combinations(rest, others)]
    per_probe = len(counts) // len(labels)  # the same number of draws for every probe
    counts = np.array(counts).reshape(len(labels), per_probe)
    return counts.mean(), (counts > 0).mean()


@pytest.mark.parametrize("sizes", [[3, 1, 1, 1], [4, 2, 2, 1, 1], [2, 2, 2, 2]])
@pytest.mark.parametrize("others", [1, 3])
def test_counts_equal_every_draw_enumerated(sizes, others):
    mean, share = false_negatives(np.array(sizes), others)
    expected_mean, expected_share = enumerated(sizes, others)
    assert mean == pytest.approx(expected_mean, abs=1e-12)
    assert share == pytest.approx(expected_share, abs=1e-12)


def test_a_queue_longer_than_an_epoch_is_refused():
    with pytest.raises(ValueError, match="longer than an epoch"):
        false_negatives(shallow(9), 9)


def test_shallow_layout_keeps_the_record_count():
    assert shallow(7).tolist() == [2, 2, 2, 1]
