"""What this device does at best, measured in the run, and the floor of PartialFC's step computed from it: the
step's GEMMs at the measured GEMM rate plus the bytes no implementation can avoid moving at the measured copy
bandwidth. A time within a small factor of its floor has little left to win; far above it, the step (not the
chip) sets the pace.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Tries per rate, the best counting: on a machine others share, a few short tries can all land in someone
# else's time slice, and a rate measured low puts the floor above the step it bounds.
TRIES = 16


def seconds(work: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of `work()`, the device idle before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def gemm_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in `dtype` on `device`, the best of TRIES: what the chip multiplies at here."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    a @ b  # the first call picks its kernel
    return 2 * n ** 3 / min(seconds(lambda: a @ b, device) for _ in range(TRIES))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s a large copy moves (each byte read once and written once), the best of TRIES: what one pass over
    memory-bound data costs here. 1 GiB on a GPU (far beyond its caches), 64 MiB on a CPU."""
    elements = (2 ** 28 if device.type == "cuda" else 2 ** 24)
    source, target = torch.ones(elements, device=device), torch.empty(elements, device=device)
    target.copy_(source)
    return 2 * 4 * elements / min(seconds(lambda: target.copy_(source), device) for _ in range(TRIES))


@dataclass(frozen=True)
class PfcFloor:
    """PartialFC's floor: `rows` embeddings of `dim` against `sampled` of `num_classes` centres."""

    gemm_flop: float
    pass_bytes: float
    gemm_rate: float
    bandwidth: float

    @property
    def seconds(self) -> float:
        return self.gemm_flop / self.gemm_rate + self.pass_bytes / self.bandwidth

    def describe(self) -> str:
        return (f"GEMMs {self.gemm_flop / 1e9:.1f} GFLOP at {self.gemm_rate / 1e9:.0f} GFLOP/s = "
                f"{self.gemm_flop / self.gemm_rate * 1e3:.2f} ms, passes {self.pass_bytes / 1e9:.2f} GB at "
                f"{self.bandwidth / 1e9:.0f} GB/s = {self.pass_bytes / self.bandwidth * 1e3:.2f} ms")


def pfc_floor(rows: int, dim: int, num_classes: int, sampled: int, logit_bytes: int, update: bool,
              gemm: float, bandwidth: float) -> PfcFloor:
    """Forward and backward: three GEMMs (the cosines, the embeddings' and the sampled centres' gradients,
    2 * rows * dim * sampled FLOP each), and one read of the logits and one write of their gradient (the margin,
    softmax and cross-entropy in one pass). With `update`, the optimizer's step over every centre (float32 SGD
    with momentum and weight decay, whose dense semantics move every row every step): the centres and their
    momentum read and written, the sampled centres' gradient read."""
    pass_bytes = 2 * rows * sampled * logit_bytes
    if update:
        pass_bytes += 4 * num_classes * dim * 4 + sampled * dim * 4
    return PfcFloor(3 * 2 * rows * dim * sampled, pass_bytes, gemm, bandwidth)
