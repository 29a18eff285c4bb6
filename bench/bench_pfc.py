"""PartialFC forward+backward time and peak memory, as ratios to a dense reference, on this CPU.

    python -m bench.bench_pfc [--classes 10000 100000 1000000] [--device cuda]
    python -m bench.bench_pfc --families [--classes 100000]   # each margin family's time / the combined's
    python -m bench.bench_pfc --step [--classes 10000 100000]  # the centre step with its optimizer (bench/pfc_step.py)

The reference is what a user would write without Partial FC: ``nn.Linear`` on normalised
weights, the same margin, ``F.cross_entropy``, over the same 256 embeddings (batch 128 x 2
views, D=512). Every (implementation, C) runs in a fresh process, so each peak is its own:
peak memory is the high-water mark of one forward+backward minus what was resident once the
weights existed (CPU: VmHWM after resetting it; CUDA: max_memory_allocated). Time is the mean
of a few steps after one warm-up step, all measured in this run. Beside each time, its floor
(bench/floor.py): the three GEMMs at the GEMM rate measured in that process (in float16 with
--fp16 on a GPU), plus one read of the logits and one write of their gradient at the copy
bandwidth measured there.

`--families` times PartialFC with each margin family instead (losses.py; sub-center with K = 3), at
sample rates 1.0 and 0.1, relative to the combined family (ArcFace) at the same C and rate: each family's
fastest of `--rounds` fresh processes, the rounds interleaved, so that a machine others share slows one
family's round, not its figure.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import pfc_step
from bench.floor import copy_bandwidth, gemm_rate, pfc_floor
from losses import AdaFaceMargin, CombinedMarginLoss, CurricularMargin, ElasticMargin
from partial_fc import PartialFC

ROOT = Path(__file__).resolve().parent.parent

BATCH, VIEWS, DIM = 128, 2, 512
IMPLEMENTATIONS = ("dense", "pfc@1.0", "pfc@0.1")
FAMILIES = ("combined", "adaface", "curricular", "elastic_arc", "subcenter")
FAMILY_RATES = (1.0, 0.1)


def family_margin(name: str):
    """(margin, sub-centres per class) of a family with its paper's settings."""
    return {"combined": (CombinedMarginLoss(64.0, 1.0, 0.5, 0.0), 1), "adaface": (AdaFaceMargin(64.0), 1),
            "curricular": (CurricularMargin(64.0), 1), "elastic_arc": (ElasticMargin(64.0, "arc"), 1),
            "subcenter": (CombinedMarginLoss(64.0, 1.0, 0.5, 0.0), 3)}[name]


class DenseReference(torch.nn.Module):
    """nn.Linear on normalised features + the margin + F.cross_entropy over all views at once; returns
    (loss, None) like PartialFC's (loss, per-view losses)."""

    def __init__(self, num_classes: int, margin: CombinedMarginLoss):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (num_classes, DIM)))
        self.margin = margin

    def forward(self, views, labels):
        embeddings = torch.cat(views)
        cos = F.linear(F.normalize(embeddings), F.normalize(self.weight))
        return F.cross_entropy(self.margin(cos, labels.repeat(len(views))), labels.repeat(len(views))), None


def _resident_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak(device: torch.device) -> int:
    """Start a new high-water mark; return the bytes in use now."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    return _resident_bytes("VmRSS")


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _resident_bytes("VmHWM")


def measure(implementation: str, num_classes: int, device: torch.device, steps: int, fp16: bool) -> dict:
    torch.manual_seed(0)
    implementation, _, family = implementation.partition(":")  # "pfc@RATE:FAMILY" times a margin family
    margin, k = family_margin(family or "combined")
    if implementation == "dense":
        head = DenseReference(num_classes, margin)
    else:
        head = PartialFC(margin, DIM, num_classes, sample_rate=float(implementation.split("@")[1]), num_subcenters=k)
    head = head.to(device)
    views = [torch.randn(BATCH, DIM, device=device, requires_grad=True) for _ in range(VIEWS)]
    labels = torch.randint(0, num_classes, (BATCH,), device=device)

    def step():
        head.weight.grad = None
        with torch.autocast(device.type, dtype=torch.float16, enabled=fp16 and device.type == "cuda"):
            loss, _ = head(views, labels)
        loss.backward()

    if device.type == "cuda":
        # The first CUDA step also allocates cuBLAS workspaces and caches that are not the steady state. (On a
        # CPU a warm-up would leave its freed pages resident and hide the step's own peak.)
        step()
    baseline = _reset_peak(device)
    step()
    peak_above = _peak(device) - baseline
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sum(times) / len(times)
    rate = 1.0 if implementation == "dense" else min(1.0, float(implementation.split("@")[1]))
    sampled = num_classes if rate >= 1 else int(rate * num_classes)
    half = fp16 and device.type == "cuda"
    gemm = gemm_rate(device, torch.float16 if half else torch.float32)
    floor = pfc_floor(BATCH * VIEWS, DIM, num_classes, sampled, logit_bytes=2 if half else 4, update=False,
                      gemm=gemm, bandwidth=copy_bandwidth(device))
    return dict(seconds=seconds, peak_above=peak_above, tflops=floor.gemm_flop / seconds / 1e12, floor=floor.seconds)


def table_row(num_classes: int, implementation: str, result: dict, dense: dict) -> str:
    """One line of the table (bench/gpu_check.py parses it): time and peak above the weights, each also as a
    ratio to the dense reference's, and the time's floor."""
    return (f"{num_classes:>9} {implementation:>8} {result['seconds'] * 1e3:>10.1f} "
            f"{result['seconds'] / dense['seconds']:>7.2f} {result['peak_above'] / 2**20:>12.1f} "
            f"{result['peak_above'] / max(dense['peak_above'], 1):>9.2f} {result['tflops']:>8.3f} "
            f"{result['floor'] * 1e3:>9.1f} {result['seconds'] / result['floor']:>7.2f}x")


def run_in_subprocess(implementation: str, num_classes: int, args) -> dict:
    command = [sys.executable, "-m", "bench.bench_pfc", "--worker", implementation, str(num_classes),
               "--device", args.device, "--threads", str(args.threads), "--rounds", str(args.rounds)]
    command += ["--fp16"] if args.fp16 else []
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{implementation} at C={num_classes} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fp16", action="store_true", help="fp16 autocast and fp16 logits GEMMs (CUDA)")
    parser.add_argument("--families", action="store_true", help="each margin family's time relative to the combined")
    parser.add_argument("--rounds", type=int, default=3, help="with --families: processes per family and cell; with "
                        "--step: interleaved rounds per cell")
    parser.add_argument("--step", action="store_true", help="forward, backward and SGD of the centres, against the "
                        "floor and arcface_torch's PartialFC_V2 + SGD, at sample rates 1.0 and 0.1, with a profile")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "C"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    if args.worker:
        implementation, num_classes = args.worker[0], int(args.worker[1])
        if implementation.startswith("step@"):
            pfc_step.worker(num_classes, float(implementation.split("@")[1]), args)
            return
        steps = 5 if num_classes <= 100_000 else 2
        print(json.dumps(measure(implementation, num_classes, device, steps, args.fp16)))
        return

    if args.families:
        compare_families(args)
        return
    if args.step:
        pfc_step.print_table({(num_classes, rate): run_in_subprocess(f"step@{rate}", num_classes, args)
                              for num_classes in args.classes for rate in FAMILY_RATES}, args)
        return
    print(f"PartialFC vs dense reference: batch {BATCH} x {VIEWS} views, D={DIM}, world 1, {device.type}, "
          f"{args.threads} threads{', fp16' if args.fp16 else ''}. One fresh process per row.")
    if device.type == "cpu":
        print("CPU note: this machine's 2 cores may be shared; GPU figures need `--device cuda --fp16` "
              "on a GPU (bash bench/gpu_throughput.sh pfc).")
    header = (f"{'classes':>9} {'impl':>8} {'ms/step':>10} {'x time':>7} {'MiB above W':>12} {'x memory':>9} "
              f"{'TFLOP/s':>8} {'floor ms':>9} {'x floor':>8}")
    print(header)
    print("-" * len(header))
    for num_classes in args.classes:
        results = {impl: run_in_subprocess(impl, num_classes, args) for impl in IMPLEMENTATIONS}
        dense = results["dense"]
        for impl, r in results.items():
            print(table_row(num_classes, impl, r, dense))
        sys.stdout.flush()


def compare_families(args) -> None:
    print(f"PartialFC per margin family, time / the combined family's (ArcFace): batch {BATCH} x {VIEWS} views, "
          f"D={DIM}, world 1, {args.device}, {args.threads} threads{', fp16' if args.fp16 else ''}; sub-center "
          f"K=3. Each family's fastest of {args.rounds} fresh processes, interleaved.")
    header = f"{'classes':>9} {'rate':>5} {'combined ms':>12}" + "".join(f" {name:>11}" for name in FAMILIES[1:])
    print(header)
    print("-" * len(header))
    for num_classes in args.classes:
        for rate in FAMILY_RATES:
            seconds = dict.fromkeys(FAMILIES, float("inf"))
            for _ in range(args.rounds):
                for name in FAMILIES:
                    measured = run_in_subprocess(f"pfc@{rate}:{name}", num_classes, args)["seconds"]
                    seconds[name] = min(seconds[name], measured)
            print(f"{num_classes:>9} {rate:>5} {seconds['combined'] * 1e3:>12.1f}"
                  + "".join(f" {seconds[name] / seconds['combined']:>10.2f}x" for name in FAMILIES[1:]))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
