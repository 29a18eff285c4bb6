"""How a run ends when it is told to stop, or an error stops it: one line, no traceback, and the same line
in training.log, which names the last good checkpoint and how to continue.

Signals go as a terminal (Ctrl-C) or a scheduler at its time limit (SIGTERM) sends them: to every process
of a forked `train.main`, the training process and its data worker. 40 two-view records, batch 2: 20
batches per epoch.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest

from checkpoint.pointer import POINTER_NAME
from tests.nan_injection import nan_at_steps
from tests.run_helpers import continue_command, run_here, start_child, start_cli, wait_for_log
from utils.stop import StopRequest, StopSignals

EXIT_INTERRUPTED, EXIT_PREEMPTED = 130, 75


def start_in_a_terminal(data: Path, output: Path, *overrides: str):
    """A forked train.main in a process group of its own, as a terminal's foreground job: (child, stderr file)."""
    return start_child(data, output, "batch_size=2", *overrides, prepare=os.setpgrp)


def ctrl_c(child) -> None:
    os.killpg(child.pid, signal.SIGINT)


def ended(child, stderr: Path, status: int = EXIT_INTERRUPTED) -> None:
    """Once the child has exited with `status`, and without a traceback."""
    child.join(120)
    text = stderr.read_text()
    assert child.exitcode == status, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def published_step(output: Path) -> int:
    return json.loads((output / POINTER_NAME).read_text())["global_step"]


def stop_line(output: Path, pattern: str) -> re.Match:
    """The line of `output`'s log that says why the run stopped, as a match of `pattern` (a whole line)."""
    log = (output / "training.log").read_text()
    match = re.search(pattern + "\n", log)
    assert match is not None, log[-2000:]
    return match


def test_sigterm_to_every_process_saves_where_it_stopped(data, tmp_path):
    output = tmp_path / "run"
    process = start_cli(data, output, "batch_size=2", "num_workers=1", "max_steps=12", nproc=0, own_group=True)
    wait_for_log(output, "Global Step: 3 ", lambda: process.poll() is None)
    os.killpg(process.pid, signal.SIGTERM)  # the data worker too, as SLURM signals every process of a job
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_PREEMPTED and "Traceback" not in stderr, stderr[-3000:]
    command = continue_command(data, output, "batch_size=2", "num_workers=1", "max_steps=12")
    stop = stop_line(output, rf"preempted at global step (\d+): checkpoint saved; continue with: {re.escape(command)}")
    assert published_step(output) == int(stop.group(1))


def test_ctrl_c_stops_after_the_step_without_saving_and_says_how_to_continue(data, tmp_path):
    output = tmp_path / "run"
    child, stderr = start_in_a_terminal(data, output, "num_workers=1", "save_every_steps=2", "max_steps=12")
    command = continue_command(data, output, "batch_size=2", "num_workers=1", "save_every_steps=2", "max_steps=12")
    wait_for_log(output, "Global Step: 3 ", child.is_alive)
    ctrl_c(child)
    ended(child, stderr)
    stop = stop_line(output, r"stopped by Ctrl-C at global step (\d+), without saving \(last saved at global step "
                     rf"(\d+)\); the last good checkpoint.json in {output} is untouched \(continue with: "
                     rf"{re.escape(command)}\); "
                     "to save before stopping, send SIGTERM or SIGUSR1 instead of Ctrl-C")
    stopped, saved = int(stop.group(1)), int(stop.group(2))
    assert 3 <= stopped < 12 and saved == published_step(output) == stopped - 1 - (stopped - 1) % 2
    assert run_here(data, output, "batch_size=2", f"max_steps={saved + 1}", resume=True) == (0, "")
    assert f"resumed from {output / POINTER_NAME} at global step {saved} (epoch 0)" in \
        (output / "training.log").read_text()


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(data, tmp_path):
    output = tmp_path / "run"
    # 4 micro-batches a step: long enough for both presses to land inside step 3, which starts once step 2's
    # save is published
    child, stderr = start_in_a_terminal(data, output, "gradient_acc=4", "save_every_steps=1", "max_steps=5")
    command = continue_command(data, output, "batch_size=2", "gradient_acc=4", "save_every_steps=1", "max_steps=5")
    deadline = time.monotonic() + 300
    while not ((output / POINTER_NAME).is_file() and published_step(output) == 2):
        assert child.is_alive() and time.monotonic() < deadline, "step 2's checkpoint was never published"
        time.sleep(0.01)
    ctrl_c(child)
    wait_for_log(output, "Ctrl-C: stopping after this step without saving", child.is_alive)
    ctrl_c(child)
    ended(child, stderr)
    stop = stop_line(output, r"stopped at once by a second Ctrl-C after global step (\d+), without saving; the last "
                     rf"good checkpoint.json in {output} is untouched \(continue with: {re.escape(command)}\)")
    assert published_step(output) == int(stop.group(1))


@pytest.mark.parametrize("overrides, nan_steps, error", [
    (["num_views=3"], (), "is 112x224 (HxW), not 3 square view(s) side by side (112x336); set num_views to 2"),
    (["max_nonfinite_steps=1"], (2,), "stopped at global step 2: 1 non-finite losses in a row (max_nonfinite_steps=1)"),
])
def test_the_error_that_stops_a_run_is_in_its_log(data, tmp_path, overrides, nan_steps, error):
    output = tmp_path / "run"
    with nan_at_steps(nan_steps):
        status, stderr = run_here(data, output, *overrides)
    assert status == 1 and error in stderr, stderr
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("error: ")
    assert (output / "training.log").read_text().rstrip().endswith("-" + line)


class SignalDuringWrite(io.RawIOBase):
    """A file whose first write is interrupted by `number`, sent to this process: Python runs the handler
    between two bytecodes of that write, inside the buffered stream's flush, as when a signal arrives while
    training writes a log line."""

    def __init__(self, number: int) -> None:
        self.number, self.written = number, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if not self.written:
            os.kill(os.getpid(), self.number)
        self.written += data
        return len(data)


@pytest.mark.parametrize("number, asked, said", [
    (signal.SIGTERM, StopRequest.PREEMPT, "SIGTERM: saving a checkpoint after this step, then stopping"),
    (signal.SIGINT, StopRequest.INTERRUPT, "Ctrl-C: stopping after this step without saving")])
def test_a_signal_that_lands_in_a_log_write_is_said_after_it_without_a_logging_error(number, asked, said, capfd):
    file = SignalDuringWrite(number)
    handler = logging.StreamHandler(io.TextIOWrapper(io.BufferedWriter(file), write_through=False))
    root = logging.getLogger()
    level = root.level  # the stop signals' handlers, which the stop leaves changed, conftest puts back
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with StopSignals() as signals:
            signals.stepping = True
            logging.info("a line being written")
            assert signals.strongest_request() == asked  # the boundary waits until the request's line is out
            signals.stepping = False
        handler.flush()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    lines = file.written.decode().splitlines()
    assert len(lines) == 2 and lines[0] == "a line being written" and lines[1].startswith(said), lines
    assert "Logging error" not in capfd.readouterr().err
