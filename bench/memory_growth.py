"""Reserved memory before and after more training steps: growth means the caching allocator keeps
reserving blocks it cannot reuse (tensors whose shapes change from step to step, such as the sampled
centres at sample_rate 0), which ends in an out-of-memory error days into a run.

    python -m bench.memory_growth --device cuda --network r50 --width-mult 1 --batch-size 128 --fp16
    python -m bench.memory_growth                     # CPU: the process's resident memory instead

The step is bench.host_syncs.training_step (train_step on new random two-view records, made on the device,
each step).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.host_syncs import training_step

MIB = 2 ** 20


def reserved_bytes(device: torch.device) -> int:
    """What the caching allocator holds on a GPU; on a CPU, this process's resident memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_reserved(device)
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--network", default="r18")
    parser.add_argument("--width-mult", type=float, default=0.0625)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--sample-rate", type=float, default=0.0, help="0: the columns change with every batch")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the first reading")
    parser.add_argument("--steps", type=int, default=100, help="steps between the two readings")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    step = training_step(device, args.classes, args.batch_size, f"network={args.network}",
                         f"network_kwargs={{'width_mult': {args.width_mult}}}", f"sample_rate={args.sample_rate}",
                         f"fp16={args.fp16}")
    for _ in range(args.warmup):
        step()
    before = reserved_bytes(device)
    for _ in range(args.steps):
        step()
    after = reserved_bytes(device)
    what = "reserved" if device.type == "cuda" else "resident"
    print(f"{what} {before / MIB:.0f} MiB after {args.warmup} steps, {after / MIB:.0f} MiB after {args.steps} more: "
          f"growth {(after - before) / MIB:+.0f} MiB ({args.network} x{args.width_mult}, B={args.batch_size}, "
          f"sample_rate {args.sample_rate}, fp16={args.fp16})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
