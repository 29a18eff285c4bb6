"""Synthetic identities: deterministic, identity carried through the samples, not solvable by raw pixels."""
from __future__ import annotations

import numpy as np
import pytest
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

from dataset import render_faces, verification_pairs


def best_threshold_accuracy(features: np.ndarray, issame: list[bool]) -> float:
    """Cosine-similarity verification accuracy at the best single threshold (an upper bound of the
    k-fold accuracy eval reports), computed in float64."""
    features = features.reshape(len(features), -1).astype(np.float64)
    features /= np.linalg.norm(features, axis=1, keepdims=True)
    similarity = (features[0::2] * features[1::2]).sum(1)
    same = np.asarray(issame)
    return max(((similarity >= t) == same).mean() for t in np.unique(similarity))


@pytest.fixture(scope="module")
def val_set():
    # Held-out identities, numbered after a 1000-identity training set as make_synthetic does.
    return verification_pairs(np.arange(1000, 1200), 600, seed=0)


def test_images_are_a_pure_function_of_seed_identity_and_sample():
    batch = render_faces([3, 7, 3], [1, 2, 5], seed=4)
    assert batch.shape == (3, 112, 112, 3) and batch.dtype == np.uint8
    assert np.array_equal(batch[1], render_faces([7], [2], seed=4)[0])
    assert np.array_equal(batch[2], render_faces(3, [5], seed=4)[0])
    assert not np.array_equal(batch[0], render_faces([3], [1], seed=5)[0])
    assert not np.array_equal(batch[0], batch[2])  # samples of one identity vary


def test_verification_pairs_are_balanced(val_set):
    images, issame = val_set
    assert images.shape == (1200, 112, 112, 3) and len(issame) == 600 and sum(issame) == 300
    positives = images[0::2][np.asarray(issame)], images[1::2][np.asarray(issame)]
    assert not any(np.array_equal(a, b) for a, b in zip(*positives))  # two different photos


def test_raw_pixels_do_not_solve_verification(val_set):
    images, issame = val_set
    assert best_threshold_accuracy(images, issame) <= 0.8
    centred = images.reshape(len(images), -1).astype(np.float64)
    assert best_threshold_accuracy(centred - centred.mean(1, keepdims=True), issame) <= 0.8


def test_identity_is_learnable_from_training_identities(val_set):
    # A linear projection (LDA on 16x16 pixels) fitted to 200 training identities already verifies
    # the held-out ones well, where raw pixels are near chance: what identifies a person survives
    # every sample's pose, light, background and occlusion, and generalises to new identities.
    identities, samples = np.repeat(np.arange(200), 8), np.tile(np.arange(8), 200)
    train = pooled(render_faces(identities, samples, seed=0))
    lda = LinearDiscriminantAnalysis(n_components=128, solver="eigen", shrinkage=0.1).fit(train, identities)
    images, issame = val_set
    embeddings = lda.transform(pooled(images))
    assert best_threshold_accuracy(embeddings - embeddings.mean(0), issame) >= 0.9
    assert best_threshold_accuracy(pooled(images), issame) <= 0.8


def pooled(images: np.ndarray) -> np.ndarray:
    """(N, 112, 112, 3) -> (N, 16 * 16 * 3): 7x7 average pooling."""
    return images.reshape(len(images), 16, 7, 16, 7, 3).mean((2, 4)).reshape(len(images), -1)
