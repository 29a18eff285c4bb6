"""Fixtures every test file may use: one torch thread, and the tiny synthetic two-view data set,
built once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from facedata.packing import InsightfaceWriter, encode, side_by_side
from facedata.synthetic import render_faces
from tools import make_synthetic


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny tensor ops spread over threads cost milliseconds each on a busy 2-core machine, and a process
    forked from a multi-threaded OpenMP pool can hang: the tests keep torch at one thread. OMP_NUM_THREADS
    keeps it there when train.main runs in this process (it would otherwise take the free cores) and in
    every process a test starts."""
    threads, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if variable is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = variable


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    """20 identities x 2 two-view records (40 records) and 20 held-out verification pairs. Read only:
    a test that changes data copies it first."""
    folder = tmp_path_factory.mktemp("synthetic")
    assert make_synthetic.main(["--output", str(folder), "--identities", "20", "--images-per-identity", "4",
                                "--val-identities", "10", "--val-pairs", "20", "--workers", "1"]) == 0
    return folder


@pytest.fixture(scope="session")
def pair_records(tmp_path_factory):
    """A factory: (count, seed) -> a folder of `count` two-view records, one identity each, so that a
    label names its sample index."""
    def make(count: int, seed: int) -> str:
        out = tmp_path_factory.mktemp("pairs")
        faces = render_faces(range(count), 0, seed=seed), render_faces(range(count), 1, seed=seed)
        with InsightfaceWriter(str(out)) as writer:
            for identity in range(count):
                writer.write_identity([encode(side_by_side([faces[0][identity], faces[1][identity]]))])
        return str(out)
    return make
