"""How often semi-siamese training scores a probe against photos of its own identity as if they were strangers.

    python -m experiments.sst_false_negatives data/lfw_bench/lfw_devtrain [--batch 64] [--queues 256 1024 4096 8192]

SST (issue 51) has no labels in its loss: a probe's one positive is its own record's gallery feature, and every
other feature scored with it (the rest of the step's gallery features and the queue's) counts as another person.
That holds on shallow data, where a person has a photo or two; a person with many photos in the data also has
features in the queue, which the loss pushes away from the probe. This script counts them from a training set's
labels under the training sampler (records shuffled each epoch, ``--batch`` records a step, one gallery feature
a record enqueued: ``sst_enqueue = "one"``): among the W = queue + batch - 1 other features a probe is scored
against, the expected number of its own identity, hypergeometric over the epoch's shuffle,
W (n - 1) / (N - 1) for a person with n of the N records, and the share of probes with at least one. Beside the
data's own row, the same number of records laid out shallow (two photos per person, FaceX-Zoo's MS-Celeb split)
shows what SST assumes.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def identity_sizes(data: Path) -> np.ndarray:
    """Records per identity of an insightface train.rec/train.idx (the header's image keys 1..a-1)."""
    from dataset import RecordReader, unpack  # noqa: PLC0415
    from facedata.recordio import header_label  # noqa: PLC0415

    reader = RecordReader(str(data / "train.idx"), str(data / "train.rec"))
    first_identity_key = int(unpack(reader.read(0))[0].label[0])
    labels = Counter(int(header_label(reader.read_header(key))) for key in range(1, first_identity_key))
    return np.array(sorted(labels.values(), reverse=True))


def false_negatives(sizes: np.ndarray, others: int) -> tuple[float, float]:
    """Mean same-identity features among ``others`` drawn without replacement from the other N - 1 records, and
    the share of probes with at least one, each probe weighted as the sampler draws it (by its identity's records)."""
    total = int(sizes.sum())
    if others > total - 1:
        raise ValueError(f"a queue of {others} features is longer than an epoch of {total} records")
    weight = sizes / total
    mean = float(np.sum(weight * others * (sizes - 1) / (total - 1)))
    # P(none of the n - 1 same-identity records among `others` of N - 1): C(N - n, W) / C(N - 1, W)
    log_none = np.array([math.lgamma(total - n + 1) - math.lgamma(total - n - others + 1)
                         - math.lgamma(total) + math.lgamma(total - others) if total - n >= others else -math.inf
                         for n in sizes])
    return mean, float(np.sum(weight * (1 - np.exp(log_none))))


def shallow(records: int) -> np.ndarray:
    """``records`` laid out two a person (one person with one if odd)."""
    return np.array([2] * (records // 2) + [1] * (records % 2))


def table(sizes: np.ndarray, batch: int, queues: Sequence[int], name: str) -> str:
    lines = [f"{name}: {sizes.size:,} identities, {int(sizes.sum()):,} records, {int(np.sum(sizes == 1)):,} with "
             f"one record, the largest {int(sizes[0])}; {batch} records a step",
             f"{'layout':<28}{'queue':>7}{'same-identity negatives a probe':>33}{'probes with one or more':>25}"]
    for label, layout in ((name, sizes), ("shallow (2 a person)", shallow(int(sizes.sum())))):
        for queue in queues:
            try:
                mean, share = false_negatives(layout, queue + batch - 1)
            except ValueError:  # the queue would hold the probe's own record from an epoch before
                lines.append(f"{label:<28}{queue:>7}{'longer than an epoch':>33}")
                continue
            lines.append(f"{label:<28}{queue:>7}{mean:>33.2f}{share:>25.1%}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="a folder with train.rec and train.idx")
    parser.add_argument("--batch", type=int, default=64, help="records a step (configs/lfw_r18_sst.py: 64)")
    parser.add_argument("--queues", type=int, nargs="+", default=[256, 1024, 4096, 8192], help="sst_queue_size values")
    args = parser.parse_args(argv)
    print(table(identity_sizes(args.data), args.batch, args.queues, args.data.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
