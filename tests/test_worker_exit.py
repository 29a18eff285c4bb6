"""A run that stops on an error ends its data workers and exits at once.

The data workers outlive an epoch and ignore SIGTERM (stopping is the training process's job): a run that
left them to the interpreter's exit waited for them forever, after printing its error line. Every run here
is a real command line in a process group of its own, so that a worker left behind is seen after the run
exits; a run that hangs fails its test at the bound, it is never waited for longer.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.run_helpers import ROOT, start_cli

EXIT_BOUND_SECONDS = 30  # from the error line to the exit of every process of the run
START_BOUND_SECONDS = 300  # imports and the first batch, on a loaded 2-core machine


def stderr_lines(process: subprocess.Popen) -> tuple[list[str], threading.Event]:
    """The process's stderr lines as they come, and an event set when the first `error:` line has come."""
    lines, error_seen = [], threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line.rstrip("\n"))
            if line.startswith("error:"):
                error_seen.set()

    threading.Thread(target=read, daemon=True).start()
    return lines, error_seen


def group_is_gone(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False


def assert_exits_after_its_error(process: subprocess.Popen, name: str, status: int = 1) -> list[str]:
    """The run prints an `error:` line, then it and every process it started are gone within the bound,
    exiting with `status`; its stderr lines."""
    lines, error_seen = stderr_lines(process)
    try:
        assert error_seen.wait(START_BOUND_SECONDS), f"{name}: no error line: {lines[-20:]}"
        process.wait(EXIT_BOUND_SECONDS)
        deadline = time.monotonic() + EXIT_BOUND_SECONDS
        while not group_is_gone(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # poll interval: workers are reaped by their parent as it exits
        assert group_is_gone(process.pid), f"{name}: a process of the run is still there after it exited"
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name}: still running {EXIT_BOUND_SECONDS} s after its error line") from None
    finally:
        if not group_is_gone(process.pid):
            os.killpg(process.pid, 9)
        process.wait()
    assert process.returncode == status, (name, process.returncode, lines[-20:])
    return lines


def assert_one_error_line(lines: list[str], output: Path) -> None:
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]], lines[-20:]
    assert not any("Traceback" in line for line in lines), lines
    logged = (output / "training.log").read_text()
    assert logged.count("error:") == 1 and "Traceback" not in logged, logged[-2000:]


def photos_of_the_wrong_shape(folder: Path) -> Path:
    """A folder of 92x112 photos, one sub-folder per person, given straight to train.py."""
    rng = np.random.default_rng(0)
    for person in range(4):
        (folder / f"s{person}").mkdir(parents=True)
        for photo in range(4):
            pixels = rng.integers(0, 256, (112, 92, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"s{person}" / f"{photo}.png")
    return folder


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """Every erroring run, started side by side (each costs seconds of imports): name -> (process, output)."""
    root = tmp_path_factory.mktemp("worker_exit")
    photos = photos_of_the_wrong_shape(root / "photos")
    setups = {f"data error, num_workers={workers}": (data, 0, None, [f"num_workers={workers}", "num_views=3"])
              for workers in (0, 1, 2)}
    setups["photo folder of another shape, num_workers=2"] = (photos, 0, None, ["num_workers=2", "batch_size=2"])
    setups["data error under torchrun, 2 processes, num_workers=1"] = (data, 2, None, ["num_workers=1",
                                                                                       "num_views=3"])
    setups["non-finite losses, num_workers=2"] = (data, 0, "1,2,3", ["num_workers=2", "max_nonfinite_steps=2"])
    started = {}
    for number, (name, (rec, nproc, nan_steps, overrides)) in enumerate(setups.items()):
        output = root / f"run{number}"
        started[name] = (start_cli(rec, output, *overrides, nproc=nproc, nan_steps=nan_steps, own_group=True,
                                   real=True), output)
    yield started
    for process, _ in started.values():
        if not group_is_gone(process.pid):
            os.killpg(process.pid, 9)
        process.wait()


@pytest.mark.slow  # six real command lines
@pytest.mark.parametrize("name", ["data error, num_workers=0", "data error, num_workers=1",
                                  "data error, num_workers=2", "photo folder of another shape, num_workers=2",
                                  "non-finite losses, num_workers=2"])
def test_an_error_in_the_loop_ends_the_workers_and_exits_with_one_line(runs, name):
    process, output = runs[name]
    assert_one_error_line(assert_exits_after_its_error(process, name), output)


def test_a_data_error_under_torchrun_ends_every_rank_and_its_workers(runs):
    name = "data error under torchrun, 2 processes, num_workers=1"
    process, output = runs[name]
    lines = assert_exits_after_its_error(process, name)
    assert any(line.startswith("error:") and "not 3 square view(s)" in line for line in lines), lines[-20:]
    logged = (output / "training.log").read_text()
    assert "not 3 square view(s)" in logged and "Traceback" not in logged, logged[-2000:]


SCRIPT = """
import sys
from dataset import build_dataset, build_loader
loader = build_loader(build_dataset(sys.argv[1], num_views=3), 4, num_workers=2)
try:
    next(iter(loader))
except Exception as error:
    print(f"error: {error}", file=sys.stderr)
"""


def test_a_loader_left_open_ends_its_workers_when_its_process_exits(data):
    """A script (or a test, or a notebook) that never closes its loader still exits: the workers are ended
    by an exit handler that runs before multiprocessing's, which would wait for them forever."""
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(data)], cwd=ROOT, stderr=subprocess.PIPE,
                               text=True, process_group=0, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = assert_exits_after_its_error(process, "a script that never closes its loader", status=0)
    assert any("not 3 square view(s)" in line for line in lines), lines
