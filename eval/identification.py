"""Open-set 1:N identification: probes searched in a gallery of enrolled subjects, measured as
insightface's IJB 1:N evaluation (``ijb_evals.py``'s ``evaluation_1N``) measures it.

A probe is *mated* when its subject is enrolled in the gallery (one gallery entry per subject), else
*non-mated*. For a mated probe, its mate's rank is 1 + the number of other entries scoring at least as
high (a tie counts against it). Closed-set rank-k: the fraction of mated probes whose mate is within
the top k. Open set: a non-mated probe raises a false alarm when its top score passes the threshold; a
mated probe is identified when its mate is at rank 1 and scores above the threshold.

TPIR at FPIR f, as upstream places the threshold: the ``max(int(n * f), 1)``-th highest top score of
the ``n`` non-mated probes, a probe passing only when strictly above it, so that ``int(n * f) - 1``
non-mated probes pass (none when ``n * f < 2``): the FPIR reached is at most f.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from eval.table import boxed_table

FPIRS = (0.01, 0.1)
RANKS = (1, 5, 10)


@dataclass(frozen=True)
class SearchOutcome:
    """What one gallery's search of every probe gave."""

    mate_scores: np.ndarray    # (mated,) each mated probe's similarity to its mate
    mate_ranks: np.ndarray     # (mated,) 1 = the mate scored highest
    nonmated_top: np.ndarray   # (non-mated,) each non-mated probe's highest similarity

    @property
    def mated(self) -> int:
        return self.mate_scores.size


def search_outcome(similarity: np.ndarray, probe_subjects: np.ndarray, gallery_subjects: np.ndarray) -> SearchOutcome:
    """``similarity`` (probes, gallery entries); the subjects of each probe row and gallery column."""
    gallery_subjects = np.asarray(gallery_subjects)
    if gallery_subjects.size == 0:
        raise ValueError("an empty gallery cannot be searched")
    order = np.argsort(gallery_subjects, kind="stable")
    if np.any(np.diff(gallery_subjects[order]) == 0):
        raise ValueError("a gallery enrols each subject once: the subjects of its entries must be distinct")
    probe_subjects = np.asarray(probe_subjects)
    position = np.searchsorted(gallery_subjects[order], probe_subjects).clip(max=order.size - 1)
    mated = gallery_subjects[order][position] == probe_subjects
    mates = order[position[mated]]
    mated_rows = similarity[mated]
    mate_scores = mated_rows[np.arange(mates.size), mates]
    mate_ranks = (mated_rows >= mate_scores[:, None]).sum(axis=1)  # the mate itself counts once: rank 1
    return SearchOutcome(mate_scores, mate_ranks, similarity[~mated].max(axis=1))


def rank_counts(outcome: SearchOutcome, ranks: Sequence[int] = RANKS) -> dict[int, int]:
    """Mated probes whose mate is within the top k, for each k."""
    return {k: int((outcome.mate_ranks <= k).sum()) for k in ranks}


def _check_open_set(outcome: SearchOutcome) -> None:
    if outcome.mated == 0 or outcome.nonmated_top.size == 0:
        raise ValueError(f"open-set identification needs mated and non-mated probes; got {outcome.mated} mated "
                         f"and {outcome.nonmated_top.size} non-mated")


def tpir_at_fpir(outcome: SearchOutcome, fpirs: Sequence[float] = FPIRS) -> dict[float, tuple[float, float]]:
    """``{fpir: (tpir, threshold)}`` with upstream's threshold placement (see the module doc)."""
    _check_open_set(outcome)
    identified = outcome.mate_ranks == 1
    table = {}
    for fpir in fpirs:
        threshold = threshold_at_fpir(outcome.nonmated_top, fpir)
        table[fpir] = (float((identified & (outcome.mate_scores > threshold)).sum() / outcome.mated), threshold)
    return table


def threshold_at_fpir(nonmated_top: np.ndarray, fpir: float) -> float:
    """Upstream's threshold for FPIR ``fpir`` over the non-mated probes' top scores (see the module doc): a
    probe passing strictly above it; with ``n * fpir < 2``, the highest score, which none passes."""
    descending = np.sort(nonmated_top)[::-1]
    return float(descending[max(int(descending.size * fpir) - 1, 0)])


def det_curve(outcome: SearchOutcome) -> tuple[np.ndarray, np.ndarray]:
    """``(fpir, tpir)`` at every threshold that changes the FPIR: at each non-mated top score (a probe passes
    strictly above it), highest first, then below every score (FPIR 1, TPIR = the rank-1 rate)."""
    _check_open_set(outcome)
    thresholds = np.unique(outcome.nonmated_top)[::-1]
    nonmated = np.sort(outcome.nonmated_top)
    passing = nonmated.size - np.searchsorted(nonmated, thresholds, side="right")
    identified = np.sort(outcome.mate_scores[outcome.mate_ranks == 1])
    found = identified.size - np.searchsorted(identified, thresholds, side="right")
    fpir = np.r_[passing, nonmated.size] / nonmated.size
    tpir = np.r_[found, identified.size] / outcome.mated
    return fpir, tpir


@dataclass(frozen=True)
class IdentificationRow:
    """One row of the 1:N table: TPIR per FPIR and rank-k rates (fractions)."""

    tpir: dict[float, float]
    rank: dict[int, float]


def gallery_row(outcome: SearchOutcome) -> IdentificationRow:
    counts = rank_counts(outcome)
    return IdentificationRow({fpir: tpir for fpir, (tpir, _) in tpir_at_fpir(outcome).items()},
                             {k: count / outcome.mated for k, count in counts.items()})


def mean_row(outcomes: Sequence[SearchOutcome]) -> IdentificationRow:
    """Upstream's mean over galleries: the TPIRs averaged, the rank-k counts summed over the galleries and
    divided by every gallery's mated probes together (with IJB's disjoint galleries, where each probe is
    mated in one of them, that is upstream's division by the number of probes)."""
    rows = [gallery_row(outcome) for outcome in outcomes]
    mated = sum(outcome.mated for outcome in outcomes)
    counts = [rank_counts(outcome) for outcome in outcomes]
    return IdentificationRow({fpir: float(np.mean([row.tpir[fpir] for row in rows])) for fpir in FPIRS},
                             {k: sum(count[k] for count in counts) / mated for k in RANKS})


def format_identification_table(rows: Mapping[str, IdentificationRow]) -> str:
    """One row per gallery (and the mean): TPIR at each FPIR and rank-k, in percent with two decimals."""
    header = ["Gallery"] + [f"TPIR@FPIR={fpir:g}" for fpir in FPIRS] + [f"Rank-{k}" for k in RANKS]
    body = [[name] + [f"{row.tpir[fpir] * 100:.2f}" for fpir in FPIRS] + [f"{row.rank[k] * 100:.2f}" for k in RANKS]
            for name, row in rows.items()]
    return boxed_table(header, body)
