"""Whether one training recipe verifies better than another: a paired bootstrap over pairs and seeds.

Each recipe is trained with several seeds; each trained model judges every pair of one verification set right or
wrong at its own threshold (``eval.verification.pairs_right``: Accuracy-Flip pair by pair). The two recipes are
compared on the same pairs: a bootstrap round draws the pairs with replacement (the set is a sample of the
world's pairs) and each recipe's seeds with replacement (a seed is a sample of the training runs the recipe
could have given), and takes the difference of the mean accuracies. The interval of those differences decides:
"better" when it lies above zero, "worse" below, "can't tell" when it holds zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROUNDS = 4000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Verdict:
    difference: float  # mean accuracy of the first recipe minus the second's, over their seeds and the set's pairs
    low: float         # the bootstrap interval of that difference
    high: float

    @property
    def word(self) -> str:
        if self.low > 0:
            return "better"
        if self.high < 0:
            return "worse"
        return "can't tell"

    def __str__(self) -> str:
        return (f"{self.word}: {100 * self.difference:+.1f}p "
                f"[{100 * self.low:+.1f}, {100 * self.high:+.1f}] ({CONFIDENCE:.0%})")


def _per_seed_accuracy(right: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """(rounds, seeds): each seed's accuracy on each round's pairs, a pair counted as often as it was drawn."""
    return draws @ right.T.astype(np.float64) / right.shape[1]


def paired_verdict(right_a: np.ndarray, right_b: np.ndarray, rounds: int = ROUNDS, seed: int = 0) -> Verdict:
    """Recipe A against recipe B. ``right_a``: (seeds of A, pairs) booleans, whether each of A's models judged each
    pair right; ``right_b`` the same of B on the same pairs in the same order."""
    right_a, right_b = np.atleast_2d(right_a), np.atleast_2d(right_b)
    if right_a.shape[1] != right_b.shape[1]:
        raise ValueError(f"the recipes were judged on {right_a.shape[1]} and {right_b.shape[1]} pairs; a paired "
                         "comparison needs the same pairs")
    rng = np.random.default_rng(seed)
    num_pairs = right_a.shape[1]
    draws = rng.multinomial(num_pairs, np.full(num_pairs, 1.0 / num_pairs), size=rounds)
    means = []
    for right in (right_a, right_b):
        accuracy = _per_seed_accuracy(right, draws)
        seeds = rng.integers(0, right.shape[0], size=(rounds, right.shape[0]))
        means.append(np.take_along_axis(accuracy, seeds, axis=1).mean(axis=1))
    differences = means[0] - means[1]
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(differences, [tail, 1 - tail])
    return Verdict(float(right_a.mean() - right_b.mean()), float(low), float(high))
