"""A margin family and a backbone added the way issue 52 asks: one file (here, this one: the class and its
declaration) and one registration line (here, `monkeypatch.setitem` into the registry), with no other file edited.
Each then goes through the real code paths: the config loader (its own key, its range, its one-line errors), a
training run with verification, the --dry-run memory plan, eval.compare; and the backbone through get_model,
backbone.pth, load_backbone and suggest_network. Expected values come from references written here (a dense
float64 CosFace loss, the module's own parameter bytes, the widths it was built with), not from the code under test.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import train
from backbones import get_model, load_backbone, read_state_dict, suggest_network
from backbones.base import Backbone, FaceBackbone, scaled_width
from backbones.registry import REGISTRY
from eval.compare import comparison_table, read_run
from losses import Family, Margin, MarginFamily
from margin_families import FAMILIES
from tests.run_helpers import run_here
from training.config import load_config
from training.state import build_networks
from utils.config import KeyRule
from utils.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "synthetic_pair.py"


# --- the new margin family: its one file ----------------------------------------------------------------------

class AdditiveCosine(MarginFamily, Margin):
    """Target logit s * (cos - m), stateless: the smallest family there is."""

    def __init__(self, s: float, m: float):
        self.s, self.m = s, m

    def __repr__(self) -> str:
        return f"AdditiveCosine(s={self.s}, m={self.m})"

    def initial_state(self) -> list[float]:
        return []

    def bind(self, state: torch.Tensor, rows, target_cos: torch.Tensor | None) -> AdditiveCosine:
        return self

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        return self.s * (cos - self.m)


ADDCOS = Family("addcos", lambda cfg: AdditiveCosine(cfg.margin_scale, cfg.addcos_m),
                keys=(KeyRule("addcos_m", lambda v: 0.0 <= v < 1.0, "in [0, 1)", "0.35", type=float, default=0.35),),
                shown=("addcos_m",))


@pytest.fixture
def addcos(monkeypatch):
    monkeypatch.setitem(FAMILIES, ADDCOS.name, ADDCOS)  # the registration line


# --- the new backbone: its one file ---------------------------------------------------------------------------

class TinyNet(FaceBackbone):
    """One strided convolution, pooled to 4x4, then the embedding head."""

    def __init__(self, num_features: int = 512, dropout: float = 0.0, width_mult: float = 1.0):
        super().__init__()
        width = scaled_width(8, width_mult)
        self.stem = nn.Conv2d(3, width, 3, stride=4, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.prelu = nn.PReLU(width)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(width * 16, num_features)
        self.features = nn.BatchNorm1d(num_features)

    def forward_trunk(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.flatten(self.pool(self.prelu(self.bn(self.stem(x)))), 1))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(self.fc(x))


TINY = Backbone(TinyNet, "stem.weight", 8)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(REGISTRY, "tiny", TINY)  # the registration line


# --- the family -----------------------------------------------------------------------------------------------

def test_the_familys_own_key_exists_only_once_it_is_registered(monkeypatch):
    with pytest.raises(ConfigError, match="unknown config key 'addcos_m'"):
        load_config(CONFIG, ["addcos_m=0.3"])
    monkeypatch.setitem(FAMILIES, ADDCOS.name, ADDCOS)
    cfg = load_config(CONFIG, ["margin_family=addcos", "addcos_m=0.3"])
    assert (cfg.margin_family, cfg.addcos_m) == ("addcos", 0.3)
    assert load_config(CONFIG).addcos_m == 0.35  # its declared default, whichever family is chosen


@pytest.mark.parametrize("overrides, message", [
    (["margin_family=addcos", "addcos_m=1.5"],
     "config key 'addcos_m' must be in [0, 1) for margin_family='addcos', not 1.5; e.g. addcos_m=0.35"),
    (["margin_family=addcos", "addcos_m='big'"],
     "config key 'addcos_m' must be float, not str 'big' (from --set addcos_m='big'); e.g. addcos_m=0.35"),
    (["margin_family=addcos", "interclass_filtering_threshold=0.3"],
     "config key 'interclass_filtering_threshold' filters the combined margin's negatives only, not those of "
     "margin_family='addcos'; set it to 0"),
    (["margin_family=addcoss"], "config key 'margin_family' names no margin family 'addcoss'; did you mean 'addcos'? "
     "(the families: 'combined', 'subcenter', 'adaface', 'curricular', 'elastic_arc', 'elastic_cos', 'addcos')"),
])
def test_the_familys_bad_values_are_one_line(addcos, capsys, overrides, message):
    assert train.main([str(CONFIG), *[part for item in overrides for part in ("--set", item)], "--dry-run"]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"


def test_the_family_builds_the_classifier_whose_loss_is_the_dense_cosface_loss(addcos):
    """build_networks through the registry; the reference is written here in float64 from the formula."""
    s, m, classes, batch = 32.0, 0.3, 6, 5
    cfg = load_config(CONFIG, ["margin_family=addcos", f"addcos_m={m}", f"margin_scale={s}", "embedding_size=8",
                               "network_kwargs={'width_mult': 0.0625}"])
    _, pfc = build_networks(cfg, classes, torch.device("cpu"))
    pfc = pfc.double()
    generator = torch.Generator().manual_seed(3)
    views = [torch.randn(batch, 8, generator=generator, dtype=torch.float64) for _ in range(2)]
    labels = torch.randint(0, classes, (batch,), generator=generator)
    loss, _ = pfc([view.clone() for view in views], labels)
    centres = F.normalize(pfc.weight.detach())
    targets = F.one_hot(labels, classes).double()
    expected = sum(0.5 * F.cross_entropy(s * (F.normalize(view) @ centres.t() - m * targets), labels) for view in views)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-10, atol=1e-12)


def test_the_family_trains_verifies_and_eval_compare_shows_its_key(addcos, data, tmp_path):
    output = tmp_path / "run"
    status, stderr = run_here(data, output, "margin_family=addcos", "addcos_m=0.25", "max_steps=2",
                              "val_targets=('synthetic_val',)", "verbose=2")
    assert status == 0, stderr
    log = (output / "training.log").read_text()
    assert "margin addcos: AdditiveCosine(s=64.0, m=0.25)" in log
    assert "[synthetic_val][2]Accuracy-Flip:" in log
    losses = [float(value) for value in re.findall(r"Loss ([\d.]+)", log)]
    assert losses and all(math.isfinite(value) for value in losses)
    assert "addcos 0.25 s=64.0" in comparison_table([read_run(output)])


def test_the_memory_plan_of_the_family_is_cosfaces_whose_margin_it_is(addcos, capsys):
    """Same softmax, same buffers: its plan equals the combined family's with CosFace's margin_list; its centres are
    one row of embedding_size float32 per class (sub-centres are the families' that declare them)."""
    base = ["num_classes=1000", "embedding_size=64", "margin_scale=64.0"]

    def plan(*overrides: str) -> dict:
        assert train.main([str(CONFIG), *[part for item in (*base, *overrides) for part in ("--set", item)],
                           "--dry-run", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["memory"]

    ours = plan("margin_family=addcos", "addcos_m=0.35")
    cosface = plan("margin_list=(1.0, 0.0, 0.35)")
    assert ours == cosface
    assert ours["class_centres"] == 1000 * 64 * 4


# --- the backbone ---------------------------------------------------------------------------------------------

def test_the_backbone_exists_only_once_it_is_registered(monkeypatch):
    with pytest.raises(ConfigError, match="unknown network 'tiny'"):
        get_model("tiny")
    monkeypatch.setitem(REGISTRY, "tiny", TINY)
    with pytest.raises(ConfigError, match="unknown network 'tinyy'; did you mean 'tiny'?"):
        get_model("tinyy")
    with pytest.raises(ConfigError, match=r"get_model\('tiny'\) got unknown option\(s\) mask_ratio; use only "
                                          "num_features, dropout, fp16, width_mult$"):
        get_model("tiny", mask_ratio=0.1)
    embeddings = get_model("tiny", num_features=24, width_mult=0.5).eval()(torch.zeros(2, 3, 112, 112))
    assert embeddings.shape == (2, 24)


def test_the_backbone_trains_verifies_and_its_weights_load_and_are_recognised(tiny, data, tmp_path):
    output = tmp_path / "run"
    status, stderr = run_here(data, output, "network=tiny", "network_kwargs={'width_mult': 2.0}", "max_steps=2",
                              "val_targets=('synthetic_val',)", "verbose=2")
    assert status == 0, stderr
    assert "[synthetic_val][2]Accuracy-Flip:" in (output / "training.log").read_text()
    assert json.loads((output / "model.json").read_text())["network"] == "tiny"
    weights = output / "backbone.pth"
    loaded = load_backbone("tiny", weights, width_mult=2.0, num_features=32)
    assert isinstance(loaded, TinyNet) and loaded.stem.weight.shape == (16, 3, 3, 3)
    # built here with the widths the file must be recognised by
    assert suggest_network(read_state_dict(weights)) == "network tiny, width_mult=2, num_features=32"


def test_the_memory_plan_holds_the_backbones_own_parameters_and_statistics(tiny, capsys):
    """backbone_parameters: its parameters and its BatchNorm statistics twice (a skipped step puts them back)."""
    assert train.main([str(CONFIG), "--set", "network=tiny", "--set", "network_kwargs={}", "--set",
                       "embedding_size=16", "--set", "num_classes=100", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["memory"]
    model = TinyNet(num_features=16)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert plan["backbone_parameters"] == parameters + 2 * buffers
    assert plan["activations"] > 0 and plan["total"] > plan["backbone_parameters"]


def test_the_configs_network_check_lists_the_registered_backbone(tiny, capsys):
    assert train.main([str(CONFIG), "--set", "network=tinyy", "--dry-run"]) == 1
    assert "unknown network 'tinyy'; did you mean 'tiny'?" in capsys.readouterr().err
