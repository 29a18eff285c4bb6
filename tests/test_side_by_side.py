"""gpu_acceptance/side_by_side.py without arcface_torch running (it needs CUDA): the Speed lines of both programs read
as their logging code writes them, the `verbose` fix applied exactly when the running torch refuses the argument, the
mxnet stand-in only for synthetic data, a failed fetch as one sentence, and the --tiny rehearsal (pairface's side
for real, one train.py process) printing a table that parses."""
from __future__ import annotations

import logging
import re
import subprocess

import pytest
import torch

from gpu_acceptance import side_by_side
from gpu_acceptance.side_by_side import (
    ARCFACE_SPEED,
    PAIRFACE_SPEED,
    SideBySideError,
    arcface_environment,
    copy_arcface_torch,
    fetch_arcface_torch,
    mean_of_last,
    scheduler_takes_verbose,
    speeds,
    without_verbose,
)
from tests.run_helpers import ROOT
from tests.test_arcface import UPSTREAM_SCHEDULER
from utils.log import LOG_FORMAT, SpeedLogger

# arcface_torch's log, as its code writes it: utils/utils_logging.py's init_logging formats every line
# "Training: %(asctime)s-%(message)s", and utils/utils_callbacks.py's CallBackLogging writes
#   "Speed %.2f samples/sec   Loss %.4f   LearningRate %.6f   Epoch: %d   Global Step: %d   "
#   "Fp16 Grad Scale: %2.f   Required: %1.f hours"   (fp16; without fp16 the grad scale is left out)
# after `: key   value` lines of the config; speed_total is inf when no time passed.
ARCFACE_LOG = """\
Training: 2026-12-03 14:02:11,512-rank_id: 0
Training: 2026-12-03 14:02:11,902-: frequent                 10
Training: 2026-12-03 14:02:31,044-Speed 1466.31 samples/sec   Loss 44.1852   LearningRate 0.020000   Epoch: 0   \
Global Step: 20   Fp16 Grad Scale: 65536   Required: 3 hours
Training: 2026-12-03 14:02:31,889-Speed 1512.90 samples/sec   Loss 43.9961   LearningRate 0.020000   Epoch: 0   \
Global Step: 30   Fp16 Grad Scale: 65536   Required: 3 hours
Training: 2026-12-03 14:02:32,731-Speed 1530.10 samples/sec   Loss 43.8804   LearningRate 0.019999   Epoch: 0   \
Global Step: 40   Required: 3 hours
Training: 2026-12-03 14:02:32,731-Speed inf samples/sec   Loss 43.8804   LearningRate 0.019999   Epoch: 0   \
Global Step: 50   Required: 3 hours
"""


def pairface_line(step: int) -> str:
    """A log line of pairface's own SpeedLogger, formatted as training.log writes it."""
    logger = SpeedLogger(frequent=1, total_steps=10, global_batch=128, num_views=2)
    message = logger(step, torch.tensor([44.0, 43.0, 45.0]), epoch=0, lr=0.02)
    return logging.Formatter(LOG_FORMAT).format(logging.makeLogRecord({"msg": message}))


def test_arcface_speed_lines_are_read_as_its_callback_writes_them():
    assert speeds(ARCFACE_LOG, ARCFACE_SPEED) == [1466.31, 1512.90, 1530.10, float("inf")]
    assert speeds(ARCFACE_LOG, PAIRFACE_SPEED) == []  # neither program's lines pass for the other's
    assert mean_of_last([1466.31, 1512.90, 1530.10], 2) == pytest.approx((1512.90 + 1530.10) / 2)


def test_pairface_speed_lines_are_read_as_its_speed_logger_writes_them():
    line = pairface_line(1)
    written = float(re.search(r"Speed (\S+) samples/sec", line)[1])
    assert speeds(f"noise\n{line}\n{line}\n", PAIRFACE_SPEED) == [written, written]
    assert speeds(line, ARCFACE_SPEED) == []
    with pytest.raises(ValueError, match="no Speed line"):
        mean_of_last([], 3)


def accepts_verbose() -> bool:
    """The reference: whether a scheduler built on torch's base class can be given verbose=False."""
    class Constant(torch.optim.lr_scheduler.LRScheduler):
        def get_lr(self):
            return list(self.base_lrs)

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    try:
        Constant(optimizer, verbose=False)
    except TypeError:
        return False
    return True


def test_the_verbose_fix_is_wanted_exactly_when_torch_refuses_the_argument_and_then_makes_it_start():
    assert scheduler_takes_verbose() == accepts_verbose()
    patched = without_verbose(UPSTREAM_SCHEDULER)
    assert "super().__init__(optimizer, last_epoch=last_epoch)\n" in patched
    assert patched.replace("super().__init__(optimizer, last_epoch=last_epoch)",
                           "super().__init__(optimizer, last_epoch=last_epoch, verbose=verbose)") == UPSTREAM_SCHEDULER
    assert without_verbose(patched) is None  # a file that passes no verbose is left alone
    names: dict = {}
    exec(patched, names)  # the patched class starts under the running torch
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = names["PolynomialLRWarmup"](optimizer, warmup_iters=10, total_iters=100)
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [pytest.approx(0.01)]  # the warmup's first step: 0.1 * 1/10


def test_the_copy_is_patched_only_when_needed_and_the_folder_given_never_changes(tmp_path, monkeypatch):
    source = tmp_path / "arcface_torch"
    source.mkdir()
    (source / "train_v2.py").write_text("# train_v2\n")
    (source / "lr_scheduler.py").write_text(UPSTREAM_SCHEDULER)
    for refused in (True, False):
        monkeypatch.setattr(side_by_side, "scheduler_takes_verbose", lambda refused=refused: not refused)
        work = tmp_path / f"work-{refused}"
        copy, notes = copy_arcface_torch(source, work)
        assert copy.parent == work and (copy / "train_v2.py").is_file()
        assert ("verbose=verbose" not in (copy / "lr_scheduler.py").read_text()) == refused
        assert [("`verbose`" in note and torch.__version__ in note) for note in notes] == ([True] if refused else [])
    assert (source / "lr_scheduler.py").read_text() == UPSTREAM_SCHEDULER
    with pytest.raises(SideBySideError, match=r"holds no train_v2.py; pass insightface's recognition/arcface_torch"):
        copy_arcface_torch(tmp_path, tmp_path / "again")


@pytest.mark.skipif(side_by_side.importable("mxnet"), reason="mxnet is installed here: no stand-in is made")
def test_mxnet_gets_a_stand_in_for_synthetic_data_only(tmp_path):
    with pytest.raises(SideBySideError, match=r"reads rec='/data/ms1mv3' with mxnet.*install mxnet"):
        arcface_environment(tmp_path, "/data/ms1mv3", "r50")
    environment, notes = arcface_environment(tmp_path, "synthetic", "r50")
    standins = environment["PYTHONPATH"].split(":")[0]
    assert (tmp_path / "standins" / "mxnet" / "ndarray.py").is_file() and standins == str(tmp_path / "standins")
    assert len(notes) == 1 and "stand-in" in notes[0]


def test_a_failed_fetch_says_to_pass_the_folder(tmp_path, monkeypatch):
    def offline(command, **_):
        assert command[:2] == ["git", "clone"] and "https://github.com/deepinsight/insightface" in command
        return subprocess.CompletedProcess(command, 128, "", "Cloning...\nfatal: unable to access "
                                           "'https://github.com/deepinsight/insightface/': Could not resolve host\n")

    monkeypatch.setattr(side_by_side.subprocess, "run", offline)
    with pytest.raises(SideBySideError) as raised:
        fetch_arcface_torch(tmp_path)
    message = str(raised.value)
    assert "Could not resolve host" in message and "pass --arcface-torch DIR" in message and "\n" not in message


def test_a_config_arcface_torch_cannot_read_is_one_sentence(capsys):
    assert side_by_side.main(["--tiny", "--config", str(ROOT / "configs" / "synthetic_pair.py")]) == 2
    error = capsys.readouterr().err
    assert "not in arcface_torch's style" in error and error.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the full comparison would start")
def test_without_cuda_only_the_rehearsal_runs(capsys):
    assert side_by_side.main([]) == 2
    assert "pass --tiny" in capsys.readouterr().err


def test_the_tiny_rehearsal_runs_pairface_and_prints_a_table_that_parses(tmp_path, capsys):
    """The one process of this file: train.py through the command's own path, arcface_torch's copy prepared."""
    source = tmp_path / "arcface_torch"
    (source / "configs").mkdir(parents=True)
    (source / "train_v2.py").write_text("# train_v2\n")
    (source / "lr_scheduler.py").write_text(UPSTREAM_SCHEDULER)
    (source / "configs" / "base.py").write_text("from easydict import EasyDict as edict\nconfig = edict()\n"
                                                "config.num_workers = 7\nconfig.seed = 2048\n")
    before = sorted(path.name for path in ROOT.iterdir())
    assert side_by_side.main(["--tiny", "--arcface-torch", str(source)]) == 0
    out = capsys.readouterr().out
    table = dict(re.findall(r"^(arcface_torch|pairface) +(\S+)  .*$", out, re.MULTILINE))
    assert table.keys() == {"arcface_torch", "pairface"}
    assert table["arcface_torch"] == "-"
    assert re.search(r"^arcface_torch +- +not run: its train_v2.py needs CUDA", out, re.MULTILINE)
    assert float(table["pairface"]) > 0
    assert re.search(r"^pairface +\S+  mean of the last 2 of 3 lines \(the first 1 left out\), GPU memory -$", out,
                     re.MULTILINE)
    assert "ratio pairface / arcface_torch: not measured" in out
    assert f"torch {torch.__version__}" in out.splitlines()[0]
    assert ("patched lr_scheduler.py" in out) == (not accepts_verbose())
    assert "num_workers 7 (arcface_torch) and 2 (pairface)" in out  # the config leaves it to each program
    assert "seed" not in out.split("defaults the config leaves")[1].splitlines()[0]  # the same in both
    assert sorted(path.name for path in ROOT.iterdir()) == before  # nothing fetched or written in the repository
