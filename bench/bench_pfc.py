"""PartialFC forward+backward time and peak memory, as ratios to a dense reference, on this CPU.

    python -m bench.bench_pfc [--classes 10000 100000 1000000] [--device cuda]
    python -m bench.bench_pfc --families [--classes 100000]   # each margin family's time / the combined's
    python -m bench.bench_pfc --step [--classes 10000 100000]  # the centre step with its optimizer (bench/pfc_step.py)
    python -m bench.bench_pfc --compile [--classes 100000]     # PartialFC's rows also with compile_margin_softmax

The reference is what a user would write without Partial FC: ``nn.Linear`` on normalised
weights, the same margin, ``F.cross_entropy``, over the same 256 embeddings (batch 128 x 2
views, D=512). Every (implementation, C) runs in a fresh process, so each peak is its own:
peak memory is the high-water mark of one forward+backward minus what was resident once the
weights existed (CPU: VmHWM after resetting it; CUDA: max_memory_allocated). Time is the mean
of a few steps after one warm-up step, all measured in this run. Beside each time, its floor
(bench/floor.py): the three GEMMs at the GEMM rate measured in that process (in float16 with
--fp16 on a GPU), plus one read of the logits and one write of their gradient at the copy
bandwidth measured there.

`--compile` adds a row per sample rate with ``compile_margin_softmax=True`` (pfc@RATE+compile): the softmax's
passes over the logits compiled by torch.compile. Its compile seconds, in a column of their own, are those of
a forward without gradients over 4 rows per view first (every pass runs in the forward: it compiles them all,
at the measured widths, and the measured steps then compile nothing, which the row checks); the kernels are
cached in TORCHINDUCTOR_CACHE_DIR, by default a folder of the temporary directory, so a second run reads them.
A CPU's ranking of eager and compiled says nothing about a GPU's: inductor writes C++ loops here, Triton
kernels there. (On a CPU a compiled row's peak may read lower: pages its compiling forward freed stay resident.)

`--families` times PartialFC with each margin family instead (losses.py; sub-center with K = 3), at
sample rates 1.0 and 0.1, relative to the combined family (ArcFace) at the same C and rate: each family's
fastest of `--rounds` fresh processes, the rounds interleaved, so that a machine others share slows one
family's round, not its figure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import pfc_step
from bench.floor import copy_bandwidth, gemm_rate, pfc_floor, seconds
from losses import AdaFaceMargin, CombinedMarginLoss, CurricularMargin, ElasticMargin
from partial_fc import PartialFC

ROOT = Path(__file__).resolve().parent.parent

BATCH, VIEWS, DIM = 128, 2, 512
IMPLEMENTATIONS = ("dense", "pfc@1.0", "pfc@0.1")
COMPILED = "+compile"  # the suffix of an implementation run with compile_margin_softmax=True
COMPILE_WARM_UP_ROWS = 4  # per view, in the forward that compiles (the same widths as the measured steps)
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

    def __init__(self, num_classes: int, margin: CombinedMarginLoss, dim: int = DIM):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (num_classes, dim)))
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


def build_head(implementation: str, num_classes: int, device: torch.device, batch: int, dim: int):
    """(head, views, labels) of one implementation: "dense", "pfc@RATE", "pfc@RATE+compile", "pfc@RATE:FAMILY"."""
    implementation, _, family = implementation.partition(":")  # "pfc@RATE:FAMILY" times a margin family
    margin, k = family_margin(family or "combined")
    if implementation == "dense":
        head = DenseReference(num_classes, margin, dim)
    else:
        rate = float(implementation.removesuffix(COMPILED).split("@")[1])
        head = PartialFC(margin, dim, num_classes, sample_rate=rate, num_subcenters=k,
                         compile_margin_softmax=implementation.endswith(COMPILED))
    views = [torch.randn(batch, dim, device=device, requires_grad=True) for _ in range(VIEWS)]
    return head.to(device), views, torch.randint(0, num_classes, (batch,), device=device)


def half_precision(device: torch.device, fp16: bool) -> bool:
    """Whether a row runs under float16 autocast: --fp16 on a GPU (a CPU has no fast float16 kernels)."""
    return fp16 and device.type == "cuda"


def head_step(head, views, labels, device: torch.device, fp16: bool) -> None:
    head.weight.grad = None
    with torch.autocast(device.type, dtype=torch.float16, enabled=half_precision(device, fp16)):
        loss, _ = head(views, labels)
    loss.backward()


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters  # noqa: PLC0415 (dynamo's import: only where something compiles)

    return counters["stats"]["unique_graphs"]


def measure(implementation: str, num_classes: int, device: torch.device, steps: int, fp16: bool, batch: int = BATCH,
            dim: int = DIM) -> dict:
    torch.manual_seed(0)
    head, views, labels = build_head(implementation, num_classes, device, batch, dim)
    compile_seconds = None
    if implementation.endswith(COMPILED):
        # Every pass runs in the forward: one without gradients over a few rows compiles them all, its memory too
        # small to hide the measured step's peak (a CPU keeps freed pages resident).
        rows = COMPILE_WARM_UP_ROWS

        def forward_of_a_few_rows():
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.float16,
                                                 enabled=half_precision(device, fp16)):
                head([view[:rows] for view in views], labels[:rows])
        compile_seconds = seconds(forward_of_a_few_rows, device)
        compiled = graphs_compiled()

    def step():
        head_step(head, views, labels, device, fp16)

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
    if compile_seconds is not None and graphs_compiled() != compiled:
        raise RuntimeError(f"{implementation} at C={num_classes} compiled again after its warm-up on "
                           f"{COMPILE_WARM_UP_ROWS} rows per view: its compile seconds would be in its step time")
    mean_seconds = sum(times) / len(times)
    implementation = implementation.partition(":")[0].removesuffix(COMPILED)
    rate = 1.0 if implementation == "dense" else min(1.0, float(implementation.split("@")[1]))
    sampled = num_classes if rate >= 1 else int(rate * num_classes)
    half = half_precision(device, fp16)
    gemm = gemm_rate(device, torch.float16 if half else torch.float32)
    floor = pfc_floor(batch * VIEWS, dim, num_classes, sampled, logit_bytes=2 if half else 4, update=False,
                      gemm=gemm, bandwidth=copy_bandwidth(device))
    return dict(seconds=mean_seconds, peak_above=peak_above, tflops=floor.gemm_flop / mean_seconds / 1e12,
                floor=floor.seconds, compile=compile_seconds)


def table_row(num_classes: int, implementation: str, result: dict, dense: dict) -> str:
    """One line of the table (gpu_acceptance/gpu_check.py parses it): time and peak above the weights, each also as a
    ratio to the dense reference's, the time's floor, and the compile seconds of a compiled row."""
    compile_seconds = "-" if result.get("compile") is None else f"{result['compile']:.1f}"
    return (f"{num_classes:>9} {implementation:>15} {result['seconds'] * 1e3:>10.1f} "
            f"{result['seconds'] / dense['seconds']:>7.2f} {result['peak_above'] / 2**20:>12.1f} "
            f"{result['peak_above'] / max(dense['peak_above'], 1):>9.2f} {result['tflops']:>8.3f} "
            f"{result['floor'] * 1e3:>9.1f} {result['seconds'] / result['floor']:>7.2f}x {compile_seconds:>9}")


def run_in_subprocess(implementation: str, num_classes: int, args) -> dict:
    command = [sys.executable, "-m", "bench.bench_pfc", "--worker", implementation, str(num_classes),
               "--device", args.device, "--threads", str(args.threads), "--rounds", str(args.rounds),
               "--batch", str(args.batch), "--dim", str(args.dim)]
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
                        "--step: interleaved rounds per cell; with --compile: interleaved processes per row, the "
                        "fastest kept")
    parser.add_argument("--compile", action="store_true", help="PartialFC's rows also with compile_margin_softmax "
                        "(its compile seconds in a column of their own)")
    parser.add_argument("--batch", type=int, default=BATCH, help="records per step (each of 2 views); the table's")
    parser.add_argument("--dim", type=int, default=DIM, help="embedding size; the table's")
    parser.add_argument("--step", action="store_true", help="forward, backward and SGD of the centres, against the "
                        "floor and arcface_torch's PartialFC_V2 + SGD, at sample rates 1.0 and 0.1, with a profile")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "C"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "pairface-bench-inductor"))

    if args.worker:
        implementation, num_classes = args.worker[0], int(args.worker[1])
        if implementation.startswith("step@"):
            pfc_step.worker(num_classes, float(implementation.split("@")[1]), args)
            return
        steps = 5 if num_classes <= 100_000 else 2
        print(json.dumps(measure(implementation, num_classes, device, steps, args.fp16, args.batch, args.dim)))
        return

    if args.families:
        compare_families(args)
        return
    if args.step:
        pfc_step.print_table({(num_classes, rate): run_in_subprocess(f"step@{rate}", num_classes, args)
                              for num_classes in args.classes for rate in FAMILY_RATES}, args)
        return
    rounds = args.rounds if args.compile else 1
    print(f"PartialFC vs dense reference: batch {args.batch} x {VIEWS} views, D={args.dim}, world 1, {device.type}, "
          f"{args.threads} threads{', fp16' if args.fp16 else ''}. "
          + ("One fresh process per row." if rounds == 1 else f"Each row the fastest of {rounds} fresh processes, "
             "interleaved."))
    if device.type == "cpu":
        print("CPU note: this machine's 2 cores may be shared; GPU figures need `--device cuda --fp16` "
              "on a GPU (bash gpu_acceptance/gpu_throughput.sh pfc).")
    implementations = IMPLEMENTATIONS
    if args.compile:
        implementations += tuple(impl + COMPILED for impl in IMPLEMENTATIONS if impl != "dense")
        print(f"compile cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']}"
              + ("; compiled here, the passes are inductor's C++ loops: their ranking here says nothing about a GPU's "
                 "Triton kernels" if device.type == "cpu" else ""))
    header = (f"{'classes':>9} {'impl':>15} {'ms/step':>10} {'x time':>7} {'MiB above W':>12} {'x memory':>9} "
              f"{'TFLOP/s':>8} {'floor ms':>9} {'x floor':>8} {'compile s':>9}")
    print(header)
    print("-" * len(header))
    for num_classes in args.classes:
        results = {}
        for _ in range(rounds):
            for impl in implementations:
                result = run_in_subprocess(impl, num_classes, args)
                if impl not in results or result["seconds"] < results[impl]["seconds"]:
                    results[impl] = result
        dense = results["dense"]
        for impl, r in results.items():
            print(table_row(num_classes, impl, r, dense))
        sys.stdout.flush()


def compare_families(args) -> None:
    print(f"PartialFC per margin family, time / the combined family's (ArcFace): batch {args.batch} x {VIEWS} views, "
          f"D={args.dim}, world 1, {args.device}, {args.threads} threads{', fp16' if args.fp16 else ''}; sub-center "
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
