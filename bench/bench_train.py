"""Training-step throughput: one view vs two views in one backbone pass vs two views in two passes.

    python -m bench.bench_train                      # CPU, tiny r18, a couple of minutes
    python -m bench.bench_train --device cuda --network r50 --width-mult 1 \\
        --embedding-size 512 --batch-size 128 --fp16 --steps 100 --rounds 2   # on a GPU

Modes, each a full optimizer step (normalise, backbone, PartialFC, backward, clip, SGD, LR step)
on random uint8 images already on the device (no decoding):
  (a) one view,  B records = B images                  training.step.train_step
  (b) two views, B records = 2B images, one pass        training.step.train_step
  (c) two views, B records = 2B images, two passes      train_step, the backbone called once per view
The modes run interleaved in rounds and each reports its median step time, so a machine shared
with other work (as this 2-core CPU is) slows all of them alike. Target: (b) <= 2.0x (a), (b) < (c).

`--split` prints instead, per network and view count, images/s, the step split (data, backbone forward,
PartialFC, backbone backward, optimizer), MFU from the FLOPs counted at 112x112, and the switches
(channels_last, bf16, compile, the optimizer's kernel) each on and off: bench/step_split.py (`--tiny`
rehearses its GPU command on this CPU at tiny shapes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import step_split
from training.config import load_config
from training.state import build_training_state
from training.step import train_step
from utils.device import configure_numerics

ROOT = Path(__file__).resolve().parent.parent

MODES = {"a": ("one view", 1), "b": ("two views, one pass", 2), "c": ("two views, two passes", 2)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--network", default="r18")
    parser.add_argument("--width-mult", type=float, help=f"0.125 by default; {step_split.SPLIT_WIDTH} with --split")
    parser.add_argument("--embedding-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="records per step (B)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="abc")
    parser.add_argument("--peak-of", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (0: torch's default); 1 by default: on shared cores more threads than "
                             "free cores make every step many times slower, whatever the mode")
    step_split.add_options(parser)
    if "--tiny" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(device="cpu", **step_split.TINY)  # what the command line gives still wins
    args = parser.parse_args(argv)
    if args.width_mult is None:
        args.width_mult = step_split.SPLIT_WIDTH if args.split else 0.125
    return args


class PerViewPasses(torch.nn.Module):
    """Mode (c): the backbone called once per view (rows v::V of train_step's flat batch) and the
    embeddings put back in place, so that everything else is train_step's own code."""

    def __init__(self, backbone: torch.nn.Module, views: int) -> None:
        super().__init__()
        self.backbone, self.views = backbone, views

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        per_view = [self.backbone(flat[v::self.views]) for v in range(self.views)]
        return torch.stack(per_view, dim=1).reshape(flat.shape[0], -1)


def make_mode(args, mode: str, device: torch.device):
    _, views = MODES[mode]
    cfg = load_config(ROOT / "configs" / "synthetic_pair.py", [
        f"network={args.network}", f"network_kwargs={{'width_mult': {args.width_mult}}}",
        f"embedding_size={args.embedding_size}", f"num_views={views}", f"fp16={args.fp16}",
        f"batch_size={args.batch_size}", "num_epoch=1000"])
    configure_numerics(device, cfg.tf32, cfg.deterministic)  # as train.py: TF32 and cuDNN autotuning on a GPU
    state = build_training_state(cfg, args.classes, device, steps_per_epoch=1000)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.batch_size, views, 3, 112, 112), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, args.classes, (args.batch_size,), generator=generator)
    batch = [(images.to(device), labels.to(device))]
    if mode == "c":
        state.ddp_backbone = PerViewPasses(state.backbone, views)
    return lambda: train_step(state, batch, cfg)


def timed(step, steps: int, device: torch.device) -> float:
    """Seconds per step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def median_step_times(steps: dict, rounds: int, steps_per_round: int, device: torch.device) -> dict[str, float]:
    """Seconds per step of each of `steps` (name: a step to call), after a warm-up step each: the median of rounds
    that run them in turn, so that a machine shared with other work slows them alike."""
    for step in steps.values():  # warm-up: allocator, kernels
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(timed(step, steps_per_round, device))
    return {name: statistics.median(t) for name, t in times.items()}


def where(device: torch.device) -> str:
    """The device, as a benchmark's table names it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"CPU, {torch.get_num_threads()} thread(s) (on cores shared with other work: absolute numbers vary, "
            "ratios hold)")


def peak_of_one_mode(args, mode: str, device: torch.device) -> float:
    """GiB of GPU memory at the peak of one step of `mode`, after a warm-up step, alone in this process."""
    step = make_mode(args, mode, device)
    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2 ** 30


def mode_peak_in_a_process(argv, mode: str) -> float:
    command = [sys.executable, "-m", "bench.bench_train", *(sys.argv[1:] if argv is None else argv), "--peak-of", mode]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.peak_of:
        print(json.dumps(peak_of_one_mode(args, args.peak_of, device)))
        return 0
    if args.split:
        step_split.report(args, device)
        return 0
    # One process per mode for GPU memory: in this one every mode's model and optimizer state stays allocated.
    peak = {mode: mode_peak_in_a_process(argv, mode) for mode in args.modes} if device.type == "cuda" else {}
    median = median_step_times({mode: make_mode(args, mode, device) for mode in args.modes}, args.rounds, args.steps,
                               device)
    print(f"bench_train: {args.network} width {args.width_mult}, embedding {args.embedding_size}, B={args.batch_size} "
          f"records, {args.classes} classes, fp16={args.fp16}, {where(device)}; median of {args.rounds} rounds x "
          f"{args.steps} steps")
    header = f"{'mode':<30}{'images/step':>12}{'steps/s':>10}{'samples/s':>11}{'images/s':>10}{'time vs (a)':>13}"
    if peak:
        header += f"{'peak GiB':>10}"
    print(header)
    for mode, seconds in median.items():
        name, views = MODES[mode]
        row = (f"({mode}) {name:<26}{args.batch_size * views:>12}{1 / seconds:>10.2f}{args.batch_size / seconds:>11.1f}"
               f"{args.batch_size * views / seconds:>10.1f}")
        row += f"{seconds / median['a']:>12.2f}x" if "a" in median else f"{'':>13}"
        if peak:
            row += f"{peak[mode]:>10.2f}"
        print(row)
    if {"a", "b", "c"} <= set(median):
        ratio, versus = median["b"] / median["a"], median["c"] / median["b"]
        verdict = "met" if ratio <= 2.0 and versus > 1.0 else "NOT met"
        print(f"(b) costs {ratio:.2f}x (a) (target <= 2.0x); (c) costs {versus:.2f}x (b) (target > 1.0x): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
