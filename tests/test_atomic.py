"""Whole files or none (utils/atomic.py): a save replaces a file in one rename, and a write that fails half-way
(a real file-size limit, as a full disk would) leaves the previous file as it was."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from checkpoint.pointer import POINTER_NAME
from utils.atomic import atomic_save

ROOT = Path(__file__).resolve().parent.parent


def test_atomic_save_replaces_whole_files_and_clears_leftovers(tmp_path):
    path = tmp_path / POINTER_NAME
    stale = tmp_path / f".tmp-{POINTER_NAME}.12345"
    stale.write_bytes(b"half a file")
    atomic_save({"x": torch.ones(3)}, path)
    assert torch.equal(torch.load(path)["x"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [POINTER_NAME]


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    """A real write failure: the file-size limit (as a full disk would) stops the write half-way."""
    path = tmp_path / "backbone.pth"
    atomic_save({"generation": 1}, path)
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from utils.atomic import atomic_save
        from utils.errors import CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            atomic_save({{"generation": 2, "big": torch.zeros(1 << 20)}}, {str(path)!r})
        except CheckpointError as error:
            print(error)
            sys.exit(3)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 3, result.stderr
    assert "could not write" in result.stdout and "previous backbone.pth is untouched" in result.stdout
    assert torch.load(path) == {"generation": 1}
    assert os.listdir(tmp_path) == ["backbone.pth"]
