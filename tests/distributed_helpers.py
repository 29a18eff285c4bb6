"""Run a function in N real processes joined by a gloo process group (CPU), collect results.

``fn(rank, world_size, *args)`` must be a module-level function (each rank imports its module).
Its return value (anything ``torch.save`` can store) comes back in rank order; an exception in
any rank fails the caller with that rank's traceback. Nothing waits without a bound: a collective that
waits more than COLLECTIVE_TIMEOUT for a peer fails its rank with gloo's error naming it, and a world
still running after `timeout` seconds is killed and fails the caller, naming `fn` and the ranks left with
their Python stacks.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import resource
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # far longer than any test's collective takes on a busy 2-core machine
WORLD_TIMEOUT = 300.0  # seconds for a whole world, its imports included
# Ranks fork from multiprocessing's forkserver, a process that has imported these and run nothing (so no thread
# pool a forked child cannot use): spawning would import torch and pairface again in every rank, seconds of CPU
# each, most of what a small world costs. tests/run_helpers.py's children fork from the same server. Besides
# train.py: what its runs import only once they save (DCP), decode (torchvision), verify (scikit-learn's folds and
# ROC, ~1 s) or log (TensorBoard).
FORKSERVER_PRELOAD = ["train", "checkpoint.sharded", "torchvision.io", "sklearn.model_selection", "sklearn.metrics",
                      "torch.utils.tensorboard"]
multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)


def _worker(rank: int, world_size: int, environment: dict, init_file: str, out_dir: str, fn, args,
            collective_timeout: timedelta = COLLECTIVE_TIMEOUT) -> None:
    os.environ.clear()  # the caller's environment now, as a spawned rank would have it (the server's is older)
    os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Where a hung rank is: _join ends it with SIGABRT, on which faulthandler writes its stacks here and exits
    # (without a core file, which would land in the tests' working folder)
    faulthandler.enable(open(_stacks_path(out_dir, rank), "w"), all_threads=True)  # noqa: SIM115 (open till exit)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=collective_timeout)
    # The process group is not destroyed: the rank ends with os._exit (multiprocessing's forkserver child) and
    # its connections with it. Before torch 2.8, destroying a gloo group holds the GIL while it waits for the
    # group's threads, one of which may still need the GIL to free the tensors of the last collective: a
    # deadlock (PyTorch PR 154976), which hung ranks of this helper on torch 2.4.1 (measured: 9 in 40 worlds).
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        torch.save({"ok": fn(rank, world_size, *args)}, path)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, path)
        raise


def _stacks_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.stacks")


def _stacks(out_dir: str, rank: int) -> str:
    """What the rank's faulthandler wrote as a signal ended it: nothing unless one did."""
    try:
        with open(_stacks_path(out_dir, rank)) as stacks:
            return stacks.read()
    except FileNotFoundError:  # the rank ended before it enabled faulthandler
        return ""


def _stacks_of(context, out_dir: str, running: list[int]) -> str:
    """The Python stacks of the hung ranks, as each rank's faulthandler writes them on SIGABRT before it exits."""
    for rank in running:
        os.kill(context.processes[rank].pid, signal.SIGABRT)
        context.processes[rank].join(30)
    return "\n".join(f"rank {rank}:\n{_stacks(out_dir, rank)}" for rank in running)


def _join(context, fn, world_size: int, timeout: float, out_dir: str) -> None:
    """Until every rank has ended; kills them all and fails once `timeout` seconds have passed. No rank outlives
    the call, whatever ends it (pytest's timeout too): a rank left running would find its folder deleted."""
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):  # returns as each rank ends
            if time.monotonic() >= deadline:
                running = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
                raise AssertionError(f"{fn.__name__} on {world_size} process(es): rank(s) {running} still running "
                                     f"after {timeout:.0f} s, killed (a hang outside any collective); where they "
                                     f"were:\n{_stacks_of(context, out_dir, running)}")
    except mp.ProcessRaisedException:
        pass  # the rank's own traceback is reported by run_world, clearer than the wrapper's
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(30)


def run_world(fn, world_size: int, *args, timeout: float = WORLD_TIMEOUT,
              collective_timeout: timedelta = COLLECTIVE_TIMEOUT):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(_worker, args=(world_size, dict(os.environ), init_file, tmp, fn, args,
                                                    collective_timeout),
                                     nprocs=world_size, join=False, start_method="forkserver")
        _join(context, fn, world_size, timeout, tmp)
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} died without a result (see its output above)\n"
                                     f"{_stacks(tmp, rank)}")
            saved = torch.load(path, weights_only=False)
            if "error" in saved:
                raise AssertionError(f"rank {rank} failed:\n{saved['error']}")
            results.append(saved["ok"])
        return results
