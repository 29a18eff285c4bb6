"""What users see when something is wrong: one sentence on stderr and a non-zero exit, nothing
already written lost; and the non-finite loss guard."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

import train
from dataset import RecordReader, RecordWriter, pack, unpack
from gpu_acceptance.runs import load_run
from tests.nan_injection import nan_at_steps
from tests.run_helpers import continue_command, run_here, start_cli
from tests.test_train import TINY, train_here

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
     "error: config key 'rec' names data folder /no/such/folder, which does not exist; point rec at the folder "
     "holding train.rec/train.idx, e.g. --set rec=/data/ms1mv3"),
    (["configs/synthetic_pair.py", "--set", "rec=no/such/folder"],
     f"error: config key 'rec' names data folder no/such/folder (looked up from {ROOT}), which does not exist; "
     "point rec at the folder holding train.rec/train.idx, e.g. --set rec=/data/ms1mv3"),
    (["configs/synthetic_pair.py", "--set", "val_targets=orl_val"],
     "error: config key 'val_targets' must be tuple[str, ...], not str 'orl_val' (from --set val_targets=orl_val); "
     "write a tuple, e.g. --set \"val_targets=('orl_val',)\""),
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
    result = train_here(data, tmp_path / "never_ran", resume=True)
    assert result.returncode == 1
    assert only_line(result.stderr) == (
        f"error: --resume continues the run in the output folder, but {tmp_path / 'never_ran'} does not exist; start "
        "without --resume, or point output at the run's folder (--set output=<folder>)")


def test_nonfinite_losses_skip_steps_and_too_many_in_a_row_stop_the_run(data, tmp_path):
    """40 records, batch 4: 10 steps per epoch, a checkpoint at step 10. NaN at step 2 is skipped and
    training goes on; NaN at 12 and 13 (max 2 in a row) stops it with the step-10 checkpoint intact."""
    output = tmp_path / "run"
    with nan_at_steps({2, 12, 13}):
        result = train_here(data, output, "max_nonfinite_steps=2", "verbose=100")
    assert result.returncode == 1
    command = continue_command(data, output, "max_nonfinite_steps=2", "verbose=100", base=TINY)
    assert only_line(result.stderr) == (
        f"error: stopped at global step 13: 2 non-finite losses in a row (max_nonfinite_steps=2); the last good "
        f"checkpoint.json in {output} is untouched (continue with: {command}); lower lr, try bf16 instead of fp16, "
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
    # Started again without --resume, the run (at step 10 of 20) is told the command that continues it.
    assert run_here(data, output, "max_nonfinite_steps=2", "verbose=100", base=TINY) == (1, (
        f"error: output folder {output} already holds a run (backbone.pth, checkpoint-000000010, checkpoint.json); "
        f"continue it with: {command}, or choose a new folder with --set output=<folder>\n"))


def copy_with_bad_records(data: Path, output: Path, bad_samples: set[int]) -> Path:
    """A copy of the data set whose records of these samples (sample i is key i + 1) hold no image."""
    output.mkdir()
    reader = RecordReader(str(data / "train.idx"), str(data / "train.rec"))
    with RecordWriter(str(output / "train.idx"), str(output / "train.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header, b"garbage" if key - 1 in bad_samples else payload))
    return output


def test_under_torchrun_each_rank_reports_its_own_error_and_a_config_error_once(data, tmp_path):
    """Every record rank 1 reads is damaged, none of rank 0's (the order is DistributedSampler's): only rank 1
    stops with a user error, and says so on a line of its own marked [rank 1]. Rank 0, unless torchrun ends it
    first, says in one line (no traceback) that it lost contact. A config error, the same on every process, is
    printed once, by rank 0, also when rank 0 prints it only after rank 1 is done with it (tests.verdict_injection):
    rank 1 waits for rank 0's verdict instead of exiting, which would have torchrun end rank 0 before its line."""
    rank1 = list(DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=True))
    bad = copy_with_bad_records(data, tmp_path / "bad", set(rank1))
    markers = tmp_path / "markers"
    markers.mkdir()
    runs = [start_cli(bad, tmp_path / "bad_run", "seed=5", "max_steps=2", nproc=2),
            start_cli(data, tmp_path / "typo", "lrr=0.1", nproc=2,
                      injection=["-m", "tests.verdict_injection", str(markers)])]
    data_error, config_error = [(run.communicate(timeout=400)[1], run.returncode)[::-1] for run in runs]

    status, stderr = data_error
    assert status != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert not re.search(r"^\[rank\d+\]:", stderr, re.MULTILINE), stderr[-3000:]  # a rank's traceback
    lost_contact = [line for line in errors if "lost contact" in line]
    # gloo's words for the peer's end depend on the moment it went: "closed" (its socket was shut while this rank
    # read) or "reset" (while this rank wrote), the latter also as "Read error <address>: Connection reset by peer";
    # all are the lost peer utils.distributed.lost_peer names.
    assert all(re.fullmatch(r"error: lost contact with another process \((Read error \S+: )?Connection (closed|reset) "
                            r"by peer.*\), which "
                            r"stopped or became unreachable: its own error line, .*", line) for line in lost_contact), \
        lost_contact
    errors = [line for line in errors if line not in lost_contact]
    assert len(errors) == 1, stderr[-3000:]
    assert re.fullmatch(rf"error: \[rank 1\] {bad}/train.rec record key (\d+) is not a decodable image \(.*\); "
                        r"re-pack the dataset or pass skip_bad_records=True to skip such records", errors[0]), errors[0]
    assert int(re.search(r"key (\d+)", errors[0]).group(1)) - 1 in rank1

    status, stderr = config_error
    assert status != 0
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        "error: unknown config key 'lrr' in --set lrr=0.1; did you mean 'lr'? (every key is listed in configs/base.py)"]
    assert (markers / "rank1").exists()  # rank 0's line came after rank 1 was done with the error


def test_a_missing_verification_set_stops_the_run_before_its_first_step(data, tmp_path):
    output = tmp_path / "run"
    status, stderr = run_here(data, output, "val_targets=('lfw',)")
    assert status == 1
    assert only_line(stderr) == (
        f"error: val_targets entry 'lfw': no verification set at {data}/lfw.bin; put lfw.bin in {data}, list its full "
        "path, or remove it from val_targets")
    assert not output.exists()  # checked with the config, before the run folder, the model or the data
