"""The EMA of the backbone's weights (`ema_decay`, training/ema.py) in whole runs of train.py.

One process, ema_decay=0.2 (the warm-up's (1 + n) / (10 + n) decides the first two steps, the decay the
others): a run stopped and resumed after every step is the uninterrupted 4-step run bit for bit (the averages
in backbone.pth, the trained weights in the checkpoint, everything else); after each of its steps backbone.pth
holds the average computed here in float64 from the trained weights of every step before (the start's taken
from the seed as train.py builds it); a checkpoint whose EMA count is damaged is one error line; converted to
arcface_torch, its rank files hold the trained weights (their momentum beside them) and model.pt the average,
and an import into a run with ema_decay starts the average from the imported weights. The EMA
on other numbers of processes: tests/test_sharded.py (written by 4, resumed on 1, 2, 3) and
tests/test_resume_torchrun.py (2 processes resumed on 1).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from backbones import get_model
from gpu_acceptance.runs import CONFIG, QUIET
from tests.run_helpers import ROOT, assert_nothing_lost, assert_same_run, file_states, run_here
from tests.test_fault_injection import forge_state
from tests.test_train_errors import only_line
from tools import convert_checkpoint
from utils.config import load_config

DECAY, STEPS = 0.2, 4
OVERRIDES = [f"ema_decay={DECAY}", "sample_rate=0.5"]


def saved(run: Path) -> tuple[dict, dict]:
    """(backbone.pth of the run folder, the trained weights its checkpoint keeps) of the published checkpoint."""
    folder = run / json.loads((run / "checkpoint.json").read_text())["directory"]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, f"{tmp}/whole.pt")
        trained = torch.load(f"{tmp}/whole.pt", weights_only=True)["ema"]
    return torch.load(run / "backbone.pth", weights_only=True), trained


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ema")
    assert run_here(data, root / "whole", *OVERRIDES, f"max_steps={STEPS}") == (0, "")
    stages = []
    for step in range(1, STEPS + 1):
        assert run_here(data, root / "split", *OVERRIDES, f"max_steps={step}", resume=step > 1) == (0, "")
        stages.append(saved(root / "split"))
    return {"root": root, "stages": stages}


def test_a_run_resumed_after_every_step_is_the_uninterrupted_run_bit_for_bit(runs):
    assert_same_run(runs["root"] / "split", runs["root"] / "whole")
    for ours, theirs in zip(saved(runs["root"] / "split"), saved(runs["root"] / "whole"), strict=True):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def initial_weights() -> dict:
    """The backbone train.py starts from: its config's seed, then the network (as training/state.py builds it)."""
    cfg = load_config(ROOT / CONFIG, QUIET)
    torch.manual_seed(cfg.seed)
    return get_model(cfg.network, num_features=cfg.embedding_size, dropout=cfg.dropout,
                     **cfg.network_kwargs).state_dict()


def test_backbone_pth_holds_the_average_computed_here_from_every_steps_trained_weights(runs):
    start = initial_weights()
    average = {name: value.double() for name, value in start.items() if value.is_floating_point()}
    for n, (exported, trained) in enumerate(runs["stages"]):
        decay = min(DECAY, (1 + n) / (10 + n))
        assert set(trained) < set(average)  # parameters only: BatchNorm's statistics are not averaged
        for name in trained:
            average[name] = decay * average[name] + (1 - decay) * trained[name].double()
            torch.testing.assert_close(exported[name].double(), average[name], rtol=1e-6, atol=1e-7,
                                       msg=lambda text, name=name, n=n: f"step {n + 1}, {name}: {text}")
        assert not all(torch.equal(exported[name], trained[name]) for name in trained)  # not the trained weights


def test_a_damaged_ema_state_is_one_error_line_and_changes_nothing(data, runs, tmp_path):
    run = Path(shutil.copytree(runs["root"] / "split", tmp_path / "run"))
    folder = run / json.loads((run / "checkpoint.json").read_text())["directory"]
    forge_state(folder, ("run", "ema_updates"), -1)
    before = file_states(run)
    status, stderr = run_here(data, run, *OVERRIDES, f"max_steps={STEPS + 1}", resume=True)
    assert status == 1 and "Traceback" not in stderr
    assert only_line(stderr).startswith(f"error: checkpoint {folder} is damaged ({folder / 'state.json'}: field "
                                        "'run.ema_updates' must be at least 0, not -1)"), stderr
    assert_nothing_lost(before, run)


def convert(*argv) -> int:
    return convert_checkpoint.main([str(arg) for arg in argv])


def test_to_arcface_torch_continues_the_trained_weights_and_model_pt_is_the_average(runs, tmp_path, capsys):
    """arcface_torch continues training from checkpoint_gpu_*.pt with the momentum beside it: the weights there
    are the trained ones that momentum belongs to (the average has no place in its training); model.pt, the
    backbone to use, is the average (the run's backbone.pth). One line says so."""
    run = runs["root"] / "whole"
    exported, trained = saved(run)
    assert convert(run, tmp_path / "arcface", "--to", "arcface_torch", "--world-size", 1) == 0
    out = capsys.readouterr().out
    assert ("note: the run averages its backbone's weights (ema_decay=0.2): checkpoint_gpu_*.pt hold the trained "
            "weights, which arcface_torch continues with their momentum; model.pt holds the average (the run's "
            "backbone.pth); arcface_torch keeps no average, so its next save's model.pt holds its trained "
            "weights") in out
    files = torch.load(tmp_path / "arcface" / "checkpoint_gpu_0.pt", weights_only=True)["state_dict_backbone"]
    assert files.keys() == exported.keys()
    for name, value in files.items():
        assert torch.equal(value, trained[name] if name in trained else exported[name]), name
    model = torch.load(tmp_path / "arcface" / "model.pt", weights_only=True)
    assert model.keys() == exported.keys() and all(torch.equal(model[name], exported[name]) for name in model)


def test_an_import_into_an_ema_run_starts_the_average_from_the_imported_weights(runs, tmp_path):
    """arcface_torch's files hold no average: a run with ema_decay that imports them (train.py --resume, or the
    converter) starts the average from the imported weights, so the converted run's backbone.pth is those
    weights, not the seed's."""
    assert convert(runs["root"] / "whole", tmp_path / "arcface", "--to", "arcface_torch", "--world-size", 1) == 0
    settings = [arg for item in [*QUIET, *OVERRIDES] for arg in ("--set", item)]
    assert convert(tmp_path / "arcface", tmp_path / "back", "--to", "pairface", "--config", ROOT / CONFIG,
                   *settings) == 0
    imported = torch.load(tmp_path / "arcface" / "checkpoint_gpu_0.pt", weights_only=True)["state_dict_backbone"]
    exported, trained = saved(tmp_path / "back")
    for name in trained:
        assert torch.equal(trained[name], imported[name]), name
        assert torch.equal(exported[name], imported[name]), name

