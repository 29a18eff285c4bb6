"""Run a function in N real processes joined by a gloo process group (CPU), collect results.

``fn(rank, world_size, *args)`` must be a module-level function (spawned processes import it).
Its return value (anything ``torch.save`` can store) comes back in rank order; an exception in
any rank fails the caller with that rank's traceback.
"""
from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        torch.save({"ok": fn(rank, world_size, *args)}, path)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, path)
        raise
    finally:
        dist.destroy_process_group()


def run_world(fn, world_size: int, *args):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            mp.start_processes(_worker, args=(world_size, init_file, tmp, fn, args), nprocs=world_size,
                               join=True, start_method="spawn")
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is reported below, clearer than the wrapper's
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} died without a result (see its output above)")
            saved = torch.load(path, weights_only=False)
            if "error" in saved:
                raise AssertionError(f"rank {rank} failed:\n{saved['error']}")
            results.append(saved["ok"])
        return results
