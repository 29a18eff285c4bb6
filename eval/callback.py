"""Verification during training on the main rank: upstream's CallBackVerification, made strict."""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from torch import nn

from dataset import TRAINING_RECORDS, preparation_note, record_path, recorded_preparation
from eval.verification import (
    VerificationSet,
    flip_fused,
    fold_note,
    kept_out,
    load_bin,
    operating_point,
    test,
    threshold_accuracy_line,
)
from utils.distributed import is_main, run_on_rank0
from utils.errors import ConfigError, located
from utils.image import IMAGE_SIZE
from utils.metrics import Metrics

logger = logging.getLogger(__name__)


def resolve_target(target: str, rec_prefix: str) -> tuple[str, str]:
    """``(name, path)`` of a val_targets entry: an existing path, or a name looked up as
    ``rec_prefix/<name>.bin`` (upstream's rule)."""
    if os.path.isfile(target):
        path = target
    else:
        path = os.path.join(rec_prefix, target if target.endswith(".bin") else target + ".bin")
    return os.path.splitext(os.path.basename(path))[0], path


def check_val_targets(targets: Sequence[str], rec_prefix: str) -> None:
    """A ConfigError naming the first val_targets entry with no verification set file."""
    for target in targets:
        _, path = resolve_target(target, rec_prefix)
        if not os.path.isfile(path):
            raise ConfigError(f"val_targets entry {target!r}: no verification set at {located(path)}; put "
                              f"{os.path.basename(path)} in {rec_prefix or 'the rec folder'}, list its full path, "
                              "or remove it from val_targets")


def check_keep_best(keep_best: str | None, targets: Sequence[str], rec_prefix: str) -> None:
    """A ConfigError when config key keep_best names no set of val_targets."""
    names = [resolve_target(target, rec_prefix)[0] for target in targets]
    if keep_best is not None and keep_best not in names:
        listed = f"one of {', '.join(map(repr, names))}" if names else "a set you add to val_targets"
        raise ConfigError(f"config key 'keep_best' is {keep_best!r}, which is not a set of val_targets "
                          f"({', '.join(map(repr, names)) or 'none'}); set it to {listed}, or to None")


class VerificationCallback:
    """Every ``every`` steps (config key ``verbose``), accuracy on each ``.bin`` set, logged as upstream logs it
    and written to ``metrics`` (TensorBoard, W&B) when given.

    ``highest``: Accuracy-Highest per set so far, updated in place (the run's StepCounter.best_accuracy, the one
    place a run keeps its best accuracy, so that a resumed run goes on from there); ``improved`` names the sets
    whose last evaluation beat it. ``operating_points`` holds each set's threshold of the last evaluation
    (eval.verification.operating_point), which the run records with its model. Only the main rank loads and
    evaluates; on the others every call does nothing.
    """

    def __init__(self, every: int, val_targets: Sequence[str], rec_prefix: str,
                 image_size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE), batch_size: int = 64,
                 metrics: Metrics | None = None, highest: dict[str, float] | None = None) -> None:
        if every < 1:
            raise ValueError(f"every={every}: verification needs a positive interval of steps")
        self.every = every
        self.batch_size = batch_size
        self.metrics = metrics
        self.sets: dict[str, VerificationSet] = {}
        self.highest: dict[str, float] = {} if highest is None else highest
        self.improved: set[str] = set()
        self.operating_points: dict[str, dict] = {}
        self.kept_out: dict[str, dict[str, bool]] = {}
        self.unfit: set[str] = set()  # sets prepared unlike the training photos
        self.last_step = 0
        run_on_rank0(lambda: check_val_targets(val_targets, rec_prefix))
        # Read on rank 0 alone (run_on_rank0): a damaged .bin stops every rank with its own line.
        run_on_rank0(lambda: self._load(val_targets, rec_prefix, image_size), share=False)

    def _load(self, val_targets: Sequence[str], rec_prefix: str, image_size: tuple[int, int]) -> None:
        trained, where = recorded_preparation(rec_prefix), record_path(os.path.join(rec_prefix, TRAINING_RECORDS))
        for target in val_targets:
            name, path = resolve_target(target, rec_prefix)
            self.sets[name] = load_bin(path, image_size)
            if folds := fold_note(path, self.sets[name][1]):
                logger.info(folds)
            self.kept_out[name] = kept_out(path)
            self.highest.setdefault(name, 0.0)
            # As eval.verification checks it: a set whose faces differ from the training photos' gets no threshold.
            note = preparation_note(path, trained, where)
            if note and note.startswith("warning: "):
                self.unfit.add(name)
                logger.warning("%s; model.json records no threshold of it", note.removeprefix("warning: "))
            elif note:
                logger.info("%s", note)

    def __call__(self, global_step: int, backbone: nn.Module) -> dict[str, float] | None:
        """``{name: Accuracy-Flip}`` when ``global_step`` is a positive multiple of ``every``, else None."""
        self.last_step = global_step
        if global_step > 0 and global_step % self.every == 0 and is_main():
            return self.evaluate_now(backbone, global_step)
        return None

    def evaluate_now(self, backbone: nn.Module, global_step: int | None = None) -> dict[str, float]:
        """Evaluate every set now (e.g. after the last step), logged at ``global_step`` (default:
        the last step seen); ``{}`` on ranks other than the main one."""
        if not is_main():
            return {}
        step = self.last_step if global_step is None else global_step
        results = {}
        self.improved = set()
        for name, data_set in self.sets.items():
            _, _, accuracy, std, xnorm, embeddings = test(data_set, backbone, self.batch_size, 10)
            if accuracy > self.highest[name]:
                self.improved.add(name)
                self.highest[name] = accuracy
            logger.info("[%s][%d]XNorm: %f", name, step, xnorm)
            logger.info("[%s][%d]Accuracy-Flip: %1.5f+-%1.5f", name, step, accuracy, std)
            logger.info("[%s][%d]Accuracy-Highest: %1.5f", name, step, self.highest[name])
            if name not in self.unfit:
                self.operating_points[name] = {**operating_point(flip_fused(embeddings), data_set[1]),
                                               **self.kept_out[name], "by": f"training, step {step}"}
                logger.info("%s", threshold_accuracy_line(name, self.operating_points[name], step))
            if self.metrics is not None:
                self.metrics.add_scalar(name, accuracy, step)
                self.metrics.add_scalar(f"xnorm/{name}", xnorm, step)
            results[name] = accuracy
        return results
