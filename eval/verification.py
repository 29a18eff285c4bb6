"""Pair verification on insightface ``.bin`` sets (lfw, cfp_fp, agedb_30, ...), as arcface_torch does.

A ``.bin`` file is a pickle of ``(bins, issame)``: 2N encoded images (``bytes`` or uint8 numpy
arrays of the encoded bytes) and N booleans; pair i is images (2i, 2i+1). Accuracy is 10-fold:
the squared-L2 threshold (0..4 step 0.01) that is best on nine folds is scored on the tenth.

Command line (prints the familiar lines, writes a ROC plot and the raw scores next to the model):

    python -m eval.verification --model output/run --bins lfw.bin cfp_fp.bin
    python -m eval.verification --model backbone.pth --network r50 --bins lfw.bin
    python -m eval.verification --onnx w600k_r50.onnx --bins lfw.bin
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
from PIL import Image
from torch import nn

from backbones.trained import (
    THRESHOLD_SET_DEFAULT,
    THRESHOLD_SET_KEY,
    add_threshold_set_argument,
    deciding_set,
    far_words,
    forget_verification,
    record_verification,
    weak_threshold_caution,
)
from dataset import held_out, preparation_note
from eval.cli import EvaluatedNetwork, add_network_arguments, check_positive, open_network, output_prefix
from eval.embedding import embed_images
from eval.folds import verification_folds
from eval.roc import roc_points, save_roc_plot, tar_at_far
from utils.cli import exit_on_user_error
from utils.errors import ConfigError, DataError, located
from utils.image import IMAGE_SIZE

logger = logging.getLogger(__name__)

ACCURACY_THRESHOLDS = np.arange(0, 4, 0.01)
VAL_THRESHOLDS = np.arange(0, 4, 0.001)
VAL_FAR = 1e-3
TAR_FARS = (1e-3, 1e-4)

VerificationSet = tuple[list[torch.Tensor], list[bool]]


class _BinUnpickler(pickle.Unpickler):
    """Unpickles lists, bytes, bools and numpy arrays only: a .bin file cannot run code on load."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a verification set never holds")
        if module.startswith("numpy.core"):
            module = "numpy._core" + module[len("numpy.core"):]  # numpy 2 renamed the package
        return super().find_class(module, name)


def _read_pickle(path: str):
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return _BinUnpickler(io.BytesIO(raw)).load()
    except UnicodeDecodeError:
        # Written by Python 2 (the published lfw.bin & co.): its str entries are the JPEG bytes.
        return _BinUnpickler(io.BytesIO(raw), encoding="bytes").load()


def _decode(entry, image_size: tuple[int, int]) -> np.ndarray:
    """One encoded image -> uint8 RGB (H, W, 3) at ``image_size`` (H, W)."""
    encoded = entry.tobytes() if isinstance(entry, np.ndarray) else bytes(entry)
    with Image.open(io.BytesIO(encoded)) as image:
        rgb = image.convert("RGB")
    height, width = image_size
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.BILINEAR)
    return np.array(rgb)  # a writable copy: torch refuses to wrap read-only buffers


def load_bin(path: str | os.PathLike, image_size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE)) -> VerificationSet:
    """``([original, h-flipped], issame)``: uint8 tensors ``(2N, 3, H, W)`` and N booleans.

    Images of another size are resized to ``image_size``. Stays uint8 to keep memory at a quarter
    of float32; ``test`` normalises batch by batch.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"verification set {located(path)} does not exist; check the path given to --bins")
    fix = "pass a .bin as insightface ships them or tools.make_bin writes them"
    try:
        bins, issame = _read_pickle(path)
        issame = [bool(flag) for flag in issame]
        num_images = len(bins)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as error:
        raise DataError(f"{path} is not a verification .bin, a pickle of (images, issame) ({error}); {fix}") from None
    if num_images != 2 * len(issame):
        raise DataError(f"{path} holds {num_images} images for {len(issame)} pairs; a .bin needs exactly "
                        f"two images per pair: {fix}")
    if not issame:
        raise DataError(f"{path} holds no pairs; {fix}")
    height, width = image_size
    original = torch.empty((len(bins), 3, height, width), dtype=torch.uint8)
    for index, entry in enumerate(bins):
        try:
            original[index] = torch.from_numpy(_decode(entry, image_size)).permute(2, 0, 1)
        except (OSError, ValueError, TypeError) as error:
            raise DataError(f"{path}: image {index} cannot be decoded ({error}); the file is damaged or "
                            f"not an insightface .bin") from None
    logger.info("loaded %s: %d pairs", path, len(issame))
    return [original, original.flip(3)], issame


def _accepts_below(dist: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """For each threshold, how many of ``dist`` are strictly below it (the pairs called "same")."""
    return np.searchsorted(np.sort(dist), thresholds, side="left")


def _confusion(dist: np.ndarray, issame: np.ndarray, thresholds: np.ndarray):
    """True/false accepts and the genuine/impostor counts of each threshold (``dist < threshold``)."""
    true_accepts = _accepts_below(dist[issame], thresholds)
    false_accepts = _accepts_below(dist[~issame], thresholds)
    return true_accepts, false_accepts, int(issame.sum()), int((~issame).sum())


def _rate(count: np.ndarray, total: int) -> np.ndarray:
    return count / total if total else np.zeros(count.shape)


def _fold_thresholds(dist: np.ndarray, issame: np.ndarray, folds) -> list[float]:
    """Each fold's distance threshold: the first with the most pairs right on the other folds."""
    thresholds = []
    for train, _ in folds:
        tp, fp, _, n_diff = _confusion(dist[train], issame[train], ACCURACY_THRESHOLDS)
        thresholds.append(float(ACCURACY_THRESHOLDS[int(np.argmax(tp + n_diff - fp))]))
    return thresholds


def _roc_and_accuracy(dist: np.ndarray, issame: np.ndarray, folds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tprs, fprs = [], []
    for _, test in folds:
        tp, fp, n_same, n_diff = _confusion(dist[test], issame[test], ACCURACY_THRESHOLDS)
        tprs.append(_rate(tp, n_same))
        fprs.append(_rate(fp, n_diff))
    right = _pairs_right(dist, issame, folds)
    accuracy = np.asarray([right[test].mean() for _, test in folds], dtype=np.float64)
    return np.mean(tprs, axis=0), np.mean(fprs, axis=0), accuracy


def _pairs_right(dist: np.ndarray, issame: np.ndarray, folds) -> np.ndarray:
    """Whether each pair is judged right at its test fold's threshold (a single fold tests the whole set)."""
    right = np.zeros(issame.size, dtype=bool)
    for (_, test), threshold in zip(folds, _fold_thresholds(dist, issame, folds)):
        right[test] = (dist[test] < threshold) == issame[test]
    return right


def _distances(embeddings: np.ndarray, issame: np.ndarray) -> np.ndarray:
    if embeddings.shape[0] != 2 * issame.size:
        raise ValueError(f"{embeddings.shape[0]} embeddings for {issame.size} pairs; need two per pair")
    return np.sum(np.square(embeddings[0::2] - embeddings[1::2]), axis=1)


def pairs_right(embeddings: np.ndarray, issame: Sequence[bool], nrof_folds: int = 10) -> np.ndarray:
    """Accuracy-Flip pair by pair: whether each pair ``(embeddings[2i], embeddings[2i+1])`` is judged right at the
    threshold chosen on the folds it is not in. Its mean over a fold is that fold's accuracy; two models' arrays on
    one set compare them pair by pair (eval.paired)."""
    issame = np.asarray(issame, dtype=bool)
    dist = _distances(np.asarray(embeddings, dtype=np.float64), issame)
    return _pairs_right(dist, issame, verification_folds(issame, nrof_folds).splits)


def _threshold_at_far(far: np.ndarray, far_target: float) -> float:
    """The distance threshold where the (non-decreasing) FAR curve reaches ``far_target``, linear
    between thresholds; 0 when no threshold reaches it.

    Upstream calls scipy's ``interp1d(far, thresholds, kind="slinear")``, which newer scipy refuses
    for the repeated FAR values every such curve has; this is what it computed: on a run of equal
    FAR values equal to the target, the run's last threshold.
    """
    if far.max() < far_target:
        return 0.0
    low = int(np.searchsorted(far, far_target, side="right")) - 1  # last point with FAR <= target
    if far[low] == far_target:
        return float(VAL_THRESHOLDS[low])
    step = (far_target - far[low]) / (far[low + 1] - far[low])
    return float(VAL_THRESHOLDS[low] + step * (VAL_THRESHOLDS[low + 1] - VAL_THRESHOLDS[low]))


def _val_at_far(dist: np.ndarray, issame: np.ndarray, folds, far_target: float) -> tuple[float, float, float]:
    """Upstream's VAL: threshold interpolated to ``far_target`` on the train folds, VAL/FAR on the test fold."""
    vals, fars = [], []
    for train, test in folds:
        _, fp, _, n_diff = _confusion(dist[train], issame[train], VAL_THRESHOLDS)
        threshold = _threshold_at_far(_rate(fp, n_diff), far_target)
        tp, fp, n_same, n_diff = _confusion(dist[test], issame[test], np.array([threshold]))
        vals.append(float(_rate(tp, n_same)[0]))
        fars.append(float(_rate(fp, n_diff)[0]))
    return float(np.mean(vals)), float(np.std(vals)), float(np.mean(fars))


def evaluate(embeddings: np.ndarray, issame: Sequence[bool], nrof_folds: int = 10):
    """``(tpr, fpr, accuracy, val, val_std, far)`` of pairs ``(embeddings[2i], embeddings[2i+1])``.

    tpr/fpr: per accuracy threshold, averaged over test folds; accuracy: one value per fold;
    val/val_std/far: VAL at FAR 1e-3 as upstream computes it. The folds are upstream's contiguous ones wherever
    each holds both kinds of pair, stratified otherwise (eval.folds).
    """
    issame = np.asarray(issame, dtype=bool)
    dist = _distances(np.asarray(embeddings, dtype=np.float64), issame)
    folds = verification_folds(issame, nrof_folds).splits
    tpr, fpr, accuracy = _roc_and_accuracy(dist, issame, folds)
    val, val_std, far = _val_at_far(dist, issame, folds, VAL_FAR)
    return tpr, fpr, accuracy, val, val_std, far


def operating_point(fused: np.ndarray, issame: Sequence[bool]) -> dict[str, float]:
    """The threshold one comparison is judged by, chosen on the whole set as Accuracy-Flip chooses it on each
    fold (the first of the distance thresholds with the most pairs right): ``{"threshold"}``, the cosine
    similarity above which a pair is the same person (squared distance < t is cosine > 1 - t/2 for unit
    embeddings), ``"far"`` and ``"accuracy_at_threshold"`` on the set at that threshold (not Accuracy-Flip,
    whose folds are each scored at a threshold chosen on the others: see ``threshold_accuracy_line``),
    ``"pairs"`` and ``"different"`` (the different-person pairs the FAR was counted on). ``fused``: unit
    embeddings, pairs ``(2i, 2i+1)``."""
    issame = np.asarray(issame, dtype=bool)
    dist = np.sum(np.square(fused[0::2] - fused[1::2]), axis=1)
    true_accepts, false_accepts, _, num_different = _confusion(dist, issame, ACCURACY_THRESHOLDS)
    best = int(np.argmax(true_accepts - false_accepts))
    return {"threshold": float(1.0 - ACCURACY_THRESHOLDS[best] / 2), "pairs": int(issame.size),
            "different": int(num_different), "far": float(_rate(false_accepts, num_different)[best]),
            "accuracy_at_threshold": float((true_accepts[best] + num_different - false_accepts[best]) / issame.size)}


def threshold_accuracy_line(name: str, point: dict, step: int | None = None) -> str:
    """The line that says the accuracy model.json records with a set's threshold, named apart from
    Accuracy-Flip: one threshold chosen on all the pairs and scored on those same pairs, where Accuracy-Flip
    scores each fold at a threshold chosen on the other folds (so it is the lower, and the one to compare runs
    by)."""
    at = f"[{name}]" + ("" if step is None else f"[{step}]")
    return (f"{at}Accuracy-At-Threshold: {point['accuracy_at_threshold']:1.5f} at cosine similarity "
            f"{point['threshold']:.4f}, chosen on all {point['pairs']} pairs (recorded in model.json with it; "
            "Accuracy-Flip chooses each fold's threshold on the other folds)")


def _l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def flip_fused(embeddings_list: Sequence[np.ndarray]) -> np.ndarray:
    """Each image's embedding plus its mirror image's, L2-normalised (what Accuracy-Flip scores)."""
    return _l2_normalize(embeddings_list[0] + embeddings_list[1])


def test(data_set: VerificationSet, backbone: nn.Module, batch_size: int, nfolds: int = 10,
         stream: TextIO | None = None, name: str = "verification set"):
    """``(acc1, std1, acc2, std2, xnorm, embeddings_list)`` of one loaded set.

    acc1/std1: accuracy of the original images alone (upstream leaves it 0); acc2/std2: of the
    flip-summed embeddings; xnorm: mean embedding norm over both; embeddings_list: [original, flipped].
    The backbone runs in eval mode without autograd; its modes are restored afterwards. ``stream``:
    where a command line shows the embedding progress of ``name``.
    """
    images, issame = data_set
    embeddings_list = [embed_images(backbone, view, batch_size, stream, f"[{name}] embedding {which} images")
                       for view, which in zip(images, ("original", "flipped"))]
    xnorm = float(np.mean(np.linalg.norm(np.concatenate(embeddings_list), axis=1)))
    accuracy1 = evaluate(_l2_normalize(embeddings_list[0]), issame, nfolds)[2]
    accuracy2 = evaluate(flip_fused(embeddings_list), issame, nfolds)[2]
    return (float(accuracy1.mean()), float(accuracy1.std()), float(accuracy2.mean()), float(accuracy2.std()),
            xnorm, embeddings_list)


def pair_similarities(fused: np.ndarray) -> np.ndarray:
    """Cosine similarity of pairs ``(fused[2i], fused[2i+1])`` of unit embeddings."""
    return np.sum(fused[0::2] * fused[1::2], axis=1)


def _set_names(paths: Sequence[Path]) -> list[str]:
    """``lfw`` for ``data/lfw.bin``: the name in the printed lines and in the result files."""
    names = [path.stem for path in paths]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise ConfigError(f"--bins lists two sets named {name} ({paths[names.index(name)]} and {paths[index]}); "
                              "their results would overwrite each other: rename one file")
    return names


def fold_note(path: str | os.PathLike, issame: Sequence[bool], nrof_folds: int = 10) -> str | None:
    """The line saying how the pairs of the set at ``path`` are cut into folds when not as arcface_torch cuts them;
    None when they are. A set holding one kind of pair only is a DataError naming it."""
    try:
        note = verification_folds(np.asarray(issame, dtype=bool), nrof_folds).note
    except ValueError as error:
        raise DataError(f"{path}: {error}; use a set with same-person and different-person pairs "
                        "(tools.make_bin writes both)") from None
    return None if note is None else f"{path}: {note}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_network_arguments(parser)
    parser.add_argument("--bins", nargs="+", type=Path, help=".bin verification sets to evaluate")
    parser.add_argument("--forget", nargs="+", metavar="NAME", default=[],
                        help="take these sets' recorded thresholds out of the model's model.json (a set is named by "
                             "its file name without .bin, as model.json lists it), so that tools.inference and "
                             "tools.search no longer judge pairs by them")
    add_threshold_set_argument(parser, "the set (of those model.json records after this evaluation) whose threshold "
                               "decides the verdicts of tools.inference and tools.search from now on: model.json "
                               f"names it ({THRESHOLD_SET_KEY}); default: the set that decided before (evaluating a "
                               "set does not change it), with none recorded before, as those tools pick one: "
                               f"{THRESHOLD_SET_DEFAULT}")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="images per forward pass (memory only: the scores do not depend on it)")
    parser.add_argument("--nfolds", type=int, default=10,
                        help="cross-validation folds of the accuracy (upstream: 10); each fold's threshold is "
                             "chosen on the others")
    args = parser.parse_args(argv)

    with exit_on_user_error():
        if not args.bins and not args.forget:
            raise ConfigError("no verification set given; pass --bins SET.bin ... to evaluate (or --forget NAME to "
                              "take a recorded set's threshold out of model.json)")
        check_positive(args.batch_size, "--batch-size")
        check_positive(args.nfolds, "--nfolds")
        network = open_network(args)
        if args.forget:
            print(forget(network, args.forget))
        if not args.bins:
            return 0
        names = _set_names(args.bins)
        if args.threshold_set is not None and network.saved is not None and args.threshold_set not in names:
            deciding_set(network.saved.verification, args.threshold_set, network.saved.info_path)  # said before work
        prefix = output_prefix(network.path)
        curves, operating_points, unfit = {}, {}, []
        for path, name in zip(args.bins, names):
            data_set = load_bin(path)
            note = model_preparation_note(path, network)
            if note:
                print(note, file=sys.stderr if note.startswith("warning") else sys.stdout)
            labels = np.asarray(data_set[1], dtype=bool)
            if folds := fold_note(path, labels, args.nfolds):
                print(folds)
            acc1, std1, acc2, std2, xnorm, embeddings_list = test(data_set, network.module, args.batch_size,
                                                                  args.nfolds, sys.stderr, name)
            fused = flip_fused(embeddings_list)
            val, val_std, far = evaluate(fused, data_set[1], args.nfolds)[3:]
            scores = pair_similarities(fused)
            print(f"[{name}]XNorm: {xnorm:f}")
            print(f"[{name}]Accuracy: {acc1:1.5f}+-{std1:1.5f}")
            print(f"[{name}]Accuracy-Flip: {acc2:1.5f}+-{std2:1.5f}")
            print(f"[{name}]Validation rate: {val:2.5f}+-{val_std:2.5f} @ FAR={far:2.5f}")
            different = int((~labels).sum())
            for target_far, tar in tar_at_far(scores, labels, TAR_FARS).items():
                # Below one false accept in `different` pairs, the set only shows the TAR with none at all.
                caveat = (f" (at 0 false accepts: {different} different-person pairs cannot measure a FAR below "
                          f"{1 / different:.1g})" if target_far * different < 1 else "")
                print(f"[{name}]TAR@FAR={target_far:g}: {tar:1.5f}{caveat}")
            if note and note.startswith("warning"):  # prepared unlike the training photos: no threshold to judge by
                unfit.append(name)
            else:
                operating_points[name] = {**operating_point(fused, data_set[1]), **kept_out(path)}
                print(threshold_accuracy_line(name, operating_points[name]))
            scores_path = f"{prefix}_{name}_scores.npy"
            np.save(scores_path, scores)
            print(f"[{name}]scores (cosine, one per pair, in .bin order): {scores_path}")
            fpr, tpr, _ = roc_points(scores, labels)
            curves[name] = (fpr, tpr)
        plot_path = f"{prefix}_verification_roc.png"
        save_roc_plot(curves, plot_path, title=f"ROC of {network.path.name}")
        print(f"ROC plot: {plot_path}")
        if unfit:
            print(f"threshold: none recorded for {', '.join(unfit)}: its photos were prepared unlike the training "
                  "photos (the warning above), so its threshold would misjudge pairs")
        if operating_points:
            print(record_operating_points(network, operating_points, args.threshold_set))
    return 0


def kept_out(path: str | os.PathLike) -> dict[str, bool]:
    """``{"held_out": ...}`` for an operating point, when the set's record says whether its people were kept
    out of training (tools.make_bin); {} when it does not. tools.inference's verdict prefers such a set."""
    known = held_out(path)
    return {} if known is None else {"held_out": known}


def model_preparation_note(path: Path, network: EvaluatedNetwork) -> str | None:
    """``preparation_note`` for a set and the model's training photos (its model.json), None when either is
    unknown."""
    saved = network.saved
    return None if saved is None else preparation_note(path, saved.photo_preparation, saved.info_path)


def forget(network: EvaluatedNetwork, names: Sequence[str]) -> str:
    """Take the sets `names` out of the model's model.json; the line that says so. A name not recorded is an
    error naming the ones that are."""
    if network.saved is None:
        raise ConfigError("--forget changes a model.json, and an --onnx model has none; pass the run folder with "
                          "--model")
    unknown = [name for name in names if name not in network.saved.verification]
    if unknown:
        recorded = ", ".join(network.saved.verification) or "none"
        raise ConfigError(f"--forget {unknown[0]}: {network.saved.info_path} records no set of that name (recorded: "
                          f"{recorded}); pass one of those")
    where = forget_verification(network.saved, names)
    return f"forgot the threshold of {', '.join(names)} in {where}"


def record_operating_points(network: EvaluatedNetwork, operating_points: dict[str, dict],
                            threshold_set: str | None = None) -> str:
    """Record this evaluation's thresholds in the model.json beside PyTorch weights, for the verdicts of
    tools.inference and tools.search, with the set whose threshold decides them: ``threshold_set`` when asked,
    else the one that decided before (backbones.trained.record_verification); the line that says what happened
    and which set decides."""
    saved = network.saved
    before = {} if saved is None else saved.verification
    recorded = {**before, **{name: {**point, "by": "eval.verification"} for name, point in operating_points.items()}}
    if threshold_set is not None:
        name, why = deciding_set(recorded, threshold_set, "this evaluation or the model's model.json")
    elif before:
        name, why = deciding_set(before, None, saved.info_path, saved.threshold_set)
        why += "; kept: evaluating a set does not change the deciding one unless --threshold-set names it"
    else:
        name, why = deciding_set(recorded, None, "this evaluation")
    point = recorded[name]
    summary = (f"same person above cosine similarity {point['threshold']:.4f} ({far_words(point)} on {name}, "
               f"{point['pairs']} pairs: {why})")
    caution = "".join(f"\n{line}" for line in [weak_threshold_caution(name, point)] if line)
    if saved is None:
        return f"threshold: {summary}; not recorded for an --onnx model{caution}"
    where = record_verification(saved, {name: recorded[name] for name in operating_points}, name)
    if where is None:
        return (f"threshold: {summary}; not recorded: {saved.weights} has no model.json beside it (pass the run "
                f"folder train.py wrote, so that tools.inference can judge pairs by it){caution}")
    return f"threshold recorded in {where} for tools.inference and tools.search: {summary}{caution}"


if __name__ == "__main__":
    sys.exit(main())
