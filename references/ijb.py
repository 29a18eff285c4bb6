"""Upstream's IJB template pooling and scores, loop for loop: arcface_torch's image2template_feature and its
verification, the reference eval.ijb is checked against (tests/test_ijb.py, tests/test_eval_cli.py) and timed
against (bench/bench_eval.py).
"""
from __future__ import annotations

import numpy as np


def upstream_template_features(features, templates, medias):
    """arcface_torch's image2template_feature, loop for loop."""
    unique = np.unique(templates)
    pooled = np.zeros((len(unique), features.shape[1]))
    for t, template in enumerate(unique):
        in_template = np.where(templates == template)[0]
        media_feats = []
        for media in np.unique(medias[in_template]):
            rows = in_template[medias[in_template] == media]
            media_feats.append(features[rows].mean(axis=0))
        pooled[t] = np.sum(media_feats, axis=0)
    return unique, pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def upstream_template_scores(features, templates, medias, pairs):
    """... followed by arcface_torch's verification (cosine of the pooled template features)."""
    unique, pooled = upstream_template_features(features, templates, medias)
    index = {template: t for t, template in enumerate(unique)}
    return np.array([pooled[index[a]] @ pooled[index[b]] for a, b in pairs])
