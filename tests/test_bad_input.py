"""Bad input: one sentence naming the thing and the fix, a non-zero exit, and nothing already
written lost. Every case is aimed at a copy of a real run (`--resume` on a folder holding a
checkpoint, backbone.pth, log and TensorBoard file), and every one of those files must come out as
it went in (training.log may only have grown)."""
from __future__ import annotations

import multiprocessing
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from checkpoint.run_dir import lock_run_dir
from gpu_acceptance.runs import load_run
from tests.run_helpers import assert_nothing_lost, file_states, run_child, run_here
from tests.test_train_errors import only_line


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("trained") / "run"
    assert run_here(data, output, "max_steps=2") == (0, "")
    return output


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A fresh copy of the trained run for one test to aim at."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def refused(data: Path, run: Path, *overrides: str, **options) -> str:
    """Resume `run` with the overrides: assert a refusal that lost nothing; the one line on stderr."""
    before = file_states(run)
    status, stderr = run_here(data, run, "max_steps=4", *overrides, resume=True, **options)
    assert status == 1
    assert_nothing_lost(before, run)
    return only_line(stderr)


def test_a_config_file_with_a_syntax_error(data, run, tmp_path):
    config = tmp_path / "broken.py"
    config.write_text("lr = 0.1\nnetwork = 'r18\n")
    assert refused(data, run, config=str(config)) == (
        f"error: config file {config} has a syntax error on line 2: unterminated string literal (detected at line 2); "
        "fix that line")


def test_a_config_file_that_fails_to_run(data, run, tmp_path):
    config = tmp_path / "broken.py"
    config.write_text("lr = base_lr * 2\n")
    assert refused(data, run, config=str(config)) == (
        f"error: config file {config} failed to run (NameError: name 'base_lr' is not defined); fix the file")


def test_a_data_folder_without_rec_and_idx(data, run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refused(data, run, f"rec={empty}") == (
        f"error: {empty} holds neither train.rec/train.idx nor identity sub-folders with images (.jpg, .jpeg, "
        ".png, .webp); point the dataset path at one of those")


def test_a_rec_without_its_idx(data, run, tmp_path):
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(data / "train.rec", half / "train.rec")
    assert refused(data, run, f"rec={half}") == (
        f"error: {half}/train.idx not found: the index of {half}/train.rec is missing; copy the .idx written with it "
        "next to the .rec (same name, .idx), or re-pack with tools/pack_rec.py")


def test_a_rec_that_does_not_match_its_idx(data, run, tmp_path):
    """A .rec cut short (an interrupted copy): the .idx points past its end."""
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(data / "train.idx", cut / "train.idx")
    rec = (data / "train.rec").read_bytes()
    (cut / "train.rec").write_bytes(rec[:len(rec) // 2])
    assert int((data / "train.idx").read_text().split()[-1]) > len(rec) // 2  # the last offset
    message = refused(data, run, f"rec={cut}")
    assert re.fullmatch(rf"error: {cut}/train.idx: key \d+ points at offset \d+, past the end of {cut}/train.rec "
                        rf"\({len(rec) // 2} bytes\); the .rec is truncated or the .idx belongs to another .rec; copy "
                        r"the matching pair again or re-pack", message), message


def test_num_classes_smaller_than_the_labels(data, run):
    assert refused(data, run, "num_classes=5") == (
        f"error: {data} holds 20 classes (labels 0..19) but num_classes=5; set num_classes = 20 in the config")


@pytest.mark.parametrize("workers", [0, 1])
def test_views_that_do_not_match_the_records(data, run, workers):
    """Two-view records read as three views; with a loader worker the error crosses a process."""
    message = refused(data, run, "num_views=3", f"num_workers={workers}")
    assert re.fullmatch(rf"error: {data}/train.rec record key \d+ is 112x224 \(HxW\), not 3 square view\(s\) side by "
                        r"side \(112x336\); set num_views to 2", message), message


@pytest.mark.parametrize("override, difference", [
    ("embedding_size=64", "embedding_size 32 there, 64 here"),
    ("network=mbf", "network 'r18' there, 'mbf' here"),
])
def test_a_checkpoint_of_another_network_or_embedding_size(data, run, override, difference):
    assert refused(data, run, override) == (
        f"error: {run}/checkpoint.json was written for another model ({difference}); resume with the config that "
        "wrote it, or start a new output folder")


def test_a_damaged_checkpoint(data, run):
    """A checkpoint cut short by something other than train.py (its own writes are atomic)."""
    folder = run / "checkpoint-000000002"
    shard = folder / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:4096])
    assert refused(data, run) == (
        f"error: checkpoint {folder} is damaged ({shard} is 4096 bytes, the manifest lists {size}); no other "
        "checkpoint is left in the run folder: copy the folder again from a backup, or start a new run")


def _hold_the_lock(folder: str, held, release) -> None:
    """A process that holds the run folder as a training process does, until told to let go."""
    lock = lock_run_dir(folder)
    held.set()
    release.wait(60)
    lock.close()


def test_an_output_folder_held_by_a_live_run(data, run):
    """Another process holds the folder's lock (as a live training run does, through the same lock): a start
    there, with --resume or without, is refused with its pid and host (without, not by advice to pass --resume,
    which would be refused next), changes nothing (the lock file still names the holder), and once the holder is
    gone the same start resumes."""
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_the_lock, args=(str(run), held, release))
    holder.start()
    try:
        assert held.wait(60), "the holder never took the lock"
        before = file_states(run)
        for resume in (True, False):
            status, stderr = run_here(data, run, "max_steps=4", resume=resume)
            assert status == 1
            assert only_line(stderr) == (
                f"error: output folder {run} is in use by another training process (pid {holder.pid} on "
                f"{socket.gethostname()}); wait for it to finish or choose another folder with --set output=<folder>")
        assert_nothing_lost(before, run)
        assert (run / ".lock").read_text() == f"pid {holder.pid} on {socket.gethostname()}\n"
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0
    assert run_here(data, run, "max_steps=4", resume=True) == (0, "")
    assert load_run(run)["progress"]["global_step"] == 4


def limit_file_size() -> None:
    """In the child: writes past 256 KiB fail with EFBIG, as on a full disk (the checkpoint's shard is ~0.5 MB, the
    log and the other files stay below)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18))


def save_fails(data: Path, run: Path, prepare=None) -> str:
    before = file_states(run)
    status, stderr = run_child(data, run, "max_steps=3", resume=True, prepare=prepare)
    assert status == 1
    assert_nothing_lost(before, run)
    assert not list(run.glob(".tmp-*")) and not (run / "checkpoint-000000003").exists()  # the partial save removed
    assert load_run(run)["progress"]["global_step"] == 2
    return only_line(stderr)


def test_a_file_size_limit_while_saving(data, run):
    assert save_fails(data, run, limit_file_size) == (
        f"error: could not write checkpoint {run}/checkpoint-000000003 (rank 0: File too large); the previous "
        "checkpoint is untouched: free disk space or choose another output folder")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real file system with less free than a checkpoint takes once the run is copied in (needs root and mount)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    size = 2 << 20  # the run's files take ~1.5 MB, a checkpoint ~1.1 MB: room for them, not for a second checkpoint
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"cannot mount a tmpfs here ({error})")
    try:
        yield mount_point
    finally:
        # lazy: a process that still holds a file there (a run killed by a failing test) must not leak the mount
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True, timeout=30)


def test_a_full_disk_while_saving(data, trained, small_tmpfs):
    run = Path(shutil.copytree(trained, small_tmpfs / "run"))
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    assert free < sum(p.stat().st_size for p in trained.glob("checkpoint-*/*"))
    assert save_fails(data, run) == (
        f"error: could not write checkpoint {run}/checkpoint-000000003 (rank 0: No space left on device); the "
        "previous checkpoint is untouched: free disk space or choose another output folder")
