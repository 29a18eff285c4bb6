"""What users see when something is wrong: one sentence on stderr and a non-zero exit, nothing
already written lost; and the non-finite loss guard."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from tests.run_helpers import load_run
from tests.test_train import train as run_train
from train import DEBUG_NAN_STEPS_VARIABLE

ROOT = Path(__file__).resolve().parent.parent


def only_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_unknown_key_exits_non_zero_with_one_sentence_from_the_command_line():
    result = subprocess.run([sys.executable, "train.py", "configs/synthetic_pair.py", "--set", "lrr=0.1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert only_line(result.stderr) == ("error: unknown config key 'lrr' in --set lrr=0.1; did you mean 'lr'? "
                                        "(every key is listed in configs/base.py)")
    assert result.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["configs/synthetic_pair.py", "--set", "batch_size=big"],
     "error: config key 'batch_size' must be int, not str 'big' (from --set batch_size=big); see configs/base.py"),
    (["configs/synthetic_pair.py", "--set", "rec=/no/such/folder"],
     "error: data folder '/no/such/folder' (config key 'rec') does not exist; point rec at the folder holding "
     "train.rec/train.idx, e.g. --set rec=/data/ms1mv3"),
    (["configs/no_such_config.py"],
     "error: config file configs/no_such_config.py does not exist; pass an existing configs/*.py file such as "
     "configs/synthetic_pair.py"),
])
def test_config_errors_are_one_sentence_and_exit_non_zero(capsys, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    assert train.main(args) == 1
    captured = capsys.readouterr()
    assert only_line(captured.err) == message
    assert captured.out == ""


def test_resume_without_a_run_says_there_is_nothing_to_resume(data, tmp_path):
    result = run_train(data, tmp_path / "never_ran", resume=True)
    assert result.returncode == 1
    assert re.fullmatch(r"error: resume source .*never_ran does not exist; point resume at a run folder, a "
                        r"checkpoint.json or a backbone .pth file", only_line(result.stderr))


def test_nonfinite_losses_skip_steps_and_too_many_in_a_row_stop_the_run(data, tmp_path):
    """40 records, batch 4: 10 steps per epoch, a checkpoint at step 10. NaN at step 2 is skipped and
    training goes on; NaN at 12 and 13 (max 2 in a row) stops it with the step-10 checkpoint intact."""
    output = tmp_path / "run"
    result = run_train(data, output, "max_nonfinite_steps=2", "verbose=100", env={DEBUG_NAN_STEPS_VARIABLE: "2,12,13"})
    assert result.returncode == 1
    assert only_line(result.stderr) == (
        f"error: stopped at global step 13: 2 non-finite losses in a row (max_nonfinite_steps=2); the last good "
        f"checkpoint.json in {output} is untouched (continue with --resume); lower lr, try bf16 instead of fp16, "
        "or check the data")
    log = (output / "training.log").read_text()
    assert "Global Step 2: non-finite loss, step skipped (1 in a row, 1 in this run)" in log
    assert "Global Step 13: non-finite loss, step skipped (2 in a row, 3 in this run)" in log
    checkpoint = load_run(output)
    assert checkpoint["progress"]["global_step"] == 10
    assert checkpoint["progress"]["nonfinite_total"] == 1
    assert all(torch.isfinite(v).all() for v in checkpoint["backbone"].values() if v.is_floating_point())
    assert torch.isfinite(checkpoint["class_centres"]).all()
    backbone = torch.load(output / "backbone.pth", weights_only=True)  # also from step 10
    assert all(torch.equal(backbone[k], v) for k, v in checkpoint["backbone"].items())
