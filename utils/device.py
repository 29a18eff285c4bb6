"""Which device a training process uses, and how its numerics are set: never a silent CPU fallback.

`device = "auto"` takes this process's GPU when CUDA works and the CPU otherwise, and the start-up log
always says which; `"cuda"` refuses to start without a usable GPU and says why (no driver, a driver
too old for the CUDA build torch was compiled for, or a torch without CUDA).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from utils.errors import ConfigError

# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA toolkit release notes).
MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")
CUBLAS_WORKSPACE = ":4096:8"  # the cuBLAS setting that makes its GEMMs deterministic


def choose_device(choice: str, local_rank: int, sharing: int | None) -> torch.device:
    """The device of the process with index `local_rank` on its node, for config key `device`; `sharing`:
    how many of the node's processes share its visible GPUs (torchrun's LOCAL_WORLD_SIZE), None if unknown (srun)."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device='cuda' but CUDA cannot be used here: {cuda_unavailable_reason()}")
    index = _gpu_index(local_rank, sharing, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _gpu_index(local_rank: int, sharing: int | None, visible: int) -> int:
    """Which of the `visible` GPUs (those CUDA_VISIBLE_DEVICES names) is this process's. Processes that share
    them take one each by local index (torchrun; srun --gpus-per-node, every GPU of the node visible to each
    task, as slurm/train_srun.sbatch asks); a process that sees a single GPU past its index was given that
    one for itself (srun --gpus-per-task=1, where SLURM_LOCALID still counts 0..7 but each task sees one device)."""
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
    if sharing is not None and sharing > visible:
        raise ConfigError(f"{sharing} processes on this node but {visible} GPU(s) visible{where}; start "
                          f"torchrun with --nproc_per_node={visible} or fewer")
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise ConfigError(f"process {local_rank} on this node sees {visible} GPUs{where}, fewer than its index; give "
                      "every task all of the node's GPUs (--gpus-per-node, as many as --ntasks-per-node) or each "
                      "task one (--gpus-per-task=1)")


def use_device_in_this_thread(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing on a CPU). A new thread starts on
    GPU 0 whatever its process's device: its first CUDA call (NCCL's and DCP's streams, a stream
    context's exit) would create a context there, ~0.5 GB on GPU 0 for every rank of the node."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def cuda_unavailable_reason() -> str:
    """Why torch.cuda.is_available() is False, as far as can be told, and what to do."""
    build = torch.version.cuda
    if build is None:
        return (f"this torch ({torch.__version__}) is built without CUDA; install the CUDA build pinned in "
                "requirements.txt, or set device='cpu'")
    needed = MIN_DRIVER.get(int(build.split(".")[0]))
    requirement = f"NVIDIA driver {needed} or newer" if needed else "a matching NVIDIA driver"
    if not NVIDIA_DRIVER_FILE.exists():
        return (f"no NVIDIA driver is loaded ({NVIDIA_DRIVER_FILE} is missing); this torch is built for CUDA {build} "
                f"and needs {requirement}: install it, or set device='cpu'")
    driver = NVIDIA_DRIVER_FILE.read_text().split("Kernel Module", 1)[-1].split()[0]
    return (f"the NVIDIA driver is {driver} but this torch is built for CUDA {build} and needs {requirement}: "
            "update the driver (or check CUDA_VISIBLE_DEVICES and nvidia-smi), or set device='cpu'")


def configure_numerics(device: torch.device, tf32: bool, deterministic: bool) -> None:
    """Speed defaults on GPUs (cuDNN autotuning, TF32 matmuls and convolutions), unless `deterministic`
    asks for reproducible kernels: then cuDNN and cuBLAS pick deterministic algorithms and any operation
    without one raises. On a CPU every kernel is deterministic already."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # read at cuBLAS's first use
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic
    # The allow_tf32 switches, on every release: they also set the newer fp32_precision ones where those exist
    # (checked on 2.11 and 2.14), whereas fp32_precision set alone leaves allow_tf32 behind, and torch's own reads
    # of it (torch.export's) then raise.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32


def describe_device(device: torch.device) -> str:
    """'cuda:0 (NVIDIA H200, 139.8 GiB)' or 'cpu (16 cores)', for the start-up log."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{device} ({properties.name}, {properties.total_memory / 2 ** 30:.1f} GiB)"
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} compute threads)"
