"""arcface_torch's config files run unchanged: each of its configs/*.py, its keys and values regenerated from
insightface into tests/fixtures/arcface_configs/configs.json and written back as arcface_torch writes them (an
edict named config), read through `train.py CONFIG --dry-run`, means what it says; its keys pairface did not have
are honoured; a misspelt key is named in either style."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import train
from tests.run_helpers import run_here
from training.state import build_training_state
from utils.config import load_config
from utils.errors import ConfigError

# Made by `python -m tests.fixtures.arcface_configs.regenerate <insightface git dir>`: the facts of upstream's files,
# independent of the code under test.
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "arcface_configs" / "configs.json").read_text())
CONFIGS: dict[str, dict] = FIXTURE["configs"]

def written(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / "configs" / f"{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text("from easydict import EasyDict as edict\n\nconfig = edict()\n" + body)
    return path


def arcface_file(tmp_path: Path, name: str) -> Path:
    """The fixture's entry as an arcface_torch config file: `config.key = value`, tuples where upstream's were."""
    tuples = set(FIXTURE["tuples"].get(name, ()))
    lines = [f"config.{key} = {tuple(value) if key in tuples else value!r}\n" for key, value in CONFIGS[name].items()]
    return written(tmp_path, name, "".join(lines))


def dry_run(path: Path, capsys, *extra: str) -> dict:
    assert train.main([str(path), "--dry-run", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_fixture_holds_every_config_file_of_arcface_torch():
    """All 42 of configs/ (__init__.py aside) and base.py, each representable in JSON: a fixture regenerated from
    a broken checkout would otherwise make the test below vacuous."""
    assert len(CONFIGS) == 43 and "base" in CONFIGS and FIXTURE["not_represented"] == {}
    assert FIXTURE["source"]["commit"]


@pytest.mark.parametrize("name", CONFIGS)
def test_an_arcface_torch_config_file_means_what_it_says(tmp_path, capsys, name):
    resolved = dry_run(arcface_file(tmp_path, name), capsys, "--world-size", "8")
    config = resolved["config"]
    for key, value in CONFIGS[name].items():
        assert config[key] == (f"output/{name}" if key == "output" and value is None else value), key
    defaults = load_config(written(tmp_path, "empty", ""))
    untouched = set(vars(defaults)) - set(CONFIGS[name]) - {"output"}
    assert {key: config[key] for key in untouched} == json.loads(json.dumps({k: vars(defaults)[k] for k in untouched}))
    memory = resolved["memory"]
    assert memory["world_size"] == 8 and memory["total"] > memory["backbone_parameters"] > 0
    if "num_classes" in CONFIGS[name]:
        assert memory["total"] > memory["class_centres"] > 0
    else:  # base.py names no num_classes: the centres are counted once the data says how many
        assert memory["class_centres"] is None


def test_3millions_runs_with_the_lr_schedule_arcface_torch_computes_for_its_warmup_of_minus_one(tmp_path):
    """Its warmup_epoch = -1 read as train.py reads it: warmup_step = num_image // total_batch_size * -1, minus an
    epoch of steps, into PolyScheduler: no warmup, and every step's LR from its decay formula, which then starts
    below lr. Every one of the schedule's steps, on 8 processes, as training.state builds it."""
    recipe = CONFIGS["3millions"]
    assert (recipe["warmup_epoch"], recipe["num_epoch"], recipe["num_image"], recipe["batch_size"], recipe["lr"]) == (
        -1, 30, 100000, 512, 0.1)
    epoch = 100000 // (512 * 8)  # 24 steps
    total, warmup = 30 * epoch, -epoch
    cfg = load_config(arcface_file(tmp_path, "3millions"), ["num_classes=16", "embedding_size=8", "fp16=False"])
    state = build_training_state(cfg, cfg.num_classes, torch.device("cpu"), epoch)
    seen = []
    for _ in range(total + 2):
        seen.append([group["lr"] for group in state.optimizer.param_groups])
        state.optimizer.step()
        state.scheduler.step()
    # PolyScheduler.get_lr at last_epoch = step: base_lr * (1 - (step - warmup_step) / (max_steps - warmup_step)) ** 2
    expected = [0.1 * (1 - (step - warmup) / (total - warmup)) ** 2 for step in range(total)] + [0.0, 0.0]
    assert seen == [[pytest.approx(lr, rel=1e-12, abs=1e-18)] * 2 for lr in expected]
    assert seen[0][0] == pytest.approx(0.1 * (30 / 31) ** 2) and seen[-3][0] == pytest.approx(0.1 / (31 * 24) ** 2)


def test_the_webface_vit_recipe_plans_its_sampled_logits_and_adamw_state(tmp_path, capsys):
    recipe = CONFIGS["wf42m_pfc03_40epoch_8gpu_vit_t"]
    assert (recipe["num_classes"], recipe["batch_size"], recipe["sample_rate"], recipe["optimizer"]) == (
        2059906, 512, 0.3, "adamw")
    path = arcface_file(tmp_path, "wf42m_pfc03_40epoch_8gpu_vit_t")
    memory = dry_run(path, capsys, "--world-size", "8")["memory"]
    rows = 2059906 // 8 + 1  # 2059906 = 8 x 257488 + 2: ranks 0 and 1 hold one more
    assert memory["class_centres"] == rows * 512 * 4
    assert memory["centre_optimizer_state"] == 2 * memory["class_centres"]  # AdamW: two moments
    samples, columns = 512 * 1 * 8, int(0.3 * rows)  # batch x views x processes, 30% of the centres
    assert memory["logits_buffer"] >= samples * columns * 4


def test_sample_rate_zero_plans_a_column_for_every_label_of_the_global_batch(tmp_path, capsys):
    """arcface_torch's sample_rate = 0 on its 32 GPUs: only the step's positive classes, at most one per label
    of the global batch (512 x 32), far fewer than the 64373 centres rank 0 holds."""
    recipe = CONFIGS["wf42m_pfc0008_32gpu_r100"]
    assert (recipe["sample_rate"], recipe["batch_size"]) == (0, 512)
    resolved = dry_run(arcface_file(tmp_path, "wf42m_pfc0008_32gpu_r100"), capsys, "--world-size", "32")
    assert resolved["config"]["sample_rate"] == 0
    samples = labels = 512 * 32  # one view
    assert samples * labels * 4 <= resolved["memory"]["logits_buffer"] < samples * 2 * labels * 4


def test_a_misspelt_key_is_named_with_the_closest_in_either_style(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"unknown config key 'sample_rat' in config file .*; did you mean "
                                          r"'sample_rate'\?"):
        load_config(written(tmp_path, "edict_typo", "config.sample_rat = 0.1\n"))
    plain = tmp_path / "plain_typo.py"
    plain.write_text("sample_rat = 0.1\n")
    with pytest.raises(ConfigError, match="did you mean 'sample_rate'"):
        load_config(plain)


def test_two_view_training_of_an_arcface_recipe_is_two_overrides(tmp_path, capsys):
    path = arcface_file(tmp_path, "ms1mv3_r50")
    config = dry_run(path, capsys, "--set", "num_views=2", "--set", 'view_source="identity"')["config"]
    assert (config["num_views"], config["view_source"], config["num_image"]) == (2, "identity", 5179510)


def test_the_dry_run_reads_no_data_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = arcface_file(tmp_path, "ms1mv3_r50")  # its rec does not exist here
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert train.main([str(path), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "num_image = 5179510" in text and "memory per process, 1 process(es)" in text
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_num_image_is_checked_against_the_data(data, tmp_path, capsys):
    status, stderr = run_here(data, tmp_path / "run", "num_image=41")
    assert status == 1
    assert stderr.strip() == (f"error: {data} holds 40 samples but num_image=41; set num_image = 40 (or None) in "
                              "the config")
