"""Semi-siamese training's cost against the class-centre mode: step time and peak memory, measured in one run.

    python -m bench.bench_sst                       # CPU, r18 at 1/8 width, a few minutes
    python -m bench.bench_sst --device cuda --width-mult 1 --embedding-size 512 --batch-size 128 \\
        --classes 93431 --queue-size 16384 --steps 20   # on a GPU

Modes, each a full two-view optimizer step (training.step.train_step on random uint8 images already on the
device):
  centres        PartialFC over `--classes` class centres (what configs/lfw_r18_pair.py trains)
  sst            the prototype queue of `--queue-size` slots alone, the gallery network's two extra forwards
  sst + centres  both losses (sst_centre_weight 0.5)
Step times: the modes interleaved in rounds, each the median, so that a machine shared with other work slows
them alike. Peak memory: tools/step_memory.py's measurement of one step (torch.profiler's record of every CPU
allocation, or the CUDA allocator's peak), beside the memory plan's prediction (training/memory_plan.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.bench_train import median_step_times, where
from tools.step_memory import compare
from training.config import load_config
from training.state import build_training_state
from training.step import train_step
from utils.device import configure_numerics

ROOT = Path(__file__).resolve().parent.parent
MODES = {"centres": [], "sst": ["sst=True"], "sst + centres": ["sst=True", "sst_centre_weight=0.5"]}
MIB = 2 ** 20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--network", default="r18")
    parser.add_argument("--width-mult", type=float, default=0.125)
    parser.add_argument("--embedding-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="two-view records per step")
    parser.add_argument("--classes", type=int, default=4096, help="class centres (LFW DevTrain: 4,038 people)")
    parser.add_argument("--queue-size", type=int, default=4096, help="SST's queue (configs/lfw_r18_sst.py's)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (0: torch's default); 1 by default: on shared cores more threads than free "
                             "cores make every step many times slower, whatever the mode")
    return parser.parse_args(argv)


def config(args, mode: str):
    return load_config(ROOT / "configs" / "synthetic_pair.py", [
        "rec=synthetic", f"num_classes={args.classes}", f"num_image={64 * args.batch_size}", "num_workers=0",
        f"network={args.network}", f"network_kwargs={{'width_mult': {args.width_mult}}}",
        f"embedding_size={args.embedding_size}", f"batch_size={args.batch_size}", "num_epoch=1000",
        "optimizer=sgd", f"sst_queue_size={args.queue_size}", *MODES[mode]])


def make_step(args, mode: str, device: torch.device):
    cfg = config(args, mode)
    configure_numerics(device, cfg.tf32, cfg.deterministic)
    state = build_training_state(cfg, args.classes, device, steps_per_epoch=1000)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.batch_size, 2, 3, 112, 112), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, args.classes, (args.batch_size,), generator=generator)
    batch = [(images.to(device), labels.to(device))]
    return lambda: train_step(state, batch, cfg)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    memory = {mode: compare(config(args, mode), device) for mode in MODES}
    median = median_step_times({mode: make_step(args, mode, device) for mode in MODES}, args.rounds, args.steps,
                               device)
    print(f"bench_sst: {args.network} width {args.width_mult}, embedding {args.embedding_size}, B={args.batch_size} "
          f"two-view records, {args.classes} classes, a queue of {args.queue_size}, {where(device)}; median of "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'mode':<16}{'steps/s':>9}{'time vs centres':>17}{'peak MiB':>10}{'peak vs centres':>17}"
          f"{'plan MiB':>10}{'plan/peak':>11}")
    base_time, base_peak = median["centres"], memory["centres"]["measured"]["total"]
    for mode, seconds in median.items():
        peak, plan = memory[mode]["measured"]["total"], memory[mode]["plan"]["total"]
        print(f"{mode:<16}{1 / seconds:>9.2f}{seconds / base_time:>16.2f}x{peak / MIB:>10.1f}{peak / base_peak:>16.2f}x"
              f"{plan / MIB:>10.1f}{plan / peak:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
