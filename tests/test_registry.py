"""The one registry of saved state (training.state.COMPONENTS): every piece a checkpoint holds belongs to one
component of it, each built once with the training state; every importer, the bare backbone's too, restores
through them; the best accuracy is kept in one place.

The references are the files a save writes (read here with json and torch), the weights a backbone file holds,
and what best/model.json records; none of them is computed by the code under test.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from backbones import get_model
from checkpoint.manifest import MANIFEST_NAME
from checkpoint.pointer import POINTER_NAME
from checkpoint.sharded import RUN_DESCRIPTION, save_state
from checkpoint.sources import BareBackbone
from gpu_acceptance.runs import CONFIG, QUIET
from tests.run_helpers import ROOT
from tests.toy_state import INFO, make_model, take_steps
from training.best_model import BEST, RECORD_KEY, BestModel
from training.components import SavedPosition, exported_backbone
from training.state import COMPONENTS, StepCounter, architecture, build_components, build_training_state, registry
from utils.config import load_config

NUM_CLASSES = 20


@pytest.mark.parametrize("config", [{}, {"ema_decay": 0.5}], ids=["plain", "ema"])
def test_every_key_a_checkpoint_holds_belongs_to_exactly_one_component_of_the_run(tmp_path, config):
    model = make_model("sgd")
    model.components = build_components(model, config)
    take_steps(model)
    counter, position = StepCounter(global_step=2, steps_per_epoch=10), SavedPosition({"skipped": 3})
    save_state(tmp_path, model, counter, position, INFO, {"lr": 0.1})
    folder = tmp_path / json.loads((tmp_path / POINTER_NAME).read_text())["directory"]
    content = json.loads((folder / "state.json").read_text())
    tensors = {fqn.split(".", 1)[0] for fqn in FileSystemReader(folder).read_metadata().state_dict_metadata}
    listed = set(json.loads((folder / MANIFEST_NAME).read_text())["files"])

    components = registry(model, counter, position)
    assert {type(component) for component in components} <= set(COMPONENTS)
    owners = [key for component in components for key in component.keys]
    assert len(owners) == len(set(owners)), owners

    def owned(where) -> set[str]:
        return {key for component in components if where(component) for key in component.keys
                if key not in component.file_keys and key not in component.tensor_keys}

    assert set(content["run"]) - set(RUN_DESCRIPTION) == owned(lambda component: not component.per_rank)
    for entry in content["ranks"]:
        assert set(entry) == owned(lambda component: component.per_rank) == {"rng", "loader"}
    assert tensors == {key for component in components for key in component.tensor_keys}
    assert tensors == ({"centres", "optimizer", "ema"} if config else {"centres", "optimizer"})
    assert [key for component in components for key in component.file_keys] == ["backbone"]
    assert "backbone.pth" in listed


def small_config(*overrides: str):
    return load_config(ROOT / CONFIG, [*QUIET, *overrides])


def test_each_component_is_built_once_with_the_training_state(monkeypatch):
    built: dict[str, int] = {}
    for cls in COMPONENTS:
        original = cls.build.__func__

        def counted(klass, state, config, original=original):
            built[klass.__name__] = built.get(klass.__name__, 0) + 1
            return original(klass, state, config)

        monkeypatch.setattr(cls, "build", classmethod(counted))
    state = build_training_state(small_config("ema_decay=0.5"), NUM_CLASSES, torch.device("cpu"), steps_per_epoch=10)
    assert built == {cls.__name__: 1 for cls in COMPONENTS}
    # the backbone with its average, the process's random streams, centres, optimizer, schedule, grad scaler,
    # margin state: the step counter and the loader's position are the run's own (registry)
    assert len(state.components) == 7


def test_a_bare_backbone_start_of_an_ema_run_averages_from_the_loaded_weights(tmp_path):
    """The EMA's average starts as the weights the run starts from: a bare backbone.pth restores through the
    components like every other source, so the exported backbone is the file's, not the seed's."""
    cfg = small_config("ema_decay=0.5")
    torch.manual_seed(7)
    other = get_model(cfg.network, num_features=cfg.embedding_size, **cfg.network_kwargs)
    torch.save(other.state_dict(), tmp_path / "start.pth")
    written = torch.load(tmp_path / "start.pth", weights_only=True)
    state = build_training_state(cfg, NUM_CLASSES, torch.device("cpu"), steps_per_epoch=10)
    assert not torch.equal(state.backbone.conv1.weight, written["conv1.weight"])  # the seed's are others
    assert BareBackbone().restore(tmp_path / "start.pth", architecture(cfg, NUM_CLASSES), state) is None
    exported = exported_backbone(state).state_dict()
    assert exported.keys() == written.keys()
    assert all(torch.equal(exported[name], written[name]) for name in written)


def test_the_best_accuracy_is_the_step_counters_raised_to_what_the_kept_model_records(tmp_path):
    backbone = torch.nn.Linear(4, 3)
    first = StepCounter()
    best = BestModel(tmp_path, "lfw", INFO, first.best_accuracy)
    assert first.best_accuracy == {}  # nothing kept yet: nothing to raise
    best.offer(3, {"lfw": 0.8}, set(), backbone, {})  # no model kept yet: the first verification is kept
    assert recorded(tmp_path) == {"set": "lfw", "accuracy": 0.8, "step": 3}

    # A resume from a checkpoint older than the kept model: its best accuracy is raised to the kept one's ...
    older = StepCounter(best_accuracy={"lfw": 0.7, "cfp_fp": 0.6})
    best = BestModel(tmp_path, "lfw", INFO, older.best_accuracy)
    assert older.best_accuracy == {"lfw": 0.8, "cfp_fp": 0.6}
    # ... so that a verification that beats the checkpoint's best but not the kept model keeps nothing
    best.offer(5, {"lfw": 0.75}, set(), backbone, {})
    assert recorded(tmp_path)["step"] == 3
    best.offer(6, {"lfw": 0.9}, {"lfw"}, backbone, {})
    assert recorded(tmp_path) == {"set": "lfw", "accuracy": 0.9, "step": 6}
    assert sorted(path.name for path in tmp_path.iterdir()) == [BEST, "best-step000000006"]


def recorded(output: Path) -> dict:
    return json.loads((output / BEST / "model.json").read_text())[RECORD_KEY]


def test_the_step_is_one_number_whose_display_offset_survives_a_renumbering():
    """A run of 10 steps per epoch saved at step 25 (shown as 30 after an earlier renumbering), resumed with
    4 steps per epoch: step 10 of the schedule (25 * 4 / 10), still shown as 30, and counting on from there."""
    saved = StepCounter(global_step=25, steps_per_epoch=10, shown_offset=5, nonfinite_in_a_row=2,
                        best_accuracy={"lfw": 0.9}).state_dict()
    assert saved == {"progress": {"global_step": 25, "epoch": 2, "steps_per_epoch": 10, "nonfinite_total": 0,
                                  "shown_offset": 5, "best_accuracy": {"lfw": 0.9}, "verification": {}}}
    resumed = StepCounter(steps_per_epoch=4)
    resumed.load_state_dict(json.loads(json.dumps(saved)))
    assert (resumed.global_step, resumed.steps_per_epoch, resumed.nonfinite_in_a_row) == (25, 4, 0)
    resumed.renumber(saved_steps_per_epoch=10)
    assert (resumed.global_step, resumed.shown_step, resumed.epoch, resumed.shown(12)) == (10, 30, 2, 32)
    assert resumed.best_accuracy == {"lfw": 0.9}
