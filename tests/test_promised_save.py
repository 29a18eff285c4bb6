"""A save that a run promises (SIGTERM or SIGUSR1: "saving a checkpoint after this step, then stopping") either
happens and is said, or one line says why not, with the previous checkpoint whole; a run killed on its way (no
line can follow a SIGKILL) is named by the next start in its folder, which says what it does. Saves due while
one is being written wait for it and say so; the terminal accounts for every save; a run whose code changes on
disk under it saves with the code it started with and stops in one line.

40 two-view records, batch 2: 20 steps per epoch, no save before the epoch's end but the ones a test asks for.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checkpoint.pointer import POINTER_NAME
from gpu_acceptance.runs import arguments
from tests.kill_injection import KillSelfAt
from tests.nan_injection import nan_at_steps
from tests.run_helpers import ROOT, file_states, run_here, start_child, start_cli, wait_for_log
from utils.source_watch import project_sources

EXIT_PREEMPTED = 75
pytestmark = pytest.mark.slow  # ten starts of train.py, two of them new interpreters
PREEMPTED = re.compile(r"preempted at global step (\d+): checkpoint saved; continue with: .* --resume")


def published_step(output: Path) -> int:
    return json.loads((output / POINTER_NAME).read_text())["global_step"]


def sigterm_at_step_3(child, output: Path) -> None:
    wait_for_log(output, "Global Step: 3 ", child.is_alive)
    os.kill(child.pid, signal.SIGTERM)
    child.join(120)


def test_a_data_worker_killed_during_the_promised_save_does_not_cost_it(data, tmp_path):
    # The OOM killer's pick, or any death of a data worker, during the save: DataLoader's SIGCHLD handler raised
    # into the wait for the background writer, whose thread the exit then cut off: no checkpoint, no line in the log.
    # A new interpreter, as a user starts it: its data workers are its own children (a forked test child's are the
    # forkserver's).
    output = tmp_path / "run"
    injection = ["-m", "tests.kill_injection", "--kill-children", "checkpoint.sharded", "write_state"]
    process = start_cli(data, output, "batch_size=2", "num_workers=1", "max_steps=12", nproc=0, real=True,
                        injection=injection)
    wait_for_log(output, "Global Step: 3 ", lambda: process.poll() is None)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == EXIT_PREEMPTED and "Traceback" not in stderr, stderr[-3000:]
    stop = PREEMPTED.search((output / "training.log").read_text())
    assert stop is not None and published_step(output) == int(stop.group(1))


def test_a_run_killed_during_its_promised_save_is_named_by_the_next_start_which_says_what_it_does(data, tmp_path):
    output = tmp_path / "run"
    # SIGKILL inside the promised save (a scheduler's grace period run out, the OOM killer): no line can follow.
    child, _ = start_child(data, output, "batch_size=2", "max_steps=12",
                           prepare=KillSelfAt("checkpoint.sharded", "write_state"))
    sigterm_at_step_3(child, output)
    assert child.exitcode == -signal.SIGKILL
    assert not (output / POINTER_NAME).exists()
    left = file_states(output)
    status, stderr = run_here(data, output, "batch_size=2", "max_steps=2")
    assert status == 1
    assert re.fullmatch(
        rf"error: output folder {output} holds a run without a whole checkpoint: its last start ended after global "
        r"step \d+ with no line of its own in training.log, SIGTERM having asked it to save a checkpoint, which it "
        r"never finished: it was killed \(SIGKILL: the OOM killer, a scheduler's grace period run out, a power cut\) "
        r"or crashed \(a traceback on its stderr\)( \(\.tmp-checkpoint-\d+/ is a save it began and did not finish\))?; "
        r"start it over there with --start-over \(nothing is deleted: training.log and tensorboard/ go on\), or "
        r"choose another folder with --set output=<folder>", stderr.strip()), stderr
    assert file_states(output) == left  # a refused start touches nothing
    before = (output / "training.log").read_text()
    assert run_here(data, output, "batch_size=2", "max_steps=2", flags=["--start-over"]) == (0, "")
    log = (output / "training.log").read_text()
    assert log.startswith(before)  # appended to
    assert "starting it over (nothing was deleted; training.log and TensorBoard go on)" in log

    # Killed again, this time with a whole checkpoint behind it (step 2): --resume says so and continues from it.
    child, _ = start_child(data, output, "batch_size=2", "max_steps=12", resume=True,
                           prepare=KillSelfAt("checkpoint.sharded", "write_state"))
    wait_for_log(output, "Global Step: 5 ", child.is_alive)
    os.kill(child.pid, signal.SIGTERM)
    child.join(120)
    assert child.exitcode == -signal.SIGKILL and published_step(output) == 2
    assert run_here(data, output, "batch_size=2", "max_steps=3", resume=True) == (0, "")
    log = (output / "training.log").read_text()
    log = log[log.rindex("config: "):]  # this start's lines
    assert f"resumed from {output / POINTER_NAME} at global step 2 " in log
    assert re.search(r"the run in \S+: its last start ended after global step \d+ with no line of its own in "
                     r"training.log, SIGTERM having asked it to save a checkpoint, which it never finished: .*; "
                     r"resuming from its last whole checkpoint \(the steps after it are trained again\)\n", log)
    status, stderr = run_here(data, output, "batch_size=2", "max_steps=4", flags=["--start-over"])
    assert status == 1 and f"--start-over starts a run again in a folder whose run was killed before its first " \
        f"whole checkpoint, but {output} holds a run's checkpoint" in stderr


def test_a_folder_whose_run_stopped_on_its_error_is_started_again_as_it_is(data, tmp_path):
    output = tmp_path / "run"
    with nan_at_steps((2,)):
        status, stderr = run_here(data, output, "max_nonfinite_steps=1")
    assert status == 1 and not (output / POINTER_NAME).exists(), stderr
    assert run_here(data, output, "max_steps=1") == (0, "")  # its error line ended it: nothing to name


def test_every_due_save_is_written_and_a_save_that_waits_for_the_one_before_says_so(data, tmp_path, monkeypatch):
    output, real_fsync = tmp_path / "run", os.fsync
    released = threading.Event()

    def slow_fsync(fd: int) -> None:
        # Storage slower than the steps, whatever the machine's load: the first save's writer is held until
        # training has logged step 6, whose save is then due while that one is still being written.
        if threading.current_thread().name == "checkpoint-writer" and not released.is_set():
            deadline = time.monotonic() + 300
            while "Global Step: 6 " not in (output / "training.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
            released.set()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    terminal = io.StringIO()
    assert run_here(data, output, "batch_size=2", "save_every_steps=3", "max_steps=15", stdout=terminal) == (0, "")
    log, shown = (output / "training.log").read_text(), terminal.getvalue()
    assert re.findall(r"saved \S+ at global step (\d+)", log) == ["3", "6", "9", "12", "15"]
    # The terminal shows one save per ten log lines, and the next one it shows names those it did not.
    assert re.findall(r"saved \S+ at global step (\d+)", shown) == ["3", "15"]
    assert "at global step 15 (after 3 save(s) said in training.log alone, at global step(s) 6, 9, 12)" in shown
    assert re.search(r"the save at global step 6 waited \d+\.\d s for the save of global step 3, still being "
                     r"written: a save takes longer than save_every_steps=3 steps; every due save is written, the "
                     r"steps wait for it \(raise save_every_steps to keep them from waiting\)", log)
    assert shown.count(" waited ") == 1  # said once on the terminal, every time in training.log


def test_a_run_whose_code_changes_under_it_saves_with_its_own_and_stops_in_one_line(data, tmp_path):
    checkout = tmp_path / "checkout"
    for source in [*project_sources(ROOT), *ROOT.glob("configs/*.py")]:
        target = checkout / source.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    output = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "train.py", *arguments(data, output, "batch_size=2", "max_steps=40")],
                           cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_log(output, "Global Step: 2 ", lambda: run.poll() is None)
    # A newer checkpoint module that needs what only a newer training module has (the first save imported it).
    sharded = checkout / "checkpoint" / "sharded.py"
    sharded.write_text(sharded.read_text() + "\nfrom training.state import NAME_OF_A_NEWER_VERSION  # noqa\n")
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == EXIT_PREEMPTED and "Traceback" not in stderr, stderr[-3000:]
    stop = re.search(rf"stopped at global step (\d+): the code of this run changed on disk \(checkpoint/sharded.py in "
                     rf"{checkout}\) since it started; checkpoint saved; continue with: .* --resume \(it runs the new "
                     r"code\)\n", (output / "training.log").read_text())
    assert stop is not None and published_step(output) == int(stop.group(1)) < 20  # before the epoch's end
