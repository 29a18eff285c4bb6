"""Config key ``keep_best``: the backbone of the best verification on one set, kept in ``<output>/best/``.

Training's last model is not always its best (on small data the held-out accuracy peaks, then slides as the
classes are memorised), so a run can keep the backbone.pth (and the model.json with that verification's
threshold, for tools.inference) of its best Accuracy-Flip on a named set. ``best`` is a link to a folder
``best-step<N>``: a new best is written whole into a folder of its own, then the link is swapped in one rename,
so a kill at any moment leaves the previous best whole.

The best accuracy itself is kept in one place, the run's StepCounter.best_accuracy (which verification logs
as Accuracy-Highest and each checkpoint saves): a start raises its entry of the set to what ``best/model.json``
records, so that a run resumed from a checkpoint older than the kept model replaces it only with a better one.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path

from torch import nn

from backbones.trained import MODEL_INFO_NAME, save_backbone
from utils.atomic import fsync_dir
from utils.errors import CheckpointError

log = logging.getLogger(__name__)

BEST = "best"
RECORD_KEY = "kept_best"  # in best/model.json: {"set", "accuracy", "step"}
_FOLDER_PREFIX = "best-step"
_PARTIAL_PREFIX = ".partial-"


class BestModel:
    """The best model on ``set_name`` in ``output/best``: ``offer`` it each verification. The run's main process
    alone holds one (it alone verifies). `best_accuracy`: the run's best accuracy per set (StepCounter's), whose
    entry for the set is raised to the kept model's."""

    def __init__(self, output: str | os.PathLike, set_name: str, architecture: Mapping,
                 best_accuracy: dict[str, float]) -> None:
        self.output = Path(output)
        self.link = self.output / BEST
        self.set_name = set_name
        self.architecture = dict(architecture)
        accuracy, self.step = self._recorded()  # the step of the kept model, -1 when none is kept yet
        if self.step >= 0:
            best_accuracy[set_name] = max(best_accuracy.get(set_name, accuracy), accuracy)

    def _recorded(self) -> tuple[float, int]:
        """(accuracy, step) that ``best/model.json`` records, or (-1, -1) when nothing is kept yet."""
        if not os.path.lexists(self.link):
            return -1.0, -1
        info_path = self.link / MODEL_INFO_NAME
        if not self.link.is_symlink():
            raise CheckpointError(f"{self.link} is a folder keep_best did not write (it keeps the best model behind a "
                                  f"link to a {_FOLDER_PREFIX}<N> folder); move it out of {self.output} or set "
                                  "keep_best=None")
        try:
            record = json.loads(info_path.read_text())[RECORD_KEY]
            accuracy, step, set_name = float(record["accuracy"]), int(record["step"]), record["set"]
        except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as error:
            raise CheckpointError(f"{info_path} does not say which verification it kept ({type(error).__name__}: "
                                  f"{error}); move {self.link} and the folder it links to out of {self.output} to "
                                  "start keeping anew") from None
        if set_name != self.set_name:
            raise CheckpointError(f"{self.link} keeps the best model on {set_name!r}, not on "
                                  f"keep_best={self.set_name!r}; set keep_best={set_name!r}, or move {self.link} out "
                                  f"of {self.output}")
        return accuracy, step

    def offer(self, step: int, accuracies: Mapping[str, float], improved: Collection[str], backbone: nn.Module,
              operating_points: Mapping[str, dict]) -> None:
        """Keep ``backbone`` when its accuracy on the set is the best so far (the set is among those the
        verification `improved`), or when no model is kept yet."""
        accuracy = accuracies.get(self.set_name)
        if accuracy is None or (self.set_name not in improved and self.step >= 0):
            return
        folder = self._write(step, accuracy, backbone, operating_points)
        for superseded in self._folders():  # what keep_best asks for; the link no longer points there
            if superseded != folder:
                shutil.rmtree(superseded, ignore_errors=True)
        was = f"the one of global step {self.step}" if self.step >= 0 else "none before"
        self.step = step
        log.info("best %s Accuracy-Flip %.5f at global step %d (%s): kept in %s", self.set_name, accuracy, step, was,
                 self.link)

    def _write(self, step: int, accuracy: float, backbone: nn.Module, operating_points: Mapping[str, dict]) -> Path:
        """The model written whole into best-step<step>, then ``best`` pointed at it in one rename."""
        current = self.link.resolve() if self.link.is_symlink() else None
        for leftover in self._folders():  # a kill before the link moved left it: the link never pointed there
            if leftover.resolve() != current:
                shutil.rmtree(leftover)
        folder = self.output / f"{_FOLDER_PREFIX}{step:09d}"
        if folder.resolve() == current:  # the same step again, after a resume from an earlier checkpoint
            folder = folder.with_name(f"{folder.name}-again")
        partial = self.output / f"{_PARTIAL_PREFIX}{folder.name}"
        record = {RECORD_KEY: {"set": self.set_name, "accuracy": accuracy, "step": step}}
        save_backbone(backbone, partial, {**self.architecture, **record}, operating_points)
        os.replace(partial, folder)
        incoming = self.output / f".{BEST}-link-{folder.name}"
        incoming.unlink(missing_ok=True)
        incoming.symlink_to(folder.name, target_is_directory=True)
        os.replace(incoming, self.link)
        fsync_dir(self.output)
        return folder

    def _folders(self) -> list[Path]:
        """The folders keep_best wrote in the run folder: whole (best-step<N>) and partial ones."""
        return sorted([*self.output.glob(f"{_FOLDER_PREFIX}*"),
                       *self.output.glob(f"{_PARTIAL_PREFIX}{_FOLDER_PREFIX}*")])
