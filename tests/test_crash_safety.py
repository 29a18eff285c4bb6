"""Crash safety: a save is ordered so that a crash at any moment leaves a checkpoint that resumes, and
the resumed run is the run that would have happened.

- The order is checked on the system calls themselves (os.fsync, os.replace, shutil.rmtree recorded
  in-process): every file of the new checkpoint folder, then the folder, is on disk before
  checkpoint.json is switched to it; the switch is fsynced; only then is the old folder removed.
- A training process is killed (SIGKILL, from inside, at the exact call) at each stage of a save and
  resumed: it ends bitwise as the uninterrupted run.
- A loop of SIGKILLs at random moments, every other one while a checkpoint folder is being written,
  always leaves a checkpoint that loads and resumes.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from backbones.trained import BACKBONE_NAME
from checkpoint.pointer import POINTER_NAME
from checkpoint.run_dir import find_resume_source
from tests.run_helpers import assert_same_run, load_backbone_strict, load_run, run_child, run_here, start_child

OVERRIDES = ["save_every_steps=1", "num_epoch=100"]  # a save after every step; never ends on its own
LOOP_SECONDS, MIN_ROUNDS, MAX_SECONDS = 15, 6, 60


def test_a_save_reaches_the_disk_before_it_is_published(data, tmp_path, monkeypatch):
    output = tmp_path / "run"
    assert run_here(data, output, *OVERRIDES, "max_steps=1") == (0, "")
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(source, target):
        calls.append(("replace", str(target)))
        return real_replace(source, target)

    def rmtree(path, *args, **kwargs):
        calls.append(("rmtree", str(path)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert run_here(data, output, *OVERRIDES, "max_steps=2", resume=True) == (0, "")

    new, old, pointer = str(output / "checkpoint-000000002"), str(output / "checkpoint-000000001"), str(
        output / POINTER_NAME)
    switch = calls.index(("replace", pointer))
    before = calls[:switch]
    shard_syncs = [i for i, (kind, path) in enumerate(before) if kind == "fsync" and path.startswith(new + "/")]
    assert {Path(before[i][1]).name for i in shard_syncs} >= {"__0_0.distcp", ".metadata.tmp"}, before
    folder_sync = before.index(("fsync", new))
    assert max(shard_syncs) < folder_sync  # the folder's entries after its files
    pointer_sync = max(i for i, (kind, path) in enumerate(before) if kind == "fsync" and ".tmp-checkpoint.json" in path)
    assert folder_sync < pointer_sync  # the new pointer is written in full before it replaces the old one
    assert calls[switch + 1] == ("fsync", str(output))  # the switch itself reaches the disk
    assert calls.index(("rmtree", old)) > switch + 1  # the old checkpoint goes only once the new one is published


@dataclass(frozen=True)
class KillSelfAt:
    """A `prepare` for run_child: SIGKILL this process at its first call of `owner.function` (`owner` an
    importable dotted name; the call's first argument containing `target`, when given), before the call
    does anything."""

    owner: str
    function: str
    target: str | None = None

    def __call__(self) -> None:
        module, _, attribute = self.owner.partition(":")
        owner = importlib.import_module(module)
        owner = getattr(owner, attribute) if attribute else owner
        real = getattr(owner, self.function)

        def fatal(*args, **kwargs):
            if self.target is None or self.target in str(args[0]):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(owner, self.function, fatal)


STAGES = {
    # the new folder's files are written: before its .metadata is renamed into place
    "folder written, not complete": KillSelfAt("pathlib:Path", "rename"),
    # the folder is complete: before checkpoint.json is switched to it
    "folder complete, not published": KillSelfAt("os", "replace", POINTER_NAME),
    # published: before the old folder is removed
    "published, old folder still there": KillSelfAt("shutil", "rmtree", "checkpoint-000000002"),
}


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("uninterrupted") / "run"
    # every run of these comparisons is a forked child: a forked process's convolutions round differently
    # from the test process's (seen: 1e-5 apart after one step), so bitwise equality needs one kind throughout
    assert run_child(data, output, *OVERRIDES, "max_steps=4") == (0, "")
    return output


@pytest.mark.parametrize("stage", STAGES)
def test_a_kill_at_each_stage_of_a_save_resumes_as_the_uninterrupted_run(data, tmp_path, uninterrupted, stage):
    output = tmp_path / "run"
    assert run_child(data, output, *OVERRIDES, "max_steps=2") == (0, "")
    status, _ = run_child(data, output, *OVERRIDES, "max_steps=4", resume=True, prepare=STAGES[stage])
    assert status == -signal.SIGKILL  # killed during the save after step 3
    published = json.loads((output / POINTER_NAME).read_text())["global_step"]
    assert published == (3 if stage.startswith("published") else 2)
    assert run_child(data, output, *OVERRIDES, "max_steps=4", resume=True) == (0, "")
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-000000004"]  # leftovers cleared
    assert_same_run(output, uninterrupted)


def kill_mid_save(child, output: Path, published: int | None, rng: random.Random, timeout: float = 10) -> None:
    """SIGKILL `child` 0-30 ms after a checkpoint folder newer than the published one appears."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and child.is_alive():
        steps = [int(p.name.split("-")[1]) for p in output.glob("checkpoint-*")] if output.is_dir() else []
        if any(published is None or step > published for step in steps):
            time.sleep(rng.uniform(0, 0.03))
            break
        time.sleep(0.001)
    os.kill(child.pid, signal.SIGKILL)


def inspect(output: Path, previous_step: int | None) -> int | None:
    """What a restart finds: the step of a checkpoint that loads, never older than the last one seen."""
    if not (output / POINTER_NAME).exists():
        assert previous_step is None, "a checkpoint disappeared"
        return None
    assert find_resume_source(output) == ("checkpoint", output / POINTER_NAME)
    step = load_run(output)["progress"]["global_step"]
    assert previous_step is None or step >= previous_step
    if (output / BACKBONE_NAME).exists():  # absent only when the kill fell before the first backbone.pth
        load_backbone_strict(output / BACKBONE_NAME)
    return step


def test_sigkill_at_random_moments_always_leaves_a_checkpoint_that_resumes(data, tmp_path):
    output, rng = tmp_path / "run", random.Random(0)
    start = time.monotonic()
    rounds, unpublished_left, step = 0, 0, None
    while (time.monotonic() - start < LOOP_SECONDS or rounds < MIN_ROUNDS) and time.monotonic() - start < MAX_SECONDS:
        child, stderr = start_child(data, output, *OVERRIDES, resume=step is not None)
        if rounds == 0:
            time.sleep(0.05)  # before anything is saved: the next round must be able to start afresh
            os.kill(child.pid, signal.SIGKILL)
        elif rounds % 2:
            kill_mid_save(child, output, step, rng)
        else:
            time.sleep(rng.uniform(0.0, 1.5))
            os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL, stderr.read_text()  # it was running, not failing
        step = inspect(output, step)
        unpublished_left += step is not None and any(int(p.name.split("-")[1]) > step
                                                     for p in output.glob("checkpoint-*"))
        rounds += 1
    assert rounds >= MIN_ROUNDS and step is not None, (rounds, step)

    assert run_child(data, output, *OVERRIDES, f"max_steps={step + 2}", resume=True) == (0, "")
    log = (output / "training.log").read_text()
    assert log.rstrip().splitlines()[-1].endswith(f"training finished at global step {step + 2}: no val_targets")
    assert f"resumed from {output / POINTER_NAME} at global step {step} " in log
    assert load_run(output)["progress"]["global_step"] == step + 2
    assert not any(output.glob(".tmp-*")) and len(list(output.glob("checkpoint-*"))) == 1  # leftovers cleared
