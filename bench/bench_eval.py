"""Evaluation speed and memory: eval.verification / eval.ijb against upstream's algorithms.

Upstream's algorithms are the loop-per-threshold and loop-per-template references the tests check
against (references/verification.py, references/ijb.py). Ratios are measured in this one run;
absolute times depend on the machine (the project's dev box: 2 CPU cores shared with others).

    python -m bench.bench_eval
"""
from __future__ import annotations

import time

import numpy as np

from eval.ijb import template_features
from eval.verification import evaluate
from references.ijb import upstream_template_features
from references.verification import planted_pairs, reference_evaluate


def best_time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    rows = []

    embeddings, issame = planted_pairs(6000, 512, 1.0, 0)  # LFW-sized: 6000 pairs
    ours = best_time(lambda: evaluate(embeddings, issame), 3)
    upstream = best_time(lambda: reference_evaluate(embeddings, issame), 1)
    rows.append(("evaluate, 6000 pairs x 512-d", upstream, ours))

    rng = np.random.default_rng(0)
    faces, num_templates = 100000, 5000  # IJB-C's shape scaled down: ~20 faces per template
    features = rng.standard_normal((faces, 512))
    templates = rng.integers(0, num_templates, faces)
    medias = rng.integers(0, 5, faces) + 10 * templates
    ours = best_time(lambda: template_features(features, templates, medias), 3)
    upstream = best_time(lambda: upstream_template_features(features, templates, medias), 1)
    rows.append((f"IJB media+template pooling, {faces} faces, {num_templates} templates", upstream, ours))

    print("Evaluation speed (2 shared CPU cores; ratio = upstream time / ours, same run)")
    print(f"| {'what':<62} | {'upstream s':>10} | {'ours s':>8} | {'ratio':>7} |")
    print(f"|{'-' * 64}|{'-' * 12}|{'-' * 10}|{'-' * 9}|")
    for what, upstream, ours in rows:
        print(f"| {what:<62} | {upstream:>10.3f} | {ours:>8.3f} | {upstream / ours:>6.1f}x |")

    lfw_images, side = 12000, 112
    upstream_bytes = 2 * lfw_images * 3 * side * side * 4  # two float32 copies (original + flipped)
    ours_bytes = 2 * lfw_images * 3 * side * side          # two uint8 copies
    print(f"\nlfw.bin held in memory: upstream float32 {upstream_bytes / 2**30:.2f} GiB, ours uint8 "
          f"{ours_bytes / 2**30:.2f} GiB ({upstream_bytes / ours_bytes:.0f}x less)")


if __name__ == "__main__":
    main()
