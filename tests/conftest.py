"""Fixtures every test file may use: one torch thread, and the tiny synthetic two-view data set,
built once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tools import make_synthetic


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny tensor ops spread over threads cost milliseconds each on a busy 2-core machine, and a process
    forked from a multi-threaded OpenMP pool can hang: the tests keep torch at one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    """20 identities x 2 two-view records (40 records) and 20 held-out verification pairs. Read only:
    a test that changes data copies it first."""
    folder = tmp_path_factory.mktemp("synthetic")
    assert make_synthetic.main(["--output", str(folder), "--identities", "20", "--images-per-identity", "4",
                                "--val-identities", "10", "--val-pairs", "20", "--workers", "1"]) == 0
    return folder
