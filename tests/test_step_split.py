"""bench_train --split (bench/step_split.py) at --tiny on this CPU: the path its GPU command takes, run for real
(the real train_step, its hooks, the FLOP count, the table). What it must get right whatever the timings: every
measured row parses, its phases are each non-negative and add up to its step (the marks follow each other in
the step: a hook that fired late, twice or not at all breaks that), its images/s is its step's, its MFU is a
share; a switch that does not apply says why in its row instead of crashing the run. Timings are never asserted.
"""
from __future__ import annotations

import re
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from bench import step_split
from tests.run_helpers import ROOT

MEASURED = re.compile(r"^(\S+)\s+(\d+) (\S+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)" + r"\s+(-?[\d.]+)" * 5
                      + r"\s+([\d.]+)%\s+(\S+)$")
NOT_RUN = re.compile(r"^(\S+)\s+(\d+) (\S+)\s+(not run on this CPU: .+|ResNets only)$")


def split_table(*options: str) -> str:
    command = [sys.executable, "-m", "bench.bench_train", "--split", "--tiny", *options]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def rows(out: str) -> tuple[dict, dict]:
    """({(network, views, switch): measured row's numbers}, {(network, views, switch): reason not run})."""
    measured, not_run = {}, {}
    for line in out.splitlines():
        if match := MEASURED.match(line):
            network, views, switch, *numbers, mfu, compile_seconds = match.groups()
            images_per_second, ratio, step, *phases = map(float, numbers)
            measured[network, int(views), switch] = dict(images_per_second=images_per_second, step=step,
                                                         phases=phases, mfu=float(mfu), compile=compile_seconds)
        elif match := NOT_RUN.match(line):
            network, views, switch, reason = match.groups()
            not_run[network, int(views), switch] = reason
    return measured, not_run


@pytest.fixture(scope="module")
def narrow() -> str:
    """r18 at the tiny width (narrower than oneDNN's NHWC strided 1x1 conv backward survives) and a ViT."""
    return split_table("--networks", "r18", "vit_t", "--views", "2", "--switches", "channels_last", "cudagraphs")


@pytest.fixture(scope="module")
def wide() -> str:
    """r18 at --split's CPU width, where channels_last runs here, with bf16."""
    return split_table("--networks", "r18", "--views", "1", "--width-mult", str(step_split.SPLIT_WIDTH),
                       "--switches", "channels_last", "bf16")


@pytest.mark.parametrize("table", ["narrow", "wide"])
def test_each_measured_row_splits_its_whole_step(table, request):
    out = request.getfixturevalue(table)
    measured, _ = rows(out)
    expected = {"narrow": {("r18", 2, "baseline"), ("vit_t", 2, "baseline")},
                "wide": {("r18", 1, "baseline"), ("r18", 1, "channels_last"), ("r18", 1, "bf16")}}[table]
    assert set(measured) == expected, out
    for key, row in measured.items():
        assert all(phase >= 0 for phase in row["phases"]), (key, out)
        # each figure is printed to 0.01 ms: six roundings apart at most
        assert sum(row["phases"]) == pytest.approx(row["step"], abs=0.04), (key, out)
        views, batch = key[1], step_split.TINY["batch_size"]
        # printed to 0.1 image/s (the step to 0.01 ms moves it far less)
        assert row["images_per_second"] == pytest.approx(batch * views / (row["step"] / 1e3), abs=0.06), (key, out)
        assert 0 < row["mfu"] <= 100, (key, out)
        assert row["compile"] == "-", (key, out)


def test_a_switch_that_cannot_run_here_says_why_in_its_row(narrow, wide):
    _, not_run = rows(narrow)
    assert not_run[("vit_t", 2, "channels_last")] == "ResNets only", narrow
    reason = not_run[("r18", 2, "channels_last")]
    assert "layer1.0.downsample.0" in reason and "4 < 16 input channels" in reason, reason
    assert not_run[("r18", 2, "cudagraphs")] == not_run[("vit_t", 2, "cudagraphs")] == (
        "not run on this CPU: CUDA graphs need a GPU"), narrow
    assert not rows(wide)[1], wide


def test_compile_is_not_run_on_this_cpu_where_inductor_would_put_that_convolution_in_nhwc():
    """Inductor's layout optimisation runs a compiled ResNet's convolutions NHWC: the same oneDNN crash."""
    cpu = torch.device("cpu")
    tiny = Namespace(embedding_size=32, width_mult=step_split.TINY["width_mult"])
    split = Namespace(embedding_size=32, width_mult=step_split.SPLIT_WIDTH)
    assert "layer1.0.downsample.0" in step_split.not_run_here("r18", "compile", tiny, cpu)
    assert step_split.not_run_here("r18", "compile", split, cpu) is None
    assert step_split.not_run_here("vit_t", "compile", tiny, cpu) is None
    assert step_split.not_run_here("r18", "bf16", tiny, cpu) is None


def test_the_header_and_footer_say_what_ran_and_what_a_gpu_needs(narrow):
    lines = narrow.splitlines()
    assert re.search(r"GEMM GFLOP/s measured here: float32 [\d.]+$", lines[0]) and "load average" in lines[0], lines[0]
    assert re.search(r"^r18 backbone SGD update: fused [\d.]+ ms \(1\.00x fused\), foreach [\d.]+ ms", narrow, re.M)
    assert "--device cuda --networks r50 r100 vit_b" in lines[-1], lines[-1]
