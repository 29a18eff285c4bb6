"""eval.paired: the paired bootstrap verdict between two recipes, each judged by several seeds on the same pairs.

References: a model against itself and against a crippled copy of itself, and the normal approximation of the
interval of a paired difference, sqrt(var(a - b) / n) per pair, computed here."""
from __future__ import annotations

import numpy as np
import pytest

from eval.paired import paired_verdict
from eval.verification import pairs_right


def embeddings_of(num_pairs: int, noise: float, seed: int, issame: np.ndarray) -> np.ndarray:
    """Unit embeddings in which a same-person pair is two noisy copies of one vector."""
    rng = np.random.default_rng(seed)
    first = rng.standard_normal((num_pairs, 16))
    second = np.where(issame[:, None], first, rng.standard_normal((num_pairs, 16)))
    embeddings = np.empty((2 * num_pairs, 16))
    embeddings[0::2] = first + noise * rng.standard_normal(first.shape)
    embeddings[1::2] = second + noise * rng.standard_normal(first.shape)
    return embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)


ISSAME = np.r_[np.ones(300, bool), np.zeros(300, bool)]


def judged(noise: float, seeds=(0, 1, 2)) -> np.ndarray:
    """(seeds, pairs): each 'trained model' (a seed of the same world, its own noise draw) judging every pair."""
    return np.stack([pairs_right(embeddings_of(ISSAME.size, noise, 100 + seed, ISSAME), ISSAME) for seed in seeds])


def test_a_model_against_itself_can_t_tell():
    right = judged(0.8)
    verdict = paired_verdict(right, right)
    assert verdict.word == "can't tell" and verdict.difference == 0.0 and verdict.low <= 0 <= verdict.high
    assert str(verdict).startswith("can't tell: +0.0p [")


def test_a_model_against_a_crippled_copy_of_itself_is_better_and_the_copy_worse():
    good, crippled = judged(0.8), judged(1.6)
    assert good.mean() > crippled.mean() + 0.05
    verdict = paired_verdict(good, crippled)
    assert verdict.word == "better" and verdict.low > 0 and verdict.difference == good.mean() - crippled.mean()
    assert paired_verdict(crippled, good).word == "worse"


def test_with_one_seed_the_interval_is_the_paired_difference_s_normal_interval():
    a, b = judged(0.9, seeds=(0,)), judged(1.1, seeds=(5,))
    verdict = paired_verdict(a, b, rounds=20000)
    per_pair = a[0].astype(float) - b[0].astype(float)
    half_width = 1.96 * per_pair.std() / np.sqrt(per_pair.size)
    assert (verdict.high - verdict.low) / 2 == pytest.approx(half_width, rel=0.1)
    assert (verdict.low + verdict.high) / 2 == pytest.approx(per_pair.mean(), abs=0.2 * half_width)


def test_recipes_judged_on_different_pairs_are_refused():
    with pytest.raises(ValueError, match="600 and 599 pairs"):
        paired_verdict(judged(1.0, (0,)), judged(1.0, (0,))[:, :599])
