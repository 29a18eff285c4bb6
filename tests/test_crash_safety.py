"""Crash safety: training processes SIGKILLed at random moments, every other one in the middle of
a checkpoint write, always leave a checkpoint that loads and resumes; partial files are never
taken for checkpoints.

Each round starts train.main in a forked process (resuming when a checkpoint exists, as a user
would), with a checkpoint after every step, and kills it: at a random delay, or a random few
milliseconds after its temporary checkpoint file appears. After each kill the folder is inspected
the way a restart reads it. The loop runs for a bounded time, then one last run resumes and ends
normally.
"""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from tests.run_helpers import load_backbone_strict, load_run, run_child, start_child
from utils.checkpoint import BACKBONE_NAME, CHECKPOINT_NAME, find_resume_source

OVERRIDES = ["save_every_steps=1", "num_epoch=100"]  # a write after every step; never ends on its own
LOOP_SECONDS, MIN_ROUNDS, MAX_SECONDS = 20, 8, 90


def kill_mid_write(child, output: Path, rng: random.Random, timeout: float = 10) -> None:
    """SIGKILL `child` 0-30 ms after its own temporary checkpoint file appears (or after `timeout`)."""
    own_temporary = f".{child.pid}"
    end = time.monotonic() + timeout
    while time.monotonic() < end and child.is_alive():
        if output.is_dir() and any(name.startswith(".tmp-") and name.endswith(own_temporary)
                                   for name in os.listdir(output)):
            time.sleep(rng.uniform(0, 0.03))
            break
        time.sleep(0.001)
    os.kill(child.pid, signal.SIGKILL)


def inspect(output: Path, previous_step: int | None) -> int | None:
    """What a restart finds: the step of a checkpoint that loads, never older than the last one seen."""
    if not (output / CHECKPOINT_NAME).exists():
        assert previous_step is None, "a checkpoint disappeared"
        return None
    assert find_resume_source(output) == ("checkpoint", output / CHECKPOINT_NAME)
    step = load_run(output)["progress"]["global_step"]
    assert previous_step is None or step >= previous_step
    if (output / BACKBONE_NAME).exists():  # absent only when the kill fell between the first two writes
        load_backbone_strict(output / BACKBONE_NAME)
    return step


def test_sigkill_at_random_moments_always_leaves_a_checkpoint_that_resumes(data, tmp_path):
    output, rng = tmp_path / "run", random.Random(0)
    start = time.monotonic()
    rounds, partial_files_left, step = 0, 0, None
    while (time.monotonic() - start < LOOP_SECONDS or rounds < MIN_ROUNDS or not partial_files_left) \
            and time.monotonic() - start < MAX_SECONDS:
        child, stderr = start_child(data, output, *OVERRIDES, resume=step is not None)
        if rounds == 0:
            time.sleep(0.05)  # before anything is saved: the next round must be able to start afresh
            os.kill(child.pid, signal.SIGKILL)
        elif rounds % 2:
            kill_mid_write(child, output, rng)
        else:
            time.sleep(rng.uniform(0.0, 1.5))
            os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL, stderr.read_text()  # it was running, not failing
        partial_files_left += any(output.glob(".tmp-*"))
        step = inspect(output, step)
        rounds += 1
    assert rounds >= MIN_ROUNDS and partial_files_left, (rounds, partial_files_left)
    assert step is not None, "no round lived long enough to write a checkpoint"

    assert run_child(data, output, *OVERRIDES, f"max_steps={step + 2}", resume=True) == (0, "")
    log = (output / "training.log").read_text()
    assert log.rstrip().splitlines()[-1].endswith(f"training finished at global step {step + 2}: no val_targets")
    assert f"resumed from {output / CHECKPOINT_NAME} at global step {step} " in log
    assert load_run(output)["progress"]["global_step"] == step + 2
    assert not any(output.glob(".tmp-*"))  # the next save cleared them
