"""Crash safety: a save is ordered so that a crash at any moment leaves a checkpoint that resumes, and
the resumed run is the run that would have happened.

- The order is checked on the system calls themselves (os.fsync, os.rename, os.replace, shutil.rmtree
  recorded in-process): every file of the new checkpoint folder, its manifest last, then the folder, is
  on disk before the folder is renamed to its final name; the rename reaches the disk before
  checkpoint.json is switched to it; the switch is fsynced; only then is the old folder removed.
- A training process is killed (SIGKILL, from inside, at the exact call) at each stage of a save and
  resumed: it ends bitwise as the uninterrupted run. Saves run in the background writer thread
  (async_save, the default), so each of these kills lands during a background write.
- The same stages, and a full disk, at the first save after a resume from 1 to 2 processes, which
  renumbers the steps so that this save lands on the step of the published folder: the published
  checkpoint is never touched, and the next --resume continues.
- A loop of SIGKILLs at random moments, every other one while a checkpoint folder is being written,
  always leaves a checkpoint that loads and resumes.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from backbones.trained import BACKBONE_NAME
from checkpoint.pointer import POINTER_NAME
from checkpoint.sources import SavedCheckpoint, find_resume_source
from gpu_acceptance.runs import load_backbone_strict, load_run
from tests.kill_injection import KillSelfAt
from tests.run_helpers import assert_same_run, file_states, run_child, run_cli, run_here, start_child

OVERRIDES = ["save_every_steps=1", "num_epoch=100"]  # a save after every step; never ends on its own
# Kill rounds of the random loop: a count, not a duration, so that a slower machine tests as many kills (the
# first kill before any save, then alternately mid-save and at a random moment once something is published).
ROUNDS = 9


def test_a_save_reaches_the_disk_before_it_is_published(data, tmp_path, monkeypatch):
    output = tmp_path / "run"
    assert run_here(data, output, *OVERRIDES, "max_steps=1") == (0, "")
    calls: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace, real_rmtree = os.fsync, os.rename, os.replace, shutil.rmtree

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(source, target):
        calls.append(("rename", str(target)))
        return real_rename(source, target)

    def replace(source, target):
        calls.append(("replace", str(target)))
        return real_replace(source, target)

    def rmtree(path, *args, **kwargs):
        calls.append(("rmtree", str(path)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert run_here(data, output, *OVERRIDES, "max_steps=2", resume=True) == (0, "")

    tmp, new, old = (str(output / name) for name in (".tmp-checkpoint-000000002", "checkpoint-000000002",
                                                     "checkpoint-000000001"))
    rename = calls.index(("rename", new))
    before = calls[:rename]
    synced = [(i, Path(path).name) for i, (kind, path) in enumerate(before) if kind == "fsync"
              and path.startswith(tmp + "/")]
    names = {name for _, name in synced}
    assert {"__0_0.distcp", ".metadata.tmp"} <= names and any("manifest.json" in name for name in names), before
    manifest = max(i for i, name in synced if "manifest.json" in name)
    assert all(i < manifest for i, name in synced if "manifest.json" not in name)  # the manifest is written last
    assert max(i for i, (kind, path) in enumerate(before) if (kind, path) == ("fsync", tmp)) > manifest
    assert calls[rename + 1] == ("fsync", str(output))  # the rename reaches the disk
    switch = calls.index(("replace", str(output / POINTER_NAME)))
    pointer_sync = max(i for i, (kind, path) in enumerate(calls[:switch]) if kind == "fsync"
                       and ".tmp-checkpoint.json" in path)
    assert rename < pointer_sync < switch  # the new pointer is written in full before it replaces the old one
    assert calls[switch + 1] == ("fsync", str(output))  # the switch itself reaches the disk
    assert calls.index(("rmtree", old)) > switch + 1  # the old checkpoint goes only once the new one is published


# Each stage: the call at which the save after step 3 is killed, and the step published after the kill.
STAGES = {
    # the new folder's files are written: before DCP renames its .metadata into place
    "folder written, not complete": (KillSelfAt("pathlib:Path", "rename", r"checkpoint-000000003/\.metadata"), 2),
    # the folder is complete (manifest written): before it is renamed to its final name
    "folder complete, not renamed": (KillSelfAt("pathlib:Path", "rename", r"\.tmp-checkpoint-000000003$"), 2),
    # renamed: before checkpoint.json is switched to it
    "renamed, not published": (KillSelfAt("os", "replace", r"\.tmp-checkpoint\.json"), 2),
    # published: before backbone.pth in the run folder is updated from it
    "published, backbone.pth not updated": (KillSelfAt("os", "replace", r"\.tmp-backbone\.pth\.link$"), 3),
    # published: before the old folder is removed
    "published, old folder still there": (KillSelfAt("shutil", "rmtree", "checkpoint-000000002$"), 3),
}


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("uninterrupted") / "run"
    # every run of these comparisons is a forked child: a forked process's convolutions round differently
    # from the test process's (seen: 1e-5 apart after one step), so bitwise equality needs one kind throughout
    assert run_child(data, output, *OVERRIDES, "max_steps=4") == (0, "")
    return output


@pytest.fixture(scope="module")
def saved_at_step_2(data, tmp_path_factory) -> Path:
    """A 1-process run (10 steps per epoch) published at step 2, which the tests resume copies of. On 2 processes
    (5 per epoch) it resumes at step 1 of the schedule (shown as 2), and its first save is the schedule's step 2
    again, shown (and its folder named) as step 3: the shown step never runs backwards, so that no folder name
    is taken twice."""
    output = tmp_path_factory.mktemp("one") / "run"
    assert run_child(data, output, *OVERRIDES, "max_steps=2") == (0, "")
    return output


@pytest.mark.parametrize("stage", STAGES)
def test_a_kill_at_each_stage_of_a_save_resumes_as_the_uninterrupted_run(data, tmp_path, uninterrupted, stage,
                                                                         saved_at_step_2):
    output = Path(shutil.copytree(saved_at_step_2, tmp_path / "run"))
    kill, published = STAGES[stage]
    status, _ = run_child(data, output, *OVERRIDES, "max_steps=4", resume=True, prepare=kill)
    assert status == -signal.SIGKILL  # killed during the save after step 3
    assert json.loads((output / POINTER_NAME).read_text())["global_step"] == published
    assert run_child(data, output, *OVERRIDES, "max_steps=4", resume=True) == (0, "")
    assert sorted(p.name for p in output.glob("*checkpoint-*")) == ["checkpoint-000000004"]  # leftovers cleared
    assert_same_run(output, uninterrupted)


RENUMBERED = {  # the first save of the 2-process run, killed on rank 0 at each stage; the step published after
    "folder complete, not renamed": (["os", "rename", r"\.tmp-checkpoint-000000003$"], 2),
    "renamed, not published": (["os", "replace", r"\.tmp-checkpoint\.json"], 2),
    "published, old folder still there": (["shutil", "rmtree", r"checkpoint-000000002$"], 3),
    "a full disk": (["--fsize", str(256 << 10)], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", RENUMBERED)
def test_the_first_save_after_a_renumbering_resume_never_costs_the_published_checkpoint(
        data, saved_at_step_2, tmp_path, stage):
    output = Path(shutil.copytree(saved_at_step_2, tmp_path / "run"))
    published = output / json.loads((output / POINTER_NAME).read_text())["directory"]
    kept = file_states(published)
    arguments, step = RENUMBERED[stage]
    result = run_cli(data, output, *OVERRIDES, "max_steps=4", nproc=2, resume=True,
                     injection=["-m", "tests.kill_injection", *arguments])
    assert result.returncode != 0, result.stderr[-2000:]
    pointer = json.loads((output / POINTER_NAME).read_text())
    assert pointer["global_step"] == step
    if pointer["directory"] == published.name:  # still the 1-process run's: byte for byte as it was
        assert file_states(published) == kept
    result = run_cli(data, output, *OVERRIDES, "max_steps=4", nproc=2, resume=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_run(output)["progress"]["global_step"] == 4
    assert [p.name for p in output.glob("*checkpoint-*")] == [json.loads((output / POINTER_NAME).read_text())[
        "directory"]]


def kill_mid_save(child, output: Path, published: int | None, rng: random.Random, timeout: float = 10) -> None:
    """SIGKILL `child` 0-30 ms after a checkpoint folder newer than the published one appears."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and child.is_alive():
        steps = [int(p.name.split("-")[-1]) for p in output.glob("*checkpoint-*") if p.is_dir()] \
            if output.is_dir() else []
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
    assert find_resume_source(output) == (SavedCheckpoint(), output / POINTER_NAME)
    step = load_run(output)["progress"]["global_step"]
    assert previous_step is None or step >= previous_step
    if (output / BACKBONE_NAME).exists():  # absent only when the kill fell before the first backbone.pth
        load_backbone_strict(output / BACKBONE_NAME)
    return step


def test_sigkill_at_random_moments_always_leaves_a_checkpoint_that_resumes(data, tmp_path):
    output, rng = tmp_path / "run", random.Random(0)
    step = None
    for rounds in range(ROUNDS):
        # resume="auto": a round killed before its first save leaves a log and no checkpoint, which a plain start
        # refuses to reuse without --start-over (test_promised_save.py); auto starts such a run over
        child, stderr = start_child(data, output, *OVERRIDES, "resume=auto")
        if rounds == 0:  # as soon as it runs, before anything is saved: the next round must start afresh
            os.kill(child.pid, signal.SIGKILL)
        elif rounds % 2:
            kill_mid_save(child, output, step, rng)
        else:
            # at a random moment, once something is published (on a busy machine the first save can take
            # longer than the whole random interval)
            deadline = time.monotonic() + 30
            while step is None and not (output / POINTER_NAME).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.5))  # not a wait: the kill's random moment is what this round tests
            os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL, stderr.read_text()  # it was running, not failing
        step = inspect(output, step)
    assert step is not None, "no round left a checkpoint"

    assert run_child(data, output, *OVERRIDES, f"max_steps={step + 2}", resume=True) == (0, "")
    log = (output / "training.log").read_text()
    assert log.rstrip().splitlines()[-1].endswith(f"training finished at global step {step + 2}: no val_targets")
    assert f"resumed from {output / POINTER_NAME} at global step {step} " in log
    assert load_run(output)["progress"]["global_step"] == step + 2
    assert not any(output.glob(".tmp-*")) and len(list(output.glob("checkpoint-*"))) == 1  # leftovers cleared
