"""What the launcher (torchrun, or srun) tells this process about its place in the job, read from the
environment before any process group exists.

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK and LOCAL_WORLD_SIZE itself (also
when srun starts one torchrun per node). srun starting every training process as a task of its own
(`srun python train.py`) sets only Slurm's variables; `adopt_srun_environment` derives torchrun's from
them as Lightning's SLURM environment does, so that the rest of the code reads torchrun's names alone.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

from utils.errors import ConfigError

SLURM_PORT_BASE = 15000  # MASTER_PORT = this + the last four digits of SLURM_JOB_ID: every task computes the same
SLURM_PORT_WITHOUT_JOB = 12910


def launched_rank() -> int:
    """This process's rank as the launcher (torchrun) announced it: valid before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def local_process() -> tuple[int, int | None]:
    """(this process's index on its node, how many processes on the node share its GPUs), from torchrun's
    LOCAL_RANK and LOCAL_WORLD_SIZE, or srun's SLURM_LOCALID. Under srun the second is None: Slurm may
    give each task GPUs of its own (--gpus-per-task), so no task count says how many share them."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "SLURM_LOCALID" in os.environ:
        return int(os.environ["SLURM_LOCALID"]), None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("WORLD_SIZE > 1 but neither LOCAL_RANK (torchrun) nor SLURM_LOCALID (srun) says which "
                          "GPU is this process's; start training with torchrun or srun")
    return 0, 1


def srun_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for one of several tasks srun started, from
    SLURM_PROCID, SLURM_NTASKS, the first host of SLURM_JOB_NODELIST and SLURM_JOB_ID (MASTER_ADDR and
    MASTER_PORT given by the user win); {} under torchrun (RANK is set), outside srun, or for a single task."""
    if "RANK" in environ or "SLURM_PROCID" not in environ or int(environ.get("SLURM_NTASKS", "1")) < 2:
        return {}
    derived = {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"]}
    if "MASTER_ADDR" not in environ:
        if not environ.get("SLURM_JOB_NODELIST"):
            raise ConfigError(f"srun started {environ['SLURM_NTASKS']} tasks but SLURM_JOB_NODELIST is not set, so "
                              "the first node's address is unknown; export MASTER_ADDR=<first node's host name>")
        derived["MASTER_ADDR"] = first_host(environ["SLURM_JOB_NODELIST"])
    if "MASTER_PORT" not in environ:
        job = environ.get("SLURM_JOB_ID", "")
        derived["MASTER_PORT"] = str(SLURM_PORT_BASE + int(job[-4:]) if job.isdigit() else SLURM_PORT_WITHOUT_JOB)
    return derived


def adopt_srun_environment() -> None:
    """Under `srun python train.py` (one task per process), set torchrun's variables from Slurm's."""
    os.environ.update(srun_environment(os.environ))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: 'gpu[007-009,012],cpu01' -> 'gpu007', 'r[1-2]-n[01-04]' -> 'r1-n01'."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())[0]  # up to the first comma outside brackets
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)  # each range: its first value


def torchrun_run_id() -> str | None:
    """The id of the torchrun run this process belongs to (`--rdzv-id`; a fresh one for each `--standalone`
    or single-node launch), the same in every process torchrun starts for that run, restarts included;
    None outside torchrun and for torchrun's placeholder "none" (a multi-node launch without --rdzv-id),
    which cannot tell one run from another."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id in (None, "none") else run_id


def launch_words() -> str:
    """How this process was started, for a command line that starts it again: ``python``, ``srun python``
    or ``torchrun [its options]`` (torchrun's own options are not known to its processes)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun [the same torchrun options]"
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "srun python"
    return "python"
