"""The cross-validation folds of pair verification, each holding same-person and different-person pairs.

arcface_torch cuts a set into contiguous folds (sklearn's unshuffled KFold), which is right for its own lfw.bin,
cfp_fp.bin and agedb_30.bin: each of their folds holds 300 same and 300 different pairs. A pairs file that lists
all its same-person pairs first (LFW's pairsDevTest.txt: 500, then 500) cut the same way gives folds of one kind
each; a fold's "accuracy" is then its TPR or its TNR at a threshold chosen on the others, and a collapsed model
(every embedding equal) reads 0.0 instead of 0.5. Such a set is cut into stratified contiguous folds instead:
fold i holds the i-th contiguous run of the same-person pairs and the i-th run of the different-person pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Split = tuple[np.ndarray, np.ndarray]  # (train indices, test indices) into the set's pairs


@dataclass(frozen=True)
class Folds:
    splits: list[Split]
    note: str | None  # one line when the folds are not upstream's contiguous ones; None when they are


def _contiguous(indices: np.ndarray, parts: int) -> list[np.ndarray]:
    """KFold's unshuffled cut of ``indices``: ``parts`` contiguous runs, the first ones one longer."""
    return np.array_split(indices, parts)


def _splits(tests: list[np.ndarray], num_pairs: int) -> list[Split]:
    everything = np.arange(num_pairs)
    if len(tests) == 1:  # upstream's LFold for a single split: train and test on the whole set
        return [(everything, everything)]
    return [(np.setdiff1d(everything, test, assume_unique=True), test) for test in tests]


def verification_folds(issame: np.ndarray, nrof_folds: int) -> Folds:
    """The folds Accuracy-Flip is scored on.

    Upstream's contiguous folds whenever every one of them holds both kinds of pair; otherwise
    ``min(nrof_folds, same, different)`` stratified contiguous folds. A set with one fold (a single same and a
    single different pair at least) is its own train and test set, as upstream scores a single split. A set that
    holds one kind of pair only has no fold that can measure accuracy: a ValueError saying so.
    """
    issame = np.asarray(issame, dtype=bool)
    num_pairs = issame.size
    same, different = np.flatnonzero(issame), np.flatnonzero(~issame)
    if same.size == 0 or different.size == 0:
        kind = "same-person" if different.size == 0 else "different-person"
        raise ValueError(f"the set holds {num_pairs} {kind} pairs and no others; verification accuracy needs both "
                         "kinds in every fold")
    contiguous = _contiguous(np.arange(num_pairs), min(nrof_folds, num_pairs))
    if all(issame[test].any() and not issame[test].all() for test in contiguous):
        return Folds(_splits(contiguous, num_pairs), None)
    folds = min(nrof_folds, same.size, different.size)
    tests = [np.sort(np.concatenate(runs)) for runs in zip(_contiguous(same, folds), _contiguous(different, folds))]
    reason = ("contiguous folds would hold one kind of pair only" if len(contiguous) == folds
              else f"{min(same.size, different.size)} pairs of one kind cannot fill {nrof_folds} folds")
    sizes = sorted({(int(issame[test].sum()), int((~issame[test]).sum())) for test in tests}, reverse=True)
    return Folds(_splits(tests, num_pairs),
                 f"{reason}: scored on {folds} stratified fold{'s' if folds > 1 else ''} of "
                 f"{' or '.join(f'{s} same + {d} different' for s, d in sizes)} pairs")
