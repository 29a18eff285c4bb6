"""Each row of the device check (gpu_acceptance/gpu_check.py) reads what a command prints: here every row's parser
reads the output of its real producing code run at the tiniest size on this CPU, so a changed output format
fails a test here instead of failing the check on the day a GPU is lent (the first hour's "PartialFC vs
float32" row found nothing after the margin families moved its columns). And a parser that finds nothing
says so in a FAILED row, never a pass.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench import bench_pfc, decode_overlap, host_syncs, memory_growth, pfc_precision
from gpu_acceptance import gpu_check
from tests.run_helpers import ROOT, run_here
from tools import check_pfc, step_memory


def printed(capsys, main: Callable[[], object]) -> str:
    capsys.readouterr()
    main()
    return capsys.readouterr().out


def check_pfc_out(capsys, monkeypatch, _data, _run) -> str:
    monkeypatch.setattr(sys, "argv", ["check_pfc", "--classes", "11", "--batch", "2", "--views", "2",
                                      "--sample-rate", "0.1"])
    return printed(capsys, check_pfc.main)


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory) -> Path:
    """A folder holding one finished two-step run, `whole` (a checkpoint at its last step)."""
    folder = tmp_path_factory.mktemp("finished")
    status, log = run_here(data, folder / "whole", "max_steps=2", "save_every_steps=2")
    assert status == 0, log
    return folder


def train_out(_capsys, _monkeypatch, _data, run) -> str:
    """train.py's log: training.log holds the lines the row reads from the command's output."""
    return (run / "whole" / "training.log").read_text()


def host_syncs_out(capsys, _monkeypatch, _data, _run) -> str:
    return printed(capsys, lambda: host_syncs.main(["--sample-rates", "0.1", "--classes", "50", "--batch-size", "2",
                                                    "--warmup", "1", "--steps", "1"]))


def memory_growth_out(capsys, _monkeypatch, _data, _run) -> str:
    return printed(capsys, lambda: memory_growth.main(["--batch-size", "2", "--warmup", "1", "--steps", "1",
                                                       "--classes", "50"]))


def pfc_precision_out(capsys, _monkeypatch, _data, _run) -> str:
    return printed(capsys, lambda: pfc_precision.main(["--classes", "50"]))


def decode_out(capsys, _monkeypatch, data, _run) -> str:
    return printed(capsys, lambda: decode_overlap.main(["--rec", str(data), "--batch-size", "2", "--batches", "1",
                                                        "--workers", "0"]))


def bench_pfc_out(_capsys, _monkeypatch, _data, _run) -> str:
    """The table's rows as main prints them, from measurements made here (main itself runs each in a process
    of its own, tens of seconds)."""
    device = torch.device("cpu")
    results = {impl: bench_pfc.measure(impl, 100, device, 1, False) for impl in bench_pfc.IMPLEMENTATIONS}
    return "\n".join(bench_pfc.table_row(100, impl, result, results["dense"]) for impl, result in results.items())


def memory_plan_out(capsys, _monkeypatch, _data, _run) -> str:
    command = ["configs/synthetic_pair.py", "--json"]
    for item in ["rec=synthetic", "embedding_size=32", "num_workers=0", "optimizer=sgd", "network=r18",
                 "network_kwargs={'width_mult':0.0625}", "batch_size=2", "num_classes=50"]:
        command += ["--set", item]
    return printed(capsys, lambda: step_memory.main(command))


def gpu_decode_out(_capsys, _monkeypatch, _data, _run) -> str:
    """The row's own pytest command (its GPU tests skip here; the summary line is the same)."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_loader.py", "-k", "gpu", "-p",
                           "no:cacheprovider", "-p", "no:randomly"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120).stdout


def pfc_step_out(_capsys, _monkeypatch, _data, _run) -> str:
    """The row's own command at its --tiny size."""
    return subprocess.run([sys.executable, "-m", "bench.bench_pfc", "--step", "--rounds", "1", "--classes", "2000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300).stdout


def resume_out(capsys, monkeypatch, _data, run) -> str:
    """The verdict script on one finished run against a copy of itself: bitwise equal by construction."""
    return verdict(copy_run(run), capsys, monkeypatch)


def copy_run(run: Path) -> Path:
    """A folder of its own holding the finished run as `whole` and a copy of it as `split`."""
    folder = Path(tempfile.mkdtemp(dir=run))
    shutil.copytree(run / "whole", folder / "whole")
    shutil.copytree(run / "whole", folder / "split")
    return folder


def verdict(folder: Path, capsys, monkeypatch) -> str:
    """What the row's verdict script prints (run here: a process of its own would spend seconds importing)."""
    monkeypatch.setattr(sys, "argv", ["-c", str(folder)])
    return printed(capsys, lambda: exec(gpu_check.RESUME_VERDICT, {"__name__": "__main__"}))


# check -> (its output made at tiny size, its parser). Every check but "data" (which times itself) parses.
FORMATS = {
    "check_pfc": (check_pfc_out, gpu_check.parse_check_pfc("0.1")),
    "train 2 views": (train_out, gpu_check.parse_train("train 2 views", 2, time.monotonic())),
    "train 1 view": (train_out, gpu_check.parse_train("train 1 view", 2, time.monotonic())),
    "train dali": (train_out, gpu_check.parse_train("train 2 views, dali=True", 2, time.monotonic())),
    "torchrun resume": (resume_out, gpu_check.parse_resume("torchrun resume", "the CPU RNG", "0 s")),
    "host syncs": (host_syncs_out, gpu_check.parse_host_syncs),
    "memory growth": (memory_growth_out, gpu_check.parse_one_line("memory growth", gpu_check.MEMORY_GROWTH_LINE,
                                                                  "line")),
    "pfc precision": (pfc_precision_out, gpu_check.parse_pfc_precision),
    "decode": (decode_out, gpu_check.parse_one_line("decode", gpu_check.DECODE_LINE, "line")),
    "bench_pfc": (bench_pfc_out, gpu_check.parse_bench_pfc),
    "pfc step": (pfc_step_out, gpu_check.parse_pfc_step),
    "memory plan": (memory_plan_out, gpu_check.parse_memory_plan(["tiny"])),
    "gpu decode": (gpu_decode_out, gpu_check.parse_one_line("gpu decode", gpu_check.PYTEST_LINE, "line")),
}


def test_every_check_but_data_has_its_format_tested_here():
    assert set(FORMATS) == set(gpu_check.BUDGETS) - {"data"}


@pytest.mark.parametrize("check", [check for check in FORMATS if check not in ("train 1 view", "train dali")])
def test_a_rows_parser_reads_what_its_command_prints(check, capsys, monkeypatch, data, finished):
    """The producing code's real output, parsed: every row passes and none says it found nothing."""
    produce, parse = FORMATS[check]
    out = produce(capsys, monkeypatch, data, finished)
    rows = list(gpu_check.parsed(check, 0, out, parse))
    assert rows and all(passed for _, _, passed in rows), (rows, out)
    if check == "pfc precision":  # a row per margin family and dtype, each with its three errors
        assert len(rows) == 2 * len(bench_pfc.FAMILIES), rows
        assert {name.split()[1] for name, _, _ in rows} == set(bench_pfc.FAMILIES)
        assert all(result.startswith("loss ") and " dX " in result and " dW " in result for _, result, _ in rows)
    if check == "bench_pfc":  # a row per implementation, PartialFC's ("pfc@RATE") among them
        assert [name.split()[2] for name, _, _ in rows] == list(bench_pfc.IMPLEMENTATIONS), rows
    if check == "pfc step":  # each cell beside its computed floor, torch's bare kernels and arcface_torch's
        cells = [result for name, result, _ in rows if name.startswith("pfc step C=")]
        cell = re.compile(r"[\d.]+ ms, [\d.]+x its floor \([\d.]+ ms\), [\d.]+x torch's bare kernels, "
                          r"[\d.]+x arcface_torch's")
        assert len(cells) == 2 and all(cell.fullmatch(result) for result in cells), rows


def test_the_train_rows_read_speed_and_steps_per_epoch(capsys, monkeypatch, data, finished):
    """The three training rows share one parser; two steps of 40 records at batch 4: 10 steps per epoch."""
    out = train_out(capsys, monkeypatch, data, finished)
    for check in ("train 2 views", "train 1 view", "train dali"):
        (name, result, passed), = gpu_check.parsed(check, 0, out, FORMATS[check][1])
        assert passed and " samples/s, " in result and "final loss " in result, result
    (name, result, passed), = gpu_check.parsed("train 2 views", 0, out, gpu_check.parse_train("t", 11, 0.0))
    assert not passed and result.startswith("FAILED: 10 steps per epoch, fewer than the 11 measured"), result


def test_the_resume_verdict_names_the_first_tensor_that_differs(finished, capsys, monkeypatch):
    folder = copy_run(finished)
    backbone = torch.load(folder / "split" / "backbone.pth", weights_only=True)
    first = next(iter(backbone))
    backbone[first] = backbone[first].clone()
    backbone[first].view(-1)[:3] += 0.25
    torch.save(backbone, folder / "split" / "backbone.pth")
    out = verdict(folder, capsys, monkeypatch)
    (name, result, passed), = gpu_check.parsed("resume", 0, out, FORMATS["torchrun resume"][1])
    assert not passed
    assert result.startswith(f"DIFFERS, first difference: backbone.pth.{first}: 3 of {backbone[first].numel()} "
                             "elements differ, the largest by 0.25"), result


@pytest.mark.parametrize("check", list(FORMATS))
def test_a_parser_that_finds_nothing_fails_its_row_saying_so(check):
    """Output in some other format (here: a line no parser knows) is a FAILED row naming what was missing."""
    rows = list(gpu_check.parsed(check, 0, "some line in another format\n", FORMATS[check][1]))
    assert len(rows) == 1
    name, result, passed = rows[0]
    assert not passed and name == check
    assert result.startswith("FAILED: found nothing to parse: no ") and result.endswith(
        "in the output (last line: some line in another format)"), result


PFC_STEP_CELL = "     2000   1.0        803.0     295.1    2.72x    193.0   4.16x             795.3            1.01x\n"


def test_a_known_line_in_another_shape_fails_its_row_and_the_checks_after_it_still_run():
    """bench_pfc --step's table gained columns once: a row of it with fields the parser does not expect is a
    FAILED row saying why, not an exception that would end the check with every later row unrun."""
    rows = list(gpu_check.parsed("pfc step", 0, "     2000   1.0        803.0     295.1\n", gpu_check.parse_pfc_step))
    assert len(rows) == 1 and not rows[0][2]
    assert rows[0][1].startswith("FAILED: could not read its output: not enough values to unpack"), rows


def test_the_pfc_step_row_without_its_profile_says_it_found_no_share():
    rows = list(gpu_check.parsed("pfc step", 0, PFC_STEP_CELL, gpu_check.parse_pfc_step))
    assert [passed for _, _, passed in rows] == [True, False]
    assert rows[0][1] == "803.0 ms, 2.72x its floor (295.1 ms), 4.16x torch's bare kernels, 1.01x arcface_torch's"
    assert rows[1][1] == "FAILED: found nothing to parse: no 'SHARE% CALLS OPERATOR' profile line in the output"
