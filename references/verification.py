"""Upstream's 1:1 verification, one threshold at a time: insightface's calculate_roc / calculate_val with
sklearn's KFold, the reference eval.verification is checked against (tests/test_verification.py) and timed
against (bench/bench_eval.py); and the planted pairs both run it on.
"""
from __future__ import annotations

import numpy as np
from sklearn.model_selection import KFold


def _reference_accuracy(threshold, dist, issame):
    predict = np.less(dist, threshold)
    tp = np.sum(predict & issame)
    fp = np.sum(predict & ~issame)
    tn = np.sum(~predict & ~issame)
    fn = np.sum(~predict & issame)
    tpr = 0 if tp + fn == 0 else tp / (tp + fn)
    fpr = 0 if fp + tn == 0 else fp / (fp + tn)
    return tpr, fpr, (tp + tn) / dist.size


def _reference_val_far(threshold, dist, issame):
    predict = np.less(dist, threshold)
    with np.errstate(invalid="ignore"):  # a fold without genuine pairs: nan, as upstream
        return np.sum(predict & issame) / np.sum(issame), np.sum(predict & ~issame) / np.sum(~issame)


def _reference_threshold_at_far(far, thresholds, target):
    """Walk the piecewise-linear FAR(threshold) curve to the last segment starting at or below target
    (what scipy's interp1d(kind="slinear") returned before it refused repeated FAR values)."""
    if far.max() < target:
        return 0.0
    for i in range(len(far) - 1):
        if far[i] <= target < far[i + 1]:
            return thresholds[i] + (target - far[i]) / (far[i + 1] - far[i]) * (thresholds[i + 1] - thresholds[i])
    return thresholds[-1]


def reference_evaluate(embeddings, issame, nrof_folds=10, folds=None):
    """Upstream's evaluate on KFold's contiguous folds, or on ``folds`` when given."""
    issame = np.asarray(issame)
    dist = np.sum((embeddings[0::2] - embeddings[1::2]) ** 2, axis=1)
    if folds is None:
        folds = list(KFold(n_splits=nrof_folds, shuffle=False).split(np.arange(issame.size)))
    nrof_folds = len(folds)
    thresholds = np.arange(0, 4, 0.01)
    tprs = np.zeros((nrof_folds, thresholds.size))
    fprs = np.zeros((nrof_folds, thresholds.size))
    accuracy = np.zeros(nrof_folds)
    for f, (train, test_set) in enumerate(folds):
        train_acc = [_reference_accuracy(t, dist[train], issame[train])[2] for t in thresholds]
        for i, t in enumerate(thresholds):
            tprs[f, i], fprs[f, i], _ = _reference_accuracy(t, dist[test_set], issame[test_set])
        accuracy[f] = _reference_accuracy(thresholds[np.argmax(train_acc)], dist[test_set], issame[test_set])[2]
    thresholds = np.arange(0, 4, 0.001)
    vals, fars = np.zeros(nrof_folds), np.zeros(nrof_folds)
    for f, (train, test_set) in enumerate(folds):
        far_train = np.array([_reference_val_far(t, dist[train], issame[train])[1] for t in thresholds])
        threshold = _reference_threshold_at_far(far_train, thresholds, 1e-3)
        vals[f], fars[f] = _reference_val_far(threshold, dist[test_set], issame[test_set])
    return tprs.mean(0), fprs.mean(0), accuracy, vals.mean(), vals.std(), fars.mean()


def planted_pairs(num_pairs, dim, noise, seed):
    """Unit embeddings: genuine pairs are noisy copies of one vector, impostor pairs independent."""
    rng = np.random.default_rng(seed)
    issame = rng.random(num_pairs) < 0.5
    first = rng.standard_normal((num_pairs, dim))
    second = np.where(issame[:, None], first + noise * rng.standard_normal((num_pairs, dim)),
                      rng.standard_normal((num_pairs, dim)))
    embeddings = np.empty((2 * num_pairs, dim))
    embeddings[0::2], embeddings[1::2] = first, second
    return embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True), issame.tolist()
