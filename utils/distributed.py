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

from utils.errors import NetworkError, TrainingError, UserError
from utils.launcher import local_process
from utils.network import ADVICE, describe_host, master_answers
from utils.watchdog import StartWatchdog


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def nodes() -> int:
    """Machines in the job: torchrun's GROUP_WORLD_SIZE, the nodes of srun's step, else processes over processes
    per node."""
    for name in ("GROUP_WORLD_SIZE", "SLURM_STEP_NUM_NODES"):
        if name in os.environ:
            return int(os.environ[name])
    return max(1, world() // (local_process()[1] or 1))


# init_distributed's timeout, for the gloo groups made beside the default one: torch's new_group does not take
# the default group's but its own default (30 minutes for gloo), whatever timeout_minutes says.
_group_timeout: timedelta | None = None
# Seconds of network_check_seconds that the first all-reduce leaves to the watchdog, so that gloo's own timeout (with
# the backend's reason) ends a late rank's wait rather than the watchdog (which knows only the phase).
PROBE_MARGIN_SECONDS = 1.0


def init_distributed(device: torch.device, timeout_minutes: float, check_seconds: float = 120.0) -> None:
    """Join the process group torchrun (or srun, through utils.launcher.adopt_srun_environment) describes, or
    run as one process: without WORLD_SIZE in the environment no process group is created and the
    collective helpers are no-ops. NCCL on GPUs, bound to this process's GPU; gloo on CPUs. The
    timeout covers the longest a rank may wait at a collective for the others (e.g. while rank 0
    writes a checkpoint), so that a slow save does not trip the NCCL watchdog; the groups made later
    (host_group, checkpoint_group) wait as long.

    Then one small all-reduce: a network that joins the group but cannot carry a collective (the wrong interface,
    a container's own network) fails here, with what this process sees of the network, rather than as a hang or a
    backend error in the first step (NetworkError). Joining and the all-reduce together end within
    `check_seconds`: a rank that never comes, or a master that cannot be reached, stops this process with the same
    line from a watchdog (utils/watchdog.py), instead of a silent wait of `timeout_minutes`."""
    if "WORLD_SIZE" not in os.environ or is_initialized():
        return
    global _group_timeout
    _group_timeout = timedelta(minutes=timeout_minutes)
    on_gpu = device.type == "cuda"
    name, processes = ("nccl" if on_gpu else "gloo"), os.environ["WORLD_SIZE"]
    watchdog = StartWatchdog(check_seconds, lambda phase: _network_line(
        f"{phase}: no answer within network_check_seconds={check_seconds:g}; {master_answers()}", name))
    try:
        watchdog.phase = f"joining the process group of {processes} processes"
        dist.init_process_group(backend=name, init_method="env://", timeout=_group_timeout,
                                device_id=device if on_gpu else None)
        watchdog.phase = f"the first all-reduce over {processes} processes"
        probe = torch.ones(1, device=device if on_gpu else "cpu")
        # gloo's own timeout ends the wait with the backend's reason, a moment before the watchdog would
        # (NCCL's returns at once: the read below waits, and the watchdog bounds it).
        wait = max(watchdog.remaining() - PROBE_MARGIN_SECONDS, watchdog.remaining() / 2)
        dist.all_reduce(probe, async_op=True).wait(timedelta(seconds=wait))
        if probe.item() != dist.get_world_size():
            raise RuntimeError(f"the all-reduce of ones over {dist.get_world_size()} processes gave {probe.item()}")
    except RuntimeError as error:  # DistError is one; gloo raises plain RuntimeErrors
        reason = re.sub(r"^\[[^\]]*\]\s*", "", str(error)).strip().splitlines()[0]
        raise NetworkError(_network_line(f"{watchdog.phase}: {reason}", name)) from error
    finally:
        watchdog.stand_down()


def _network_line(reason: str, backend_name: str) -> str:
    """The one line of a start that failed or hung: what this rank was doing and saw, its network, the advice."""
    return f"the network check before the first step failed ({reason}) on {describe_host(backend_name)}; {ADVICE}"


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
    return dist.new_group(backend="gloo", timeout=_group_timeout)


def broadcast_object(obj, src: int = 0, group=None):
    """Rank ``src``'s object on every rank (small Python objects: paths, decisions, config)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj, group=None) -> list | None:
    """Every rank's small Python object, in rank order, on rank 0 (None elsewhere). Collective."""
    if not is_initialized():
        return [obj]
    out = [None] * world() if is_main() else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def checkpoint_group():
    """A gloo process group of every rank for checkpoint traffic, which may run in a background thread
    while training uses the default group (two threads must never share one group's collectives).
    None without a process group."""
    return dist.new_group(backend="gloo", timeout=_group_timeout) if is_initialized() else None


def run_on_rank0(decide, share: bool = True, group=None):
    """Run `decide()` on rank 0 and raise its error on every rank, so that no process is left waiting at
    a collective for one that stopped. A user error is raised as it is everywhere; any other failure
    (a bug) keeps its traceback on rank 0 and stops the others with a line that points there. Returns
    the result on every rank (`share`), or on rank 0 only (None elsewhere) for results that cannot
    travel, such as an open file."""
    outcome, error, failure = None, None, None
    if is_main():
        try:
            outcome = decide()
        except UserError as raised:
            error = raised
        except Exception as raised:
            failure = raised
            error = TrainingError(f"rank 0 failed ({type(raised).__name__}: {raised}); its traceback says where: "
                                  "report it with that traceback")
    error = broadcast_object(error, group=group)
    if failure is not None:
        raise failure
    if error is not None:
        raise error
    return broadcast_object(outcome, group=group) if share else outcome


def raise_first(error: UserError | None) -> None:
    """Every rank passes its own outcome of some work (None: it went well); the error of the lowest rank
    that failed is raised on every rank. Collective."""
    if is_initialized():
        errors = [None] * world()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
