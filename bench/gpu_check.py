"""The device check: what only a GPU can show, a table printed row by row as each check finishes
(bench/gpu_check.sh, which first makes the machine ready: bench/gpu_wheels.py). Every check runs in
processes of its own under its own time budget (BUDGETS, seconds on one H200); one that overruns
prints FAILED and the next one starts. Under `--limit` (the whole check's seconds, more than the
budgets' sum) a check that could no longer finish within its budget is not started: its rows print
"not run (time)". The exit status is 1 when any row failed or did not run, and the last line names them.
It stops in its first seconds, with the reason, when CUDA cannot be used.

Rows:
- check_pfc: tools/check_pfc.py through NCCL (world 1) on CUDA, float64 against the dense reference,
  all centres and 10% sampled: PASS/FAIL and the worst relative error.
- data: JPEG records of synthetic faces, two views and one view per record, made on the spot, each set
  with at least as many records as the training rows read (one epoch: no epoch restart falls inside
  the steps they measure).
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
  at sample_rate 0 (fresh labels every step: the sampled columns change every step).
- PartialFC fp16 / bf16: bench.pfc_precision, loss, dX and dW relative to float32.
- decode and overlap: bench.decode_overlap, GPU decoding time per batch and how much of it the step hides.
- bench_pfc: PartialFC fp16 at 1M and 4M classes, sample rate 1.0 and 0.1: ms per step and peak memory
  as ratios to a dense nn.Linear + margin + cross-entropy where that fits.
- pfc step: bench_pfc --step at 1M classes, sample rate 1.0 and 0.1: the centre step with its SGD update
  against its floor (the three GEMMs and torch's fused SGD pass over every centre) and against arcface_torch's
  PartialFC_V2 + SGD, and where the sampled step's CUDA time goes (torch.profiler), largest first.
- memory plan: the --dry-run memory plan of r50 and of vit_b (checkpointed) at 128 x 2 views in fp16
  against a real step (bench/step_memory.py): the total planned / the peak allocated, and plan/peak per item.
- gpu decode vs cpu decode: GPU-decoded batches against CPU-decoded ones (tests/test_loader.py's GPU tests).

`--tiny` runs every row on the CPU with tiny shapes and four times the budgets: a rehearsal of this
script, not a measurement. `--only CHECK ...` runs those checks alone (the others print "not run (not
selected)"). PAIRFACE_GPU_CHECK_FAIL=CHECK plants a failure: that check's commands are replaced by one
that exits 1, so its rows take the path a real failure takes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.gpu_ready import cuda_problem
from bench.step_memory import ratios
from tests.run_helpers import CONFIG, arguments

ROOT = Path(__file__).resolve().parent.parent
SPEED = re.compile(r"Speed ([\d.]+) samples/sec ([\d.]+) images/sec   Loss ([\d.]+)")
PEAK = re.compile(r"peak GPU memory ([\d.]+) GiB")
STEPS_PER_EPOCH = re.compile(r"(\d+) steps per epoch")
BUDGETS = {"check_pfc": 45, "data": 30, "train 2 views": 40, "train 1 view": 30, "train dali": 40,
           "torchrun resume": 50, "host syncs": 20, "memory growth": 30, "pfc precision": 15, "decode": 20,
           "bench_pfc": 40, "pfc step": 20, "memory plan": 40, "gpu decode": 30}  # 450 s in all on one H200
LIMIT_SLACK = 15  # seconds of --limit beyond the budgets: between checks, and stopping one that overran
STOP_GRACE = 5  # seconds a command stopped at its budget's end has to exit, after SIGTERM and after SIGKILL
TINY_SLACK = 4  # a loaded CPU is slower than an H200
PLANT = "PAIRFACE_GPU_CHECK_FAIL"
PLANTED = [sys.executable, "-c", f"import sys; sys.exit('a failure planted by {PLANT}')"]
NAME_WIDTH = 44
PHOTOS_PER_IDENTITY = 8
Row = tuple[str, str, bool]  # (name, result, passed)
Rows = Iterator[Row]


def budget_scale(tiny: bool) -> int:
    return TINY_SLACK if tiny else 1


def default_limit(tiny: bool) -> float:
    """The whole check's seconds: every budget, and some slack between checks."""
    return (sum(BUDGETS.values()) + LIMIT_SLACK) * budget_scale(tiny)


class Runner:
    """Runs commands from the repository root, each within what is left of its check's budget."""

    def __init__(self, tiny: bool, planted: str | None = None) -> None:
        self.tiny, self.planted = tiny, planted
        self.check, self.deadline = "", 0.0

    def budget(self, check: str) -> None:
        self.check = check
        self.deadline = time.monotonic() + BUDGETS[check] * budget_scale(self.tiny)

    def _command(self, command: list[str]) -> list[str]:
        return PLANTED if self.check == self.planted else command

    def timed_out(self) -> tuple[int, str]:
        seconds = BUDGETS[self.check] * budget_scale(self.tiny)
        return 124, f"timed out (the {seconds} s budget of {self.check} was spent)"

    def sh(self, command: list[str]) -> tuple[int, str]:
        if self.deadline - time.monotonic() <= 0:
            return self.timed_out()
        return self.finish(self.start(command))

    def start(self, command: list[str]) -> subprocess.Popen:
        # A session of its own: a command that overruns is stopped with every process it started
        # (torchrun's workers would otherwise hold the GPU, and the output pipe, into the next check).
        return subprocess.Popen(self._command(command), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def finish(self, process: subprocess.Popen) -> tuple[int, str]:
        try:
            out, _ = process.communicate(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            stop(process)
            return self.timed_out()
        return process.returncode, out


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to a command's session, which torchrun hands to its workers (they run in sessions of their
    own), then SIGKILL; given up after that (a process that holds the output pipe cannot stall the check)."""
    for sent, grace in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, STOP_GRACE)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sent)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.communicate(timeout=grace)
            return


def last_line(text: str) -> str:
    """The last line that says something (torchrun closes its report with a rule of '=')."""
    lines = [line.strip() for line in text.splitlines() if re.search(r"\w", line)]
    return lines[-1] if lines else "no output"


def failed(name: str, status: int, out: str) -> Row:
    reason = last_line(out) if status != 124 else out
    return name, f"FAILED (exit {status}): {reason}", False


def check_pfc(run: Runner) -> Rows:
    run.budget("check_pfc")
    for rate in ("1.0", "0.1"):
        name = f"check_pfc sample_rate {rate}"
        classes = "1001" if run.tiny else "100003"
        status, out = run.sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                              "-m", "tools.check_pfc", "--views", "2", "--classes", classes, "--sample-rate", rate])
        verdict = re.search(r"(PASS|FAIL): worst (\S+)", out)
        if status or not verdict:
            yield failed(name, status, out)
        else:
            yield name, f"{verdict[1]} (worst relative error {verdict[2]})", verdict[1] == "PASS"


def training_shape(tiny: bool) -> tuple[int, int]:
    """(records per step, steps) of the training rows."""
    return (4, 6) if tiny else (128, 100)


def identities_for(tiny: bool, views: int) -> int:
    """Identities whose records fill every step of a training row within one epoch: the measured
    windows of the two-view and one-view rows then hold no epoch restart (a restart starts the data
    workers anew, which would slow one row and not the other)."""
    batch, steps = training_shape(tiny)
    records_per_identity = PHOTOS_PER_IDENTITY // views
    return max(-(-batch * steps // records_per_identity), 40 if tiny else 0)


def make_data(run: Runner, work: Path) -> Rows:
    run.budget("data")
    start = time.monotonic()
    made = []
    for name, views in (("pairs", 2), ("single", 1)):
        identities = identities_for(run.tiny, views)
        status, out = run.sh([sys.executable, "-m", "tools.make_synthetic", "--output", str(work / name),
                              "--identities", str(identities), "--images-per-identity", str(PHOTOS_PER_IDENTITY),
                              "--views", str(views), "--val-identities", "10", "--val-pairs", "20",
                              "--workers", str(os.cpu_count() or 1), "--overwrite"])
        if status:
            yield failed(f"data, {views} view(s) per record", status, out)
            return
        made.append(f"{identities * PHOTOS_PER_IDENTITY // views} records of {views} view(s)")
    seconds = time.monotonic() - start
    yield "data", f"{' and '.join(made)}, {PHOTOS_PER_IDENTITY} photos per identity, {seconds:.0f} s", True


def train_row(run: Runner, check: str, name: str, data: Path, output: Path, *extra: str) -> Rows:
    run.budget(check)
    batch, steps = training_shape(run.tiny)
    network = (["network=r18", "network_kwargs={'width_mult': 0.125}", "embedding_size=64", "frequent=2",
                "num_workers=1", "fp16=False"] if run.tiny else
               ["network=r50", "network_kwargs={}", "embedding_size=512", "frequent=20", "num_workers=8", "fp16=True"])
    command = [sys.executable, "train.py", CONFIG]
    for item in [f"rec={data}", f"output={output}", *network, f"batch_size={batch}", f"max_steps={steps}",
                 "num_epoch=1000", "verbose=1000000", "save_all_states=False", "val_targets=()", *extra]:
        command += ["--set", item]
    start = time.monotonic()
    status, out = run.sh(command)
    if status:
        yield failed(name, status, out)
        return
    speeds = SPEED.findall(out)[-3:]  # the steady state: the first lines include start-up
    per_epoch = STEPS_PER_EPOCH.search(out)
    if not speeds or not per_epoch:
        yield name, f"FAILED: no speed line or no steps per epoch in the log: {last_line(out)}", False
        return
    if int(per_epoch[1]) < steps:
        yield name, f"FAILED: {per_epoch[1]} steps per epoch, fewer than the {steps} measured (an epoch restart " \
                    "falls inside them); make more records", False
        return
    samples = sum(float(s[0]) for s in speeds) / len(speeds)
    images = sum(float(s[1]) for s in speeds) / len(speeds)
    peak = PEAK.search(out)
    yield name, (f"{samples:.0f} samples/s, {images:.0f} images/s, peak {peak[1] if peak else '-'} GiB, "
                 f"final loss {speeds[-1][2]}, {time.monotonic() - start:.0f} s"), True


def torchrun_resume(run: Runner, data: Path, folder: Path) -> Rows:
    """6 + 6 steps resumed against 12 uninterrupted, under torchrun with one process: bitwise or not."""
    run.budget("torchrun resume")
    name = "torchrun resume (6+6 vs 12 steps)"
    settings = ["fp16=True", "sample_rate=0.1", "deterministic=True", "save_every_steps=3", "num_epoch=100"]

    def torchrun(output: Path, steps: int, resume: bool = False) -> subprocess.Popen:
        return run.start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          "train.py", *arguments(data, output, *settings, f"max_steps={steps}", resume=resume)])

    whole, first = torchrun(folder / "whole", 12), torchrun(folder / "split", 6)  # side by side
    outcomes = [run.finish(whole), run.finish(first)]
    if not any(status for status, _ in outcomes):
        outcomes.append(run.finish(torchrun(folder / "split", 12, resume=True)))
    if any(status for status, _ in outcomes):
        yield failed(name, *next(o for o in outcomes if o[0]))
        return
    script = ("import json, sys\nfrom pathlib import Path\nfrom tests.run_helpers import assert_same_run\n"
              "root = Path(sys.argv[1])\ninfo = json.loads((root / 'whole' / 'model.json').read_text())\n"
              "assert_same_run(root / 'split', root / 'whole', info)\nprint('bitwise equal')\n")
    status, out = run.sh([sys.executable, "-c", script, str(folder)])
    rng = "the CUDA RNG" if not run.tiny else "the CPU RNG (no CUDA here)"
    yield (name, f"bitwise equal, {rng} included", True) if status == 0 else (name, f"DIFFERS: {last_line(out)}",
                                                                            False)


def host_syncs(run: Runner) -> Rows:
    run.budget("host syncs")
    status, out = run.sh([sys.executable, "-m", "bench.host_syncs", *device_args(run), "--sample-rates", "1.0", "0.1",
                          "0"])
    lines = [line.split(maxsplit=3) for line in out.splitlines() if re.match(r"\s*[\d.]+\s+[\d.]+\s", line)]
    if status or not lines:
        yield failed("host syncs per step", status, out)
        return
    for rate, operations, cuda, where in lines:
        yield f"host syncs per step, sample_rate {rate}", f"{operations} counted, {cuda} from CUDA: {where}", True


def device_args(run: Runner) -> list[str]:
    return [] if run.tiny else ["--device", "cuda"]


def one_line(run: Runner, check: str, name: str, command: list[str]) -> Rows:
    """A check whose whole result is the last line its command prints."""
    run.budget(check)
    status, out = run.sh([sys.executable, *command])
    yield failed(name, status, out) if status else (name, last_line(out), True)


def pfc_precision(run: Runner) -> Rows:
    run.budget("pfc precision")
    status, out = run.sh([sys.executable, "-m", "bench.pfc_precision", *device_args(run),
                          "--classes", "1000" if run.tiny else "100000"])
    lines = [line.split(maxsplit=1) for line in out.splitlines() if re.match(r"\s*b?float16\s", line)]
    if status or not lines:
        yield failed("PartialFC vs float32", status, out)
        return
    for dtype, errors in lines:
        yield f"PartialFC {dtype} vs float32", errors, True


def pfc_step(run: Runner) -> Rows:
    run.budget("pfc step")
    command = ["-m", "bench.bench_pfc", "--step", "--rounds", "1" if run.tiny else "3", "--classes",
               "2000" if run.tiny else "1000000", *device_args(run)]
    status, out = run.sh([sys.executable, *command])
    cells = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+[\d.]+\s+[\d.]+\s", line)]
    shares = [line.split(maxsplit=2) for line in out.splitlines() if re.match(r"\s+[\d.]+%\s+\d+\s", line)]
    if status or not cells:
        yield failed("pfc step", status, out)
        return
    for classes, rate, ms, _, floor, _, arcface in cells:
        yield f"pfc step C={classes} rate {rate}", f"{ms} ms, {floor} the floor, {arcface} arcface_torch's", True
    yield "pfc step at rate 0.1: largest shares", ", ".join(f"{name} {share}" for share, _, name in shares[:4]), True


def bench_pfc(run: Runner) -> Rows:
    run.budget("bench_pfc")
    classes = ["10000"] if run.tiny else ["1000000", "4000000"]
    device = [] if run.tiny else ["--device", "cuda", "--fp16"]
    status, out = run.sh([sys.executable, "-m", "bench.bench_pfc", "--classes", *classes, *device])
    lines = [line for line in out.splitlines() if re.match(r"\s*\d+\s+(dense|pfc)", line)]
    if status or not lines:
        yield failed("bench_pfc", status, out)
        return
    for line in lines:
        yield f"bench_pfc {' '.join(line.split()[:2])}", " ".join(line.split()[2:]), True


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
        yield failed("memory plan", status, out)
        return
    names = ["tiny r18 on the CPU"] if run.tiny else list(MEMORY_PLAN_CASES)
    for name, result in zip(names, results, strict=True):
        yield f"memory plan {name}", ratios(result), True


def gpu_decode(run: Runner) -> Rows:
    name = "gpu decode vs cpu decode"
    if run.tiny:
        yield name, "skipped (needs a GPU)", True
        return
    run.budget("gpu decode")
    status, out = run.sh([sys.executable, "-m", "pytest", "-q", "tests/test_loader.py", "-k", "gpu", "-p",
                          "no:cacheprovider", "-p", "no:randomly"])
    yield failed(name, status, out) if status else (name, last_line(out), True)


def checks(run: Runner, work: Path) -> dict[str, Callable[[], Rows]]:
    """Every check by its budget's name, in the order they run (the data first: the training rows need it)."""
    pairs, single = work / "pairs", work / "single"
    memory = (["--batch-size", "8", "--warmup", "2", "--steps", "10"] if run.tiny else
              ["--device", "cuda", "--network", "r50", "--width-mult", "1", "--batch-size", "128", "--fp16",
               "--classes", "100000"])
    decode = ["--batch-size", "8", "--batches", "4"] if run.tiny else ["--device", "cuda", "--batch-size", "128",
                                                                       "--workers", "8"]
    return {
        "check_pfc": lambda: check_pfc(run),
        "data": lambda: make_data(run, work),
        "train 2 views": lambda: train_row(run, "train 2 views", "train 2 views", pairs, work / "two", "num_views=2"),
        "train 1 view": lambda: train_row(run, "train 1 view", "train 1 view", single, work / "one", "num_views=1"),
        "train dali": lambda: train_row(run, "train dali", "train 2 views, dali=True", pairs, work / "dali",
                                        "num_views=2", "dali=True"),
        "torchrun resume": lambda: torchrun_resume(run, pairs, work / "resume"),
        "host syncs": lambda: host_syncs(run),
        "memory growth": lambda: one_line(run, "memory growth", "memory growth",
                                          ["-m", "bench.memory_growth", *memory]),
        "pfc precision": lambda: pfc_precision(run),
        "decode": lambda: one_line(run, "decode", "gpu decode per batch, overlap with the step",
                                   ["-m", "bench.decode_overlap", "--rec", str(pairs), *decode]),
        "bench_pfc": lambda: bench_pfc(run),
        "pfc step": lambda: pfc_step(run),
        "memory plan": lambda: memory_plan(run),
        "gpu decode": lambda: gpu_decode(run),
    }


def print_row(name: str, result: str) -> None:
    print(f"{name:<{NAME_WIDTH}}  {result}", flush=True)


def run_checks(run: Runner, work: Path, limit: float, only: set[str]) -> list[str]:
    """Every check in order, its rows printed as they come; the names of the rows that failed or did not run."""
    end = time.monotonic() + limit
    bad = []
    for check, rows in checks(run, work).items():
        if only and check not in only:
            print_row(check, "not run (not selected)")
            continue
        if end - time.monotonic() < BUDGETS[check] * budget_scale(run.tiny):
            print_row(check, "not run (time)")
            bad.append(check)
            continue
        for name, result, passed in rows():
            print_row(name, result)
            if not passed:
                bad.append(name)
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal of this script (tiny shapes)")
    parser.add_argument("--only", nargs="+", choices=list(BUDGETS), default=[], metavar="CHECK",
                        help=f"run these checks alone, of: {', '.join(BUDGETS)}")
    parser.add_argument("--limit", type=float, help="seconds for the whole check (default: the budgets' sum and "
                                                    f"{LIMIT_SLACK} s, x{TINY_SLACK} with --tiny)")
    args = parser.parse_args(argv)
    if not args.tiny and (problem := cuda_problem()) is not None:
        print(f"CUDA cannot be used, so nothing here can be checked: {problem}", file=sys.stderr)
        return 1
    limit = args.limit if args.limit is not None else default_limit(args.tiny)
    where = f"x{TINY_SLACK} on this CPU" if args.tiny else "on one H200"
    print(f"device check, rows as they finish (budgets {sum(BUDGETS.values())} s {where}, limit {limit:.0f} s)")
    print_row("check", "result")
    planted = os.environ.get(PLANT) or None
    with tempfile.TemporaryDirectory() as tmp:
        bad = run_checks(Runner(args.tiny, planted), Path(tmp), limit, set(args.only))
    if bad:
        print(f"FAILED or not run: {'; '.join(bad)}", flush=True)
        return 1
    print("every row passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
