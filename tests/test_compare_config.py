"""eval.compare reads a run's config from config.json, the run's one record of it, and an earlier pairface's
run folder (config.json with the config file and --set alone, or none: the values only in training.log's
config line) still compares beside it.

References: run folders written here by hand, in the formats train.py writes them (model.json, config.json,
training.log lines), and the expected cells spelled out as literals."""
from __future__ import annotations

import json

import pytest

from eval import compare
from tests.test_eval_cli import assert_one_sentence

# The values a run resolved, as config.json records them (JSON: the config's tuples are lists).
RECORDED = {"lr": 0.1, "num_epoch": 16, "margin_family": "combined", "margin_list": [1.0, 0.0, 0.35],
            "margin_scale": 32.0, "network_kwargs": {"width_mult": 0.0625}, "val_targets": ["lfw"],
            "output": "output/new", "resume": False}
# The same run's config line in training.log, as train.py logs it (each value's repr, keys sorted).
LOG_LINE = ("Training: 2026-12-05 10:00:00,000-config: lr=0.1, margin_family='combined', "
            "margin_list=(1.0, 0.0, 0.35), margin_scale=32.0, network_kwargs={'width_mult': 0.0625}, "
            "num_epoch=16, output='output/NAME', resume=False, val_targets=('lfw',)\n")


def run_folder(tmp_path, name: str, config_json: dict | None, log_line: str | None):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.json").write_text(json.dumps({"network": "r18", "network_kwargs": {"width_mult": 0.0625},
                                                   "embedding_size": 8, "num_classes": 20}))
    if config_json is not None:
        (folder / "config.json").write_text(json.dumps(config_json, indent=2))
    lines = [log_line.replace("NAME", name)] if log_line else []
    lines.append("Training: 2026-12-05 10:01:00,000-training finished at global step 80: no val_targets\n")
    (folder / "training.log").write_text("".join(lines))
    return folder


def test_the_config_comes_from_config_json_even_where_the_log_says_otherwise(tmp_path):
    stale = LOG_LINE.replace("lr=0.1", "lr=0.5").replace("num_epoch=16", "num_epoch=2")
    folder = run_folder(tmp_path, "new", {"config_file": "configs/x.py", "set": [], "config": RECORDED}, stale)
    assert compare.read_run(folder).config == {
        "lr": "0.1", "num_epoch": "16", "margin_family": "'combined'", "margin_list": "(1.0, 0.0, 0.35)",
        "margin_scale": "32.0", "network_kwargs": "{'width_mult': 0.0625}", "val_targets": "('lfw',)",
        "output": "'output/new'", "resume": "False"}
    # Without any config line at all: the record alone.
    bare = run_folder(tmp_path, "bare", {"config_file": "configs/x.py", "set": [], "config": RECORDED}, None)
    assert compare.read_run(bare).config["num_epoch"] == "16"


@pytest.mark.parametrize("config_json", [None, {"config_file": "configs/x.py", "set": ["num_epoch=16"]}],
                         ids=["no config.json", "config.json of the config file and --set alone"])
def test_an_earlier_versions_run_folder_gives_its_config_by_the_log_line(tmp_path, config_json):
    folder = run_folder(tmp_path, "old", config_json, LOG_LINE)
    assert compare.read_run(folder).config == {
        "lr": "0.1", "num_epoch": "16", "margin_family": "'combined'", "margin_list": "(1.0, 0.0, 0.35)",
        "margin_scale": "32.0", "network_kwargs": "{'width_mult': 0.0625}", "val_targets": "('lfw',)",
        "output": "'output/old'", "resume": "False"}


def test_a_new_and_an_old_run_side_by_side_differ_only_where_their_values_do(tmp_path, capsys):
    new = run_folder(tmp_path, "new", {"config_file": "configs/x.py", "set": [],
                                       "config": {**RECORDED, "lr": 0.2}}, None)
    old = run_folder(tmp_path, "old", None, LOG_LINE)
    assert compare.main([str(new), str(old), "--plot", str(tmp_path / "runs.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [cell.strip() for cell in lines[1].strip("|").split("|")]
    rows = [dict(zip(header, [cell.strip() for cell in line.strip("|").split("|")])) for line in lines[3:5]]
    assert [(row["margin"], row["differs"], row["steps"]) for row in rows] == [
        ("combined (1.0, 0.0, 0.35) s=32.0", "lr=0.2", "80"), ("combined (1.0, 0.0, 0.35) s=32.0", "lr=0.1", "80")]


@pytest.mark.parametrize("content, said", [
    ('{"config": ', "cannot be read as JSON"),
    ('{"config_file": "x.py", "set": [], "config": [1, 2]}', "holds no mapping of config keys to values"),
    ('["lr=0.1"]', "holds no mapping of config keys to values")])
def test_a_damaged_config_json_is_one_sentence_naming_it(tmp_path, capsys, content, said):
    folder = run_folder(tmp_path, "damaged", None, LOG_LINE)
    (folder / "config.json").write_text(content)
    with pytest.raises(SystemExit):
        compare.main([str(folder), "--plot", str(tmp_path / "runs.png")])
    line = assert_one_sentence(capsys.readouterr().err)
    assert said in line and str(folder / "config.json") in line and "move the damaged config.json away" in line
