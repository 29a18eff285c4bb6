"""Process-group setup and the rank helpers the rest of the code uses.

Every other module asks these helpers instead of calling ``torch.distributed`` directly, so that
the same code runs under ``torchrun`` (any world size, NCCL or gloo) and as a plain single
process with no process group at all.
"""
from __future__ import annotations

import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from utils.errors import UserError
from utils.launcher import local_process


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def nodes() -> int:
    """Machines in the job: torchrun's GROUP_WORLD_SIZE, else processes over processes per node."""
    if "GROUP_WORLD_SIZE" in os.environ:
        return int(os.environ["GROUP_WORLD_SIZE"])
    return max(1, world() // local_process()[1])


def init_distributed(device: torch.device, timeout_minutes: float) -> None:
    """Join the process group torchrun (or srun with MASTER_ADDR/PORT, RANK, WORLD_SIZE) describes, or
    run as one process: without WORLD_SIZE in the environment no process group is created and the
    collective helpers are no-ops. NCCL on GPUs, bound to this process's GPU; gloo on CPUs. The
    timeout covers the longest a rank may wait at a collective for the others (e.g. while rank 0
    writes a checkpoint), so that a slow save does not trip the NCCL watchdog."""
    if "WORLD_SIZE" not in os.environ or is_initialized():
        return
    on_gpu = device.type == "cuda"
    dist.init_process_group(backend="nccl" if on_gpu else "gloo", init_method="env://",
                            timeout=timedelta(minutes=timeout_minutes), device_id=device if on_gpu else None)


def backend() -> str:
    return dist.get_backend() if is_initialized() else "none (one process)"


def lost_peer(error: BaseException) -> str | None:
    """What failed, when `error` is a collective failing because another process went away (it stopped
    on an error of its own, which it reports itself); None for any other error."""
    if world() < 2:
        return None
    # NCCL and the TCP store raise DistError; gloo raises a RuntimeError with its source position first,
    # "closed" when the peer's socket was shut, "reset" when its machine dropped the connection.
    text = str(error)
    if not isinstance(error, dist.DistError) and not re.search(r"Connection (closed|reset) by peer", text):
        return None
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0].strip()


def cleanup() -> None:
    if is_initialized():
        dist.destroy_process_group()


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`tensor`'s element-wise maximum over ranks, in place (used to agree on decisions such as skipping
    a step). The tensor lives where the group's backend needs it: on this rank's GPU for NCCL."""
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def host_group() -> dist.ProcessGroup | None:
    """A group whose collectives take CPU tensors, for decisions that should not wait for the device: the
    default group when it is gloo (None), else a new gloo group beside NCCL. Collective."""
    if not is_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s object on every rank (small Python objects: paths, decisions, config)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list | None:
    """Every rank's small Python object, in rank order, on rank 0 (None elsewhere). Collective."""
    if not is_initialized():
        return [obj]
    out = [None] * world() if is_main() else None
    dist.gather_object(obj, out, dst=0)
    return out



def agreed(decide, share: bool = True):
    """Run `decide()` on rank 0 and raise its user error on every rank, so that no process is left
    waiting at a collective for one that stopped. Returns the result on every rank (`share`), or
    on rank 0 only (None elsewhere) for results that cannot travel, such as an open file."""
    outcome, error = None, None
    if is_main():
        try:
            outcome = decide()
        except UserError as raised:
            error = raised
    error = broadcast_object(error)
    if error is not None:
        raise error
    return broadcast_object(outcome) if share else outcome
