"""Where a run stands, as a component of the training state: the step, the non-finite losses met, and what
its verifications found (the best accuracy of each set, kept here alone).

The step is one number, `global_step`: optimizer steps taken (skipped ones included), the step of the LR
schedule. A resume on another world size or batch size renumbers it (the same fraction of training); the log,
TensorBoard and the checkpoint folders' names then show each step plus `shown_offset`, so that their counts
never run backwards. `shown(step)` is that display, and the one place the offset is added.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from training.components import Component
from training.fields import field as json_field
from training.fields import integer, json_object, number


@dataclass
class StepCounter(Component):
    """The run's position. Saved as state.json's `progress` (everything but the streak of non-finite losses,
    which a resume starts afresh); the run holds it and passes it with every save and resume."""

    keys = ("progress",)

    global_step: int = 0
    steps_per_epoch: int = 1
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    shown_offset: int = 0
    best_accuracy: dict[str, float] = field(default_factory=dict)  # Accuracy-Highest per verification set
    verification: dict[str, dict] = field(default_factory=dict)    # the last verification's operating points

    @property
    def epoch(self) -> int:
        return self.global_step // self.steps_per_epoch

    @property
    def shown_step(self) -> int:
        return self.shown(self.global_step)

    def shown(self, step: int) -> int:
        """Step `step` of the LR schedule as the log and TensorBoard count it."""
        return step + self.shown_offset

    def renumber(self, saved_steps_per_epoch: int) -> None:
        """The loaded step, saved by a run of `saved_steps_per_epoch` steps per epoch, as the same fraction of
        training in this run's steps; the shown step stays where it was."""
        shown = self.shown_step
        self.global_step = round(self.global_step * self.steps_per_epoch / saved_steps_per_epoch)
        self.shown_offset = shown - self.global_step

    def state_dict(self) -> dict:
        return {"progress": {"global_step": self.global_step, "epoch": self.epoch,
                             "steps_per_epoch": self.steps_per_epoch, "nonfinite_total": self.nonfinite_total,
                             "shown_offset": self.shown_offset, "best_accuracy": dict(self.best_accuracy),
                             "verification": dict(self.verification)}}

    def load_state_dict(self, saved: Mapping) -> None:
        """The saved step and what the run found. The epoch length stays this run's (its loader's): where it
        differs, the checkpointer renumbers the step. Keys that earlier versions or arcface_torch did not save
        keep their defaults."""
        if "progress" not in saved:
            return
        progress = saved["progress"]
        self.global_step = progress["global_step"]
        self.nonfinite_total = progress.get("nonfinite_total", 0)  # the first checkpoint.pt counted none
        self.shown_offset = progress.get("shown_offset", 0)
        self.best_accuracy = dict(progress.get("best_accuracy", {}))
        self.verification = dict(progress.get("verification", {}))

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        at = f"{where}.progress"
        progress = json_object(json_field(section, "progress", where), at)
        for key, low in (("global_step", 0), ("steps_per_epoch", 1), ("nonfinite_total", 0)):
            integer(json_field(progress, key, at), f"{at}.{key}", low=low)
        if "epoch" in progress:
            integer(progress["epoch"], f"{at}.epoch", low=0)
        if "shown_offset" in progress:
            integer(progress["shown_offset"], f"{at}.shown_offset")
        for name, value in json_object(progress.get("best_accuracy", {}), f"{at}.best_accuracy").items():
            number(value, f"{at}.best_accuracy.{name}")
        for name, value in json_object(progress.get("verification", {}), f"{at}.verification").items():
            json_object(value, f"{at}.verification.{name}")


class SavedProgress(StepCounter):
    """A step counter's saved form, as another program hands it over (a test, a tool): saved as it is."""

    def __init__(self, progress: Mapping):
        super().__init__(global_step=progress["global_step"], shown_offset=progress.get("shown_offset", 0))
        self.progress = dict(progress)

    def state_dict(self) -> dict:
        return {"progress": dict(self.progress)}


def as_counter(progress: StepCounter | Mapping) -> StepCounter:
    """`progress` as the registry's step counter: itself, or its saved form."""
    return progress if isinstance(progress, StepCounter) else SavedProgress(progress)
