"""Process-group setup and the rank helpers the rest of the code uses.

Every other module asks these helpers instead of calling ``torch.distributed`` directly, so that
the same code runs under ``torchrun`` (any world size, NCCL or gloo) and as a plain single
process with no process group at all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def launched_rank() -> int:
    """This process's rank as the launcher (torchrun) announced it: valid before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None) -> DistEnv:
    """Join the process group torchrun describes in the environment, or run as one process.

    Without ``WORLD_SIZE`` in the environment (plain ``python train.py``) no process group is
    created; the collective helpers then degrade to no-ops.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "WORLD_SIZE" in os.environ and not is_initialized():
        dist.init_process_group(backend=backend or default_backend(), init_method="env://")
    return DistEnv(rank=rank(), local_rank=local_rank, world_size=world_size, device=device)


def cleanup() -> None:
    if is_initialized():
        dist.destroy_process_group()


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s element-wise maximum over ranks, in place (used to agree on decisions such as skipping
    a step). The tensor lives where the backend needs it: on this rank's GPU for NCCL."""
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


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

