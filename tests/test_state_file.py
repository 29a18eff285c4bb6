"""A checkpoint's state.json checked field by field (checkpoint/state_file.py), on a file a real save wrote:
each field a resume reads, changed to what pairface never writes, is refused naming that field; what pairface
writes passes. The fields are named here by hand, the reference the check is read against."""
from __future__ import annotations

import copy
import json

import pytest

from checkpoint.sharded import save_state
from checkpoint.state_file import STATE_NAME, check_state
from tests.toy_state import INFO, PROGRESS, make_model, take_steps
from training.components import SavedPosition
from training.fields import StateFieldError

MISSING = object()
# One case per field a resume reads: (where in state.json, the value it gets (MISSING: removed), the field the
# error names). test_fault_injection.py forges each into a saved run (checksums recomputed) and resumes it.
STATE_FIELDS = [
    (("run",), [], "run"),
    (("run", "model"), "r18", "run.model"),
    (("run", "config"), MISSING, "run.config"),
    (("run", "config", "lr"), "0.1", "run.config.lr"),
    (("run", "config", "num_epoch"), 0, "run.config.num_epoch"),
    (("run", "config", "batch_size"), 2.5, "run.config.batch_size"),
    (("run", "config", "gradient_acc"), None, "run.config.gradient_acc"),
    (("run", "config", "warmup_epoch"), "1", "run.config.warmup_epoch"),
    (("run", "world_size"), 0, "run.world_size"),
    (("run", "progress", "global_step"), -1, "run.progress.global_step"),
    (("run", "progress", "epoch"), 1.5, "run.progress.epoch"),
    (("run", "progress", "steps_per_epoch"), 0, "run.progress.steps_per_epoch"),
    (("run", "progress", "nonfinite_total"), "0", "run.progress.nonfinite_total"),
    (("run", "progress", "shown_offset"), None, "run.progress.shown_offset"),
    (("run", "progress", "best_accuracy"), {"synthetic_val": "high"}, "run.progress.best_accuracy.synthetic_val"),
    (("run", "progress", "verification"), {"synthetic_val": 0.5}, "run.progress.verification.synthetic_val"),
    (("run", "param_groups"), [{"params": [0]}], "run.param_groups"),
    (("run", "param_groups", 0, "params"), [0, 0], "run.param_groups[0].params"),
    (("run", "param_groups", 1, "params", 0), -1, "run.param_groups[1].params[0]"),
    (("run", "param_groups", 0, "lr"), float("nan"), "run.param_groups[0].lr"),
    (("run", "param_groups", 0, "initial_lr"), MISSING, "run.param_groups[0].initial_lr"),
    (("run", "param_groups", 1, "weight_decay"), -1.0, "run.param_groups[1].weight_decay"),
    (("run", "param_groups", 0, "momentum"), "0.9", "run.param_groups[0].momentum"),
    (("run", "scheduler", "optimizer"), "replaced", "run.scheduler.optimizer"),
    (("run", "scheduler", "base_lrs"), [0.1], "run.scheduler.base_lrs"),
    (("run", "scheduler", "_last_lr", 1), "x", "run.scheduler._last_lr[1]"),
    (("run", "scheduler", "last_epoch"), -5, "run.scheduler.last_epoch"),
    (("run", "scheduler", "_step_count"), 1.5, "run.scheduler._step_count"),
    (("run", "scheduler", "_is_initial"), 1, "run.scheduler._is_initial"),
    (("run", "scheduler", "lr_lambdas"), [{"func": "print"}, {}], "run.scheduler.lr_lambdas"),
    (("run", "grad_scaler"), {"scale": 1.0}, "run.grad_scaler"),
    (("run", "grad_scaler"), {"scale": 0.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100,
                              "_growth_tracker": 0}, "run.grad_scaler.scale"),
    (("run", "optimizer_values"), {"first": {}}, "run.optimizer_values.first"),
    (("run", "optimizer_values"), {"0": {"step": "one"}}, "run.optimizer_values.0.step"),
    (("ranks",), [{}], "ranks"),
    (("ranks", 1, "loader", "skipped"), -1, "ranks[1].loader.skipped"),
    (("ranks", 0, "rng"), MISSING, "ranks[0].rng"),
    (("ranks", 0, "rng", "python", 0), 2, "ranks[0].rng.python"),  # Python 2's, which random.setstate converts
    (("ranks", 1, "rng", "python", 1, 624), 625, "ranks[1].rng.python"),  # past the 624 words: its ValueError
    (("ranks", 0, "rng", "python", 1, 0), 2 ** 32, "ranks[0].rng.python"),
    (("ranks", 1, "rng", "numpy", 1), 700, "ranks[1].rng.numpy"),
    (("ranks", 0, "rng", "numpy", 0, 5), -1, "ranks[0].rng.numpy"),
    (("ranks", 0, "rng", "torch", 0), 256, "ranks[0].rng.torch"),
    (("ranks", 1, "rng", "torch"), [1, 2, 3], "ranks[1].rng.torch"),
    (("ranks", 0, "rng", "cuda"), ["a"], "ranks[0].rng.cuda"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """state.json of a one-process save, with a second process's entry beside rank 0's (world size 2), so that
    the cases can reach ranks[1]."""
    folder = tmp_path_factory.mktemp("run")
    model = make_model("sgd")
    take_steps(model)
    save_state(folder, model, PROGRESS, SavedPosition({"skipped": 0}), INFO, {"lr": 0.1})
    content = json.loads(next(folder.glob(f"checkpoint-*/{STATE_NAME}")).read_text())
    del content["crc32c"]
    second = copy.deepcopy(content["ranks"][0])
    second["loader"]["skipped"] = 1
    content["ranks"].append(second)
    content["run"]["world_size"] = 2
    return content


def changed(content: dict, path: tuple, value) -> dict:
    """A copy of `content` with the field at `path` set to `value` (MISSING: removed)."""
    content = copy.deepcopy(content)
    parent = content
    for key in path[:-1]:
        parent = parent[key]
    if value is MISSING:
        del parent[path[-1]]
    else:  # rng.cuda, which a machine without CUDA does not save, is added
        parent[path[-1]] = value
    return content


def test_what_a_save_writes_passes(saved):
    check_state(saved)


@pytest.mark.parametrize("path, value, field", STATE_FIELDS,
                         ids=[(f"{field} removed" if value is MISSING else f"{field}={value!r}")[:60]
                              for _, value, field in STATE_FIELDS])
def test_a_field_that_is_not_what_pairface_writes_is_refused_naming_it(saved, path, value, field):
    with pytest.raises(StateFieldError) as raised:
        check_state(changed(saved, path, value))
    assert raised.value.field == field
