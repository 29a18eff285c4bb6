"""ROC operating points, TAR at a given FAR, and the ROC plot shared by the evaluation CLIs.

Scores are similarities: a pair is accepted when its score is at least the threshold.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def roc_points(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every distinct operating point: ``(fpr, tpr, thresholds)``, from (0, 0) at +inf to (1, 1).

    Tied scores form one point (a threshold cannot split them). Needs genuine and impostor pairs.
    """
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).astype(bool).ravel()
    if scores.shape != labels.shape:
        raise ValueError(f"{scores.size} scores but {labels.size} labels: they must pair up one to one")
    num_genuine = int(labels.sum())
    num_impostor = labels.size - num_genuine
    if num_genuine == 0 or num_impostor == 0:
        # sklearn would only warn and return NaN rates, which every TAR would then silently inherit.
        raise ValueError(f"an ROC needs both genuine and impostor pairs; got {num_genuine} genuine and "
                         f"{num_impostor} impostor pairs")
    from sklearn.metrics import roc_curve  # noqa: PLC0415 (~2 s to import, and every training process imports eval.verification)

    # Every point, not sklearn's default thinning: the plot and tests see each threshold.
    return roc_curve(labels, scores, drop_intermediate=False)


def tar_at_far(scores: np.ndarray, labels: np.ndarray,
               fars: Sequence[float] = (1e-3, 1e-4)) -> dict[float, float]:
    """For each FAR, the highest true-accept rate among thresholds whose false-accept rate is <= FAR.

    Conservative where upstream's IJB script takes the operating point nearest to the FAR, which
    may lie above it: then upstream also counts the genuine pairs accepted up to the next impostor.
    A FAR below 1 / impostor pairs gives the TAR at zero false accepts.
    """
    fpr, tpr, _ = roc_points(scores, labels)
    # fpr and tpr both rise along the curve, so the last point within the FAR has the highest TAR.
    return {far: float(tpr[np.searchsorted(fpr, far, side="right") - 1]) for far in fars}


def save_roc_plot(curves: Mapping[str, tuple[np.ndarray, np.ndarray]], path: str, title: str,
                  min_far: float | None = None,
                  axes: tuple[str, str] = ("False Positive Rate", "True Positive Rate")) -> None:
    """Write a PNG with one TPR-vs-FPR curve (log FPR axis) per name in ``curves``.

    ``min_far`` sets the left end of the axis; by default the smallest positive FPR any curve
    reaches, rounded down to a power of ten (0.1 at most). ``axes``: the x and y labels (1:N's DET plot draws
    TPIR against FPIR the same way).
    """
    # Plotting libraries load only where a plot is written (~1 s, and nothing else needs them).
    import matplotlib  # noqa: PLC0415
    from sklearn.metrics import auc  # noqa: PLC0415

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt  # noqa: PLC0415

    if min_far is None:
        smallest = min(float(fpr[fpr > 0].min()) for fpr, _ in curves.values())
        min_far = 10.0 ** min(math.floor(math.log10(smallest)), -1)  # a decade at least, even for tiny sets
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for name, (fpr, tpr) in curves.items():
        # A step curve: TPR holds until the next impostor is accepted. FPR 0 has no place on a
        # log axis, so that segment starts at the axis' left end.
        ax.step(np.maximum(fpr, min_far), tpr, where="post", lw=1.5,
                label=f"{name} (AUC = {float(auc(fpr, tpr)) * 100:.2f}%)")
    ax.set_xscale("log")
    ax.set_xlim(min_far, 1.0)
    ax.set_ylim(0.0, 1.05)  # headroom: a perfect curve must not hide in the frame's top edge
    ax.set_yticks(np.linspace(0.0, 1.0, 6))
    ax.grid(linestyle="--", linewidth=0.5)
    ax.set_xlabel(axes[0])
    ax.set_ylabel(axes[1])
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
