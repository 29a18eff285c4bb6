"""tools.convert_checkpoint's failures through its real command line: one `error:` line each, a live run
folder never written into (even with --force), and no destination left behind by a failed conversion."""
from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_helpers import run_command, run_here
from tests.test_bad_input import _hold_the_lock


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("convert") / "run"
    assert run_here(data, output, "max_steps=1") == (0, "")
    return output


def convert(*args: str) -> subprocess.CompletedProcess:
    return run_command([sys.executable, "-m", "tools.convert_checkpoint", *map(str, args)], timeout=300)


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_damaged_shard_is_one_line_and_leaves_no_destination(trained, tmp_path, damage):
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    shard = run / "checkpoint-000000001" / "__0_0.distcp"
    if damage == "removed":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:1000])
    result = convert(run, tmp_path / "out", "--to", "arcface_torch", "--world-size", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: checkpoint {run / 'checkpoint-000000001'} is damaged ({shard} ")
    assert not (tmp_path / "out").exists()


def test_force_into_a_live_run_folder_is_refused(trained, tmp_path):
    live = Path(shutil.copytree(trained, tmp_path / "live"))
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_the_lock, args=(str(live), held, release))
    holder.start()
    try:
        assert held.wait(60)
        result = convert(trained, live, "--to", "arcface_torch", "--world-size", "2", "--force")
    finally:
        release.set()
        holder.join(60)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: output folder {live} is in use by another training process (pid "), \
        result.stderr
    assert not list(live.glob("checkpoint_gpu_*.pt"))


def test_an_unknown_layout_is_one_line(trained, tmp_path):
    result = convert(trained, tmp_path / "out", "--to", "foo")
    assert result.returncode == 1
    assert result.stderr == ("error: --to foo is not a layout this converts to; pass --to arcface_torch or --to "
                             "pairface\n")
    assert not (tmp_path / "out").exists()


def test_a_classifier_of_sub_centres_or_another_margin_family_is_not_converted_to_arcface_torch(data, tmp_path):
    """arcface_torch's layout has one centre per class under the combined margin; a sub-center run (which
    trains and saves K rows per class) and an AdaFace run are refused in one line, nothing written."""
    for family in ("subcenter", "adaface"):
        run = tmp_path / family
        assert run_here(data, run, "max_steps=1", f"margin_family={family!r}") == (0, "")
        result = convert(run, tmp_path / f"{family}_out", "--to", "arcface_torch", "--world-size", "2")
        assert result.returncode == 1
        assert result.stderr == (f"error: {run} was trained with margin_family={family!r}; arcface_torch has only the "
                                 "combined margin with one centre per class, so this classifier has no arcface_torch "
                                 f"layout: use {run / 'backbone.pth'}, which arcface_torch loads as it is\n")
        assert not (tmp_path / f"{family}_out").exists()
