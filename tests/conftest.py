"""Fixtures every test file may use: one torch thread, each test's leftovers undone, the tiny synthetic
two-view data set and a trained backbone to fine-tune, built once per test session."""
from __future__ import annotations

import gc
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
from pathlib import Path

import pytest
import torch

from backbones import get_model
from dataset import InsightfaceWriter, encode, render_faces, side_by_side
from gpu_acceptance.runs import INFO
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files holding a `slow` test first, each group in the order pytest-randomly drew (a stable sort after
    its shuffle): `-n 2 --dist loadfile` hands whole files to the two workers as they come free, so a slow file
    drawn last would run alone at the end while the other worker idles."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The random order's seed, last: pytest-randomly prints it in the header, which `make test`'s -q hides (and
    xdist's workers print nothing), so a failure that depends on the order could not be replayed."""
    seed = config.getoption("randomly_seed", None) if config.pluginmanager.hasplugin("randomly") else None
    if isinstance(seed, int) and not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"random order seed {seed}: replay this order with "
                                    f"pytest -p randomly --randomly-seed={seed}")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (zombies, ended but not yet reaped, left out), as each of its
    threads lists those it started."""
    found = set()
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.update(int(child) for child in listing.read_text().split())
        except OSError:  # the thread or process ended meanwhile
            continue
    return {child for child in found if _state(child) not in ("Z", None)}


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _started_processes() -> set[int]:
    """This process's children and the forkserver's (run_helpers.start_child), not the two servers themselves."""
    servers = {multiprocessing.forkserver._forkserver._forkserver_pid,  # (no public accessor)
               multiprocessing.resource_tracker._resource_tracker._pid}
    started = _children(os.getpid())
    for server in servers & started:
        started |= _children(server)
    return started - servers


def _numerics() -> tuple:
    """The process-wide switches utils.device.configure_numerics sets (train.main and tools run in tests set them)."""
    return (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def _restore_numerics(switches: tuple) -> None:
    torch.use_deterministic_algorithms(switches[0])
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
     torch.backends.cudnn.allow_tf32) = switches[1:]


@pytest.fixture(autouse=True)
def leaves_nothing_behind():
    """What a test starts ends with it: a process it started that still runs (a run left behind by a failed
    assertion, with every process below it) is killed, so that it cannot load the machine, hold a port or a run
    folder's lock, or signal anything during later tests; environment variables and the handlers of the stop
    signals are put back (an in-process run that stopped on a signal leaves SIGTERM ignored, which every process
    started later would inherit), and so are torch's numerics switches (TF32, deterministic kernels)."""
    environ, handlers = dict(os.environ), {number: signal.getsignal(number) for number in STOP_SIGNALS}
    numerics = _numerics()
    before = _started_processes()
    yield
    leftovers = _started_processes() - before
    if leftovers:
        # A loader a test built and did not close (no `with`) leaves its persistent workers (forked children) to
        # the garbage collector, later still when an error's traceback holds it in a reference cycle. Collected
        # now, the loader shuts them down itself (killed instead, they would trip DataLoader's SIGCHLD handler).
        gc.collect()
        leftovers = _started_processes() - before
    if leftovers:
        from tests.run_helpers import descendants  # noqa: PLC0415 (imports train: only when there is a leftover)

        for pid in [*leftovers, *(child for leftover in leftovers for child in descendants(leftover))]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.environ.clear()
    os.environ.update(environ)
    for number, handler in handlers.items():
        signal.signal(number, handler)
    _restore_numerics(numerics)


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    """20 identities x 2 two-view records (40 records) and 20 held-out verification pairs. Read only:
    a test that changes data copies it first."""
    folder = tmp_path_factory.mktemp("synthetic")
    assert make_synthetic.main(["--output", str(folder), "--identities", "20", "--images-per-identity", "4",
                                "--val-identities", "10", "--val-pairs", "20", "--workers", "1"]) == 0
    return folder


@pytest.fixture(scope="session")
def trained_backbone(tmp_path_factory) -> Path:
    """A backbone.pth whose BatchNorm statistics are not their initial values (a forward in train mode), as a
    trained one's are not: eval mode and momentum 0 would both leave initial statistics as they are."""
    torch.manual_seed(7)
    backbone = get_model(INFO["network"], num_features=INFO["embedding_size"], **INFO["network_kwargs"])
    with torch.no_grad():
        backbone(torch.randn(4, 3, 112, 112))
    path = tmp_path_factory.mktemp("trained") / "backbone.pth"
    torch.save(backbone.state_dict(), path)
    return path


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
