"""A run that stops on an error ends its data workers and exits at once.

The data workers outlive an epoch and ignore SIGTERM (stopping is the training process's job): a run that
left them to the interpreter's exit waited for them forever, after printing its error line. Every run here
is a command line in a process group of its own, so that a worker left behind is seen after the run exits,
ending as the interpreter ends (its threads, then its exit handlers: tests/forked_commands.py); a run that
hangs fails its test at the bound, it is never waited for longer.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.forked_commands import ForkedCommand
from tests.run_helpers import ROOT, start_cli

EXIT_BOUND_SECONDS = 30  # from the error line to the exit of every process of the run
START_BOUND_SECONDS = 300  # imports and the first batch, on a loaded 2-core machine


def console_lines(console: Path) -> list[str]:
    """What the command has printed so far (stdout and stderr together), line by line."""
    return console.read_text(errors="replace").splitlines() if console.exists() else []


def group_is_gone(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False


def assert_exits_after_its_error(process: subprocess.Popen | ForkedCommand, console: Path, name: str,
                                 status: int = 1) -> list[str]:
    """The run prints an `error:` line, then it and every process it started are gone within the bound,
    exiting with `status`; its console lines."""
    deadline = time.monotonic() + START_BOUND_SECONDS
    try:
        while True:
            ended = process.poll() is not None  # first: a run that ended has printed all it will
            if any(line.startswith("error:") for line in console_lines(console)):
                break
            assert not ended and time.monotonic() < deadline, f"{name}: no error line: {console_lines(console)[-20:]}"
            time.sleep(0.05)  # poll interval of the console file
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
    lines = console_lines(console)
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
def runs(data, tmp_path_factory) -> dict[str, tuple[ForkedCommand, Path, Path]]:
    """Every erroring run, started side by side: name -> (process, output folder, console file)."""
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
        console = root / f"run{number}.console"
        started[name] = (start_cli(rec, output, *overrides, nproc=nproc, nan_steps=nan_steps, own_group=True,
                                   console=console), output, console)
    yield started
    for process, _, _ in started.values():
        if not group_is_gone(process.pid):
            os.killpg(process.pid, 9)
        process.wait()


@pytest.mark.slow  # six training runs, one of them torchrun with two ranks
@pytest.mark.parametrize("name", ["data error, num_workers=0", "data error, num_workers=1",
                                  "data error, num_workers=2", "photo folder of another shape, num_workers=2",
                                  "non-finite losses, num_workers=2"])
def test_an_error_in_the_loop_ends_the_workers_and_exits_with_one_line(runs, name):
    process, output, console = runs[name]
    assert_one_error_line(assert_exits_after_its_error(process, console, name), output)


def test_a_data_error_under_torchrun_ends_every_rank_and_its_workers(runs):
    name = "data error under torchrun, 2 processes, num_workers=1"
    process, output, console = runs[name]
    lines = assert_exits_after_its_error(process, console, name)
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


def test_a_loader_left_open_ends_its_workers_when_its_process_exits(data, tmp_path):
    """A script (or a test, or a notebook) that never closes its loader still exits: the workers are ended
    by an exit handler that runs before multiprocessing's, which would wait for them forever. A new
    interpreter, with nothing imported but what the script imports (a forked command has imported train.py)."""
    console = tmp_path / "console"
    with console.open("w") as file:
        process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(data)], cwd=ROOT, stdout=file,
                                   stderr=subprocess.STDOUT, process_group=0,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = assert_exits_after_its_error(process, console, "a script that never closes its loader", status=0)
    assert any("not 3 square view(s)" in line for line in lines), lines
