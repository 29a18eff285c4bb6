"""The device check: what only a GPU can show, a table printed row by row as each check finishes
(bench/gpu_check.sh). Every check runs in processes of its own under its own time budget (BUDGETS,
seconds on one H200, 510 in all): one that overruns prints "timed out" and the next one starts.
It stops in its first seconds, with the reason, when CUDA cannot be used.

Rows:
- check_pfc: tools/check_pfc.py through NCCL (world 1) on CUDA, float64 against the dense reference,
  all centres and 10% sampled: PASS/FAIL and the worst relative error.
- data: JPEG records of synthetic faces, two views and one view per record, made on the spot.
- train 2 views / 1 view: train.py, r50, fp16, 128 records per step, 100 steps, decoded by the data
  workers: samples/s and images/s of the last log lines, peak GPU memory, final loss. The two rows'
  ratio is the cost of the second view.
- train 2 views, dali: the same with `dali=True` (nvJPEG decoding on the GPU, on its own thread and stream).
- torchrun resume: torchrun with one process (NCCL world of 1: DDP's absence aside, the collectives,
  barriers and DCP shards of a multi-GPU run), fp16, sample_rate 0.1, deterministic, a checkpoint every
  3 steps: 6 + 6 steps resumed against 12 uninterrupted, compared tensor for tensor, the CUDA RNG included.
- host syncs per step: bench.host_syncs, the operations that make the host wait and what CUDA's sync
  debug mode reports, with their source lines, at sample_rate 1.0, 0.1 and 0.
- memory growth: bench.memory_growth, reserved GPU memory before and after 100 more steps of r50 fp16
  at sample_rate 0 (the sampled columns change every step).
- PartialFC fp16 / bf16: bench.pfc_precision, loss, dX and dW relative to float32.
- decode and overlap: bench.decode_overlap, GPU decoding time per batch and how much of it the step hides.
- bench_pfc: PartialFC fp16 at 1M and 4M classes, sample rate 1.0 and 0.1: ms per step and peak memory
  as ratios to a dense nn.Linear + margin + cross-entropy where that fits.
- memory plan: the --dry-run memory plan of r50 and of vit_b (checkpointed) at 128 x 2 views in fp16
  against a real step (bench/step_memory.py): the total planned / the peak allocated, and plan/peak per item.
- gpu decode vs cpu decode: GPU-decoded batches against CPU-decoded ones (tests/test_loader.py's GPU tests).

`--tiny` runs every row on the CPU with tiny shapes and four times the budgets: a smoke test of this
script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from bench.step_memory import ratios
from tests.run_helpers import CONFIG, FP16_ON_CPU, arguments
from utils.device import cuda_unavailable_reason

ROOT = Path(__file__).resolve().parent.parent
SPEED = re.compile(r"Speed ([\d.]+) samples/sec ([\d.]+) images/sec   Loss ([\d.]+)")
PEAK = re.compile(r"peak GPU memory ([\d.]+) GiB")
BUDGETS = {"check_pfc": 30, "data": 40, "train 2 views": 45, "train 1 view": 35, "train dali": 45,
           "torchrun resume": 75, "host syncs": 25, "memory growth": 30, "pfc precision": 15, "decode": 25,
           "bench_pfc": 40, "memory plan": 45, "gpu decode": 30}  # check_pfc runs twice: 510 s in all
TINY_SLACK = 4  # a loaded CPU is slower than an H200
NAME_WIDTH = 44
Rows = Iterator[tuple[str, str]]


def cuda_problem() -> str | None:
    """Why CUDA cannot run this check, or None: no usable driver, or a GPU that cannot run a kernel."""
    if not torch.cuda.is_available():
        return cuda_unavailable_reason()
    try:
        torch.ones(1, device="cuda").add_(1).item()
    except RuntimeError as error:
        return f"a first CUDA operation failed: {str(error).splitlines()[0]}"
    return None


class Runner:
    """Runs commands from the repository root, each within what is left of its check's budget."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.deadline = 0.0

    def budget(self, check: str) -> None:
        self.deadline = time.monotonic() + BUDGETS[check] * (TINY_SLACK if self.tiny else 1)

    def sh(self, command: list[str]) -> tuple[int, str]:
        left = self.deadline - time.monotonic()
        if left <= 0:
            return 124, "timed out (its check's budget was spent)"
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            return 124, "timed out (its check's budget was spent)"
        return done.returncode, done.stdout + done.stderr

    def start(self, command: list[str]) -> subprocess.Popen:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(self, process: subprocess.Popen) -> tuple[int, str]:
        try:
            out, _ = process.communicate(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            return 124, "timed out (its check's budget was spent)"
        return process.returncode, out


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def failed(status: int, out: str) -> str:
    return f"FAILED (exit {status}): {last_line(out)}"


def check_pfc(run: Runner) -> Rows:
    for rate in ("1.0", "0.1"):
        run.budget("check_pfc")
        classes = "1001" if run.tiny else "100003"
        status, out = run.sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                              "-m", "tools.check_pfc", "--views", "2", "--classes", classes, "--sample-rate", rate])
        verdict = re.search(r"(PASS|FAIL): worst (\S+)", out)
        yield (f"check_pfc sample_rate {rate}",
               f"{verdict[1]} (worst relative error {verdict[2]})" if verdict else failed(status, out))


def make_data(run: Runner, work: Path) -> Rows:
    run.budget("data")
    identities = "40" if run.tiny else "1000"
    start = time.monotonic()
    for name, views in (("pairs", "2"), ("single", "1")):
        status, out = run.sh([sys.executable, "-m", "tools.make_synthetic", "--output", str(work / name),
                              "--identities", identities, "--images-per-identity", "8", "--views", views,
                              "--val-identities", "10", "--val-pairs", "20", "--workers", str(os.cpu_count() or 1),
                              "--overwrite"])
        if status:
            yield f"data, {views} view(s) per record", failed(status, out)
            return
    yield "data", f"{identities} identities, 8 photos each, packed 2 and 1 per record, {time.monotonic() - start:.0f} s"


def train_row(run: Runner, check: str, name: str, data: Path, output: Path, *extra: str) -> Rows:
    run.budget(check)
    network = (["network=r18", "network_kwargs={'width_mult': 0.125}", "embedding_size=64", "batch_size=4",
                "max_steps=6", "frequent=2", "num_workers=1", "fp16=False"] if run.tiny else
               ["network=r50", "network_kwargs={}", "embedding_size=512", "batch_size=128", "max_steps=100",
                "frequent=20", "num_workers=8", "fp16=True"])
    command = [sys.executable, "train.py", CONFIG]
    for item in [f"rec={data}", f"output={output}", *network, "num_epoch=1000", "verbose=1000000",
                 "save_all_states=False", "val_targets=()", *extra]:
        command += ["--set", item]
    start = time.monotonic()
    status, out = run.sh(command)
    if status:
        yield name, failed(status, out)
        return
    speeds = SPEED.findall(out)[-3:]  # the steady state: the first lines include start-up
    if not speeds:
        yield name, f"no speed line in the log: {last_line(out)}"
        return
    samples = sum(float(s[0]) for s in speeds) / len(speeds)
    images = sum(float(s[1]) for s in speeds) / len(speeds)
    peak = PEAK.search(out)
    yield name, (f"{samples:.0f} samples/s, {images:.0f} images/s, peak {peak[1] if peak else '-'} GiB, "
                 f"final loss {speeds[-1][2]}, {time.monotonic() - start:.0f} s")


def torchrun_resume(run: Runner, data: Path, folder: Path) -> Rows:
    """6 + 6 steps resumed against 12 uninterrupted, under torchrun with one process: bitwise or not."""
    run.budget("torchrun resume")
    settings = [*FP16_ON_CPU, "sample_rate=0.1", "deterministic=True", "save_every_steps=3", "num_epoch=100"]

    def torchrun(output: Path, steps: int, resume: bool = False) -> subprocess.Popen:
        return run.start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          "train.py", *arguments(data, output, *settings, f"max_steps={steps}", resume=resume)])

    whole, first = torchrun(folder / "whole", 12), torchrun(folder / "split", 6)  # side by side
    outcomes = [run.finish(whole), run.finish(first)]
    if not any(status for status, _ in outcomes):
        outcomes.append(run.finish(torchrun(folder / "split", 12, resume=True)))
    if any(status for status, _ in outcomes):
        yield "torchrun resume (6+6 vs 12 steps)", failed(*next(o for o in outcomes if o[0]))
        return
    script = ("import json, sys\nfrom pathlib import Path\nfrom tests.run_helpers import assert_same_run\n"
              "root = Path(sys.argv[1])\ninfo = json.loads((root / 'whole' / 'model.json').read_text())\n"
              "assert_same_run(root / 'split', root / 'whole', info)\nprint('bitwise equal')\n")
    status, out = run.sh([sys.executable, "-c", script, str(folder)])
    rng = "the CUDA RNG" if not run.tiny else "the CPU RNG (no CUDA here)"
    yield "torchrun resume (6+6 vs 12 steps)", (f"bitwise equal, {rng} included" if status == 0
                                                 else f"DIFFERS: {last_line(out)}")


def host_syncs(run: Runner) -> Rows:
    run.budget("host syncs")
    status, out = run.sh([sys.executable, "-m", "bench.host_syncs", *device_args(run), "--sample-rates", "1.0", "0.1",
                          "0"])
    lines = [line.split(maxsplit=3) for line in out.splitlines() if re.match(r"\s*[\d.]+\s+[\d.]+\s", line)]
    if status or not lines:
        yield "host syncs per step", failed(status, out)
        return
    for rate, operations, cuda, where in lines:
        yield f"host syncs per step, sample_rate {rate}", f"{operations} counted, {cuda} from CUDA: {where}"


def device_args(run: Runner) -> list[str]:
    return [] if run.tiny else ["--device", "cuda"]


def one_line(run: Runner, check: str, name: str, command: list[str]) -> Rows:
    """A check whose whole result is the last line its command prints."""
    run.budget(check)
    status, out = run.sh([sys.executable, *command])
    yield name, failed(status, out) if status else last_line(out)


def pfc_precision(run: Runner) -> Rows:
    run.budget("pfc precision")
    status, out = run.sh([sys.executable, "-m", "bench.pfc_precision", *device_args(run),
                          "--classes", "1000" if run.tiny else "100000"])
    lines = [line.split(maxsplit=1) for line in out.splitlines() if re.match(r"\s*b?float16\s", line)]
    if status or not lines:
        yield "PartialFC vs float32", failed(status, out)
        return
    for dtype, errors in lines:
        yield f"PartialFC {dtype} vs float32", errors


def bench_pfc(run: Runner) -> Rows:
    run.budget("bench_pfc")
    classes = ["10000"] if run.tiny else ["1000000", "4000000"]
    device = [] if run.tiny else ["--device", "cuda", "--fp16"]
    status, out = run.sh([sys.executable, "-m", "bench.bench_pfc", "--classes", *classes, *device])
    lines = [line for line in out.splitlines() if re.match(r"\s*\d+\s+(dense|pfc)", line)]
    if status or not lines:
        yield "bench_pfc", failed(status, out)
        return
    for line in lines:
        yield f"bench_pfc {' '.join(line.split()[:2])}", " ".join(line.split()[2:])


# bench.step_memory's configurations: the memory plan of each against a real step (one process).
MEMORY_PLAN_CASES = {
    "r50 fp16, 128 x 2 views, 1M classes at 10%": "network=r50 fp16=True batch_size=128 num_classes=1000000 "
                                                  "sample_rate=0.1",
    "vit_b fp16 (checkpointed), 128 x 2 views, 100k classes": "network=vit_b fp16=True batch_size=128 "
                                                              "num_classes=100000",
}
TINY_MEMORY_PLAN = ["network=r18", "network_kwargs={'width_mult':0.0625}", "batch_size=2", "num_classes=1000"]


def memory_plan(run: Runner) -> Rows:
    """The --dry-run memory plan against what a real step allocates (bench/step_memory.py): the total and
    plan/peak per item, from the CUDA caching allocator's statistics."""
    run.budget("memory plan")
    command = [sys.executable, "-m", "bench.step_memory", "configs/synthetic_pair.py", "--json", *device_args(run)]
    for item in ["rec=synthetic", "embedding_size=512", "num_workers=0", "optimizer=sgd", "network_kwargs={}",
                 *(TINY_MEMORY_PLAN if run.tiny else [])]:
        command += ["--set", item]
    for case in ([] if run.tiny else MEMORY_PLAN_CASES.values()):
        command += ["--case", case]
    status, out = run.sh(command)
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if status or not results:
        yield "memory plan", failed(status, out)
        return
    names = ["tiny r18 on the CPU"] if run.tiny else list(MEMORY_PLAN_CASES)
    for name, result in zip(names, results, strict=True):
        yield f"memory plan {name}", ratios(result)


def gpu_decode(run: Runner) -> Rows:
    if run.tiny:
        yield "gpu decode vs cpu decode", "skipped (needs a GPU)"
        return
    run.budget("gpu decode")
    status, out = run.sh([sys.executable, "-m", "pytest", "-q", "tests/test_loader.py", "-k", "gpu", "-p",
                          "no:cacheprovider", "-p", "no:randomly"])
    yield "gpu decode vs cpu decode", last_line(out) if out.strip() else f"exit {status}"


def checks(run: Runner, work: Path) -> list[Callable[[], Rows]]:
    """Every check, in the order they run (the data first: the training rows need it)."""
    pairs, single = work / "pairs", work / "single"
    memory = (["--batch-size", "8", "--warmup", "2", "--steps", "10"] if run.tiny else
              ["--device", "cuda", "--network", "r50", "--width-mult", "1", "--batch-size", "128", "--fp16",
               "--classes", "100000"])
    decode = ["--batch-size", "8", "--batches", "4"] if run.tiny else ["--device", "cuda", "--batch-size", "128",
                                                                       "--workers", "8"]
    return [
        lambda: check_pfc(run),
        lambda: make_data(run, work),
        lambda: train_row(run, "train 2 views", "train 2 views", pairs, work / "two", "num_views=2"),
        lambda: train_row(run, "train 1 view", "train 1 view", single, work / "one", "num_views=1"),
        lambda: train_row(run, "train dali", "train 2 views, dali=True", pairs, work / "dali", "num_views=2",
                          "dali=True"),
        lambda: torchrun_resume(run, pairs, work / "resume"),
        lambda: host_syncs(run),
        lambda: one_line(run, "memory growth", "memory growth",
                         ["-m", "bench.memory_growth", *memory]),
        lambda: pfc_precision(run),
        lambda: one_line(run, "decode", "gpu decode per batch, overlap with the step",
                         ["-m", "bench.decode_overlap", "--rec", str(pairs), *decode]),
        lambda: bench_pfc(run),
        lambda: memory_plan(run),
        lambda: gpu_decode(run),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test of this script (tiny shapes)")
    args = parser.parse_args(argv)
    if not args.tiny and (problem := cuda_problem()) is not None:
        print(f"CUDA cannot be used, so nothing here can be checked: {problem}", file=sys.stderr)
        return 1
    total = sum(BUDGETS.values()) + BUDGETS["check_pfc"]
    print(f"device check, rows as they finish (budgets {total} s on one H200{', x4 on this CPU' * args.tiny})")
    print(f"{'check':<{NAME_WIDTH}}  result", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = Runner(args.tiny)
        for check in checks(run, Path(tmp)):
            for name, result in check():
                print(f"{name:<{NAME_WIDTH}}  {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
