"""What the launcher (torchrun, or srun) tells this process about its place in the job, read from the
environment before any process group exists."""
from __future__ import annotations

import os

from utils.errors import ConfigError


def launched_rank() -> int:
    """This process's rank as the launcher (torchrun) announced it: valid before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def local_process() -> tuple[int, int]:
    """(this process's index on its node, processes on the node) from torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE, or SLURM's SLURM_LOCALID and SLURM_NTASKS_PER_NODE under srun."""
    for index, count in (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")):
        if index in os.environ:
            return int(os.environ[index]), int(os.environ.get(count, "1").split("(")[0])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("WORLD_SIZE > 1 but neither LOCAL_RANK (torchrun) nor SLURM_LOCALID (srun) says which "
                          "GPU is this process's; start training with torchrun or srun")
    return 0, 1


def torchrun_run_id() -> str | None:
    """The id of the torchrun run this process belongs to (`--rdzv-id`; a fresh one for each `--standalone`
    or single-node launch), the same in every process torchrun starts for that run, restarts included;
    None outside torchrun and for torchrun's placeholder "none" (a multi-node launch without --rdzv-id),
    which cannot tell one run from another."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id in (None, "none") else run_id
