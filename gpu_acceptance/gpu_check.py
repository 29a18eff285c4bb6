"""The device check: what only a GPU can show, a table printed row by row as each check finishes
(gpu_acceptance/gpu_check.sh, which first makes the machine ready: provision/gpu_wheels.py). Every check runs in
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
- train 2 views / 1 view: train.py, r50, fp16, 128 records per step, 60 steps, decoded by the data
  workers: samples/s and images/s of the last log lines, peak GPU memory, final loss. The two rows'
  ratio is the cost of the second view.
- train 2 views, dali: the same with `dali=True` (nvJPEG decoding on the GPU, on its own thread and stream).
- torchrun resume: torchrun with one process (NCCL world of 1: DDP's absence aside, the collectives,
  barriers and DCP shards of a multi-GPU run), the tests' tiny network, fp16, sample_rate 0.1,
  deterministic, a checkpoint every 4 steps: 4 + 4 steps resumed against 8 uninterrupted, compared tensor
  for tensor, the CUDA RNG included: "bitwise equal" or the first tensor that differs, and the seconds of
  each phase.
- host syncs per step: bench.host_syncs, the operations that make the host wait and what CUDA's sync
  debug mode reports, with their source lines, at sample_rate 1.0, 0.1 and 0.
- memory growth: bench.memory_growth, reserved GPU memory before and after 100 more steps of r50 fp16
  at sample_rate 0 (fresh labels every step: the sampled columns change every step).
- PartialFC fp16 / bf16: bench.pfc_precision, loss, dX and dW relative to float32.
- decode and overlap: bench.decode_overlap, GPU decoding time per batch and how much of it the step hides.
- bench_pfc: PartialFC fp16 at 1M and 4M classes, sample rate 1.0 and 0.1: ms per step and peak memory
  as ratios to a dense nn.Linear + margin + cross-entropy where that fits.
- pfc step: bench_pfc --step at 1M classes, fp16, sample rate 1.0 and 0.1: the centre step with its SGD update
  against its floor (the three GEMMs at the measured GEMM rate, the logits' and centres' passes at the measured
  copy bandwidth), against torch's own kernels for them run bare, and against arcface_torch's
  PartialFC_V2 + SGD, and where the sampled step's CUDA time goes (torch.profiler), largest first.
- memory plan: the --dry-run memory plan of r50 and of vit_b (checkpointed) at 128 x 2 views in fp16
  against a real step (tools/step_memory.py): the total planned / the peak allocated, and plan/peak per item.
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

from gpu_acceptance.gpu_ready import cuda_problem
from gpu_acceptance.runs import CONFIG, arguments
from tools.step_memory import ratios

ROOT = Path(__file__).resolve().parent.parent
SPEED = re.compile(r"Speed ([\d.]+) samples/sec ([\d.]+) images/sec   Loss ([\d.]+)")
PEAK = re.compile(r"peak GPU memory ([\d.]+) GiB")
STEPS_PER_EPOCH = re.compile(r"(\d+) steps per epoch")
# 425 s in all on one H200 (ROWS_SECONDS at most), 440 s with the limit's slack, inside the script's 470 s: of
# the 15 minutes a session may hold the GPU machine, that leaves the machine's start (minutes) and a rerun of
# one check. The first H200 run (docs/gpu.md) took 24 s for 12,800 + 12,800 records; the resume row had 50 s
# and did not finish, so it has 70 s now. To fit, the training rows run 60 steps instead of 100 (the speed
# still the mean of three log lines after start-up) and need 40% fewer records. Each budget is an estimate
# until a run on a GPU prints every check's seconds against it (the last line but one) to set it from.
BUDGETS = {"check_pfc": 40, "data": 20, "train 2 views": 30, "train 1 view": 25, "train dali": 35,
           "torchrun resume": 70, "host syncs": 20, "memory growth": 20, "pfc precision": 15, "decode": 20,
           "bench_pfc": 40, "pfc step": 20, "memory plan": 40, "gpu decode": 30}
ROWS_SECONDS = 430  # the most the budgets may add up to (tests/test_gpu_check.py)
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


class NothingToParse(ValueError):
    """A command that succeeded printed no line its row's parser knows: its output format changed, so the
    row has no result (never a pass)."""


def parsed(name: str, status: int, out: str, parse: Callable[[str], list[Row]]) -> Rows:
    """The rows `parse` reads from a command's output; one FAILED row when the command failed, when the
    output holds nothing the parser recognises (it names what it looked for and the output's last line), or
    when a line it recognises has another shape than it reads (a table that gained a column): the checks
    after it still run."""
    if status:
        yield failed(name, status, out)
        return
    try:
        yield from parse(out)
    except NothingToParse as missing:
        yield name, f"FAILED: found nothing to parse: no {missing} in the output (last line: {last_line(out)})", False
    except (ValueError, IndexError) as error:
        yield name, f"FAILED: could not read its output: {error} (last line: {last_line(out)})", False


def matches(pattern: str, out: str, what: str) -> list[re.Match]:
    found = [match for line in out.splitlines() if (match := re.match(pattern, line))]
    if not found:
        raise NothingToParse(what)
    return found


def parse_check_pfc(rate: str) -> Callable[[str], list[Row]]:
    def parse(out: str) -> list[Row]:
        verdict = matches(r"(PASS|FAIL): worst (\S+)", out, "'PASS: worst ...' or 'FAIL: worst ...' line")[-1]
        return [(f"check_pfc sample_rate {rate}", f"{verdict[1]} (worst relative error {verdict[2]})",
                 verdict[1] == "PASS")]
    return parse


def check_pfc(run: Runner) -> Rows:
    run.budget("check_pfc")
    for rate in ("1.0", "0.1"):
        name = f"check_pfc sample_rate {rate}"
        classes = "1001" if run.tiny else "100003"
        status, out = run.sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                              "-m", "tools.check_pfc", "--views", "2", "--classes", classes, "--sample-rate", rate])
        yield from parsed(name, status, out, parse_check_pfc(rate))


def training_shape(tiny: bool) -> tuple[int, int, int]:
    """(records per step, steps, steps between log lines) of the training rows: the speed is the mean of the
    last three log lines, the steps after the first line's start-up."""
    return (4, 6, 2) if tiny else (128, 60, 10)


def identities_for(tiny: bool, views: int) -> int:
    """Identities whose records fill every step of a training row within one epoch: the measured
    windows of the two-view and one-view rows then hold no epoch restart (a restart starts the data
    workers anew, which would slow one row and not the other)."""
    batch, steps, _ = training_shape(tiny)
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
    batch, steps, every = training_shape(run.tiny)
    network = (["network=r18", "network_kwargs={'width_mult': 0.125}", "embedding_size=64", "num_workers=1",
                "fp16=False"] if run.tiny else
               ["network=r50", "network_kwargs={}", "embedding_size=512", "num_workers=8", "fp16=True"])
    command = [sys.executable, "train.py", CONFIG]
    for item in [f"rec={data}", f"output={output}", *network, f"frequent={every}", f"batch_size={batch}",
                 f"max_steps={steps}",
                 "num_epoch=1000", "verbose=1000000", "save_all_states=False", "val_targets=()", *extra]:
        command += ["--set", item]
    start = time.monotonic()
    status, out = run.sh(command)
    yield from parsed(name, status, out, parse_train(name, steps, start))


def parse_train(name: str, steps: int, start: float) -> Callable[[str], list[Row]]:
    """train.py's log: the mean speed of its last three log lines (the first ones include start-up), the peak
    GPU memory (absent on the CPU), the final loss, and the seconds since `start`."""
    def parse(out: str) -> list[Row]:
        speeds = [match.groups() for match in matches(rf".*?{SPEED.pattern}", out, "'Speed ... samples/sec' log line")]
        per_epoch = matches(rf".*?{STEPS_PER_EPOCH.pattern}", out, "'... steps per epoch' log line")[0]
        if int(per_epoch[1]) < steps:
            return [(name, f"FAILED: {per_epoch[1]} steps per epoch, fewer than the {steps} measured (an epoch "
                           "restart falls inside them); make more records", False)]
        last = speeds[-3:]
        samples = sum(float(s[0]) for s in last) / len(last)
        images = sum(float(s[1]) for s in last) / len(last)
        peak = PEAK.search(out)
        return [(name, f"{samples:.0f} samples/s, {images:.0f} images/s, peak {peak[1] if peak else '-'} GiB, "
                       f"final loss {last[-1][2]}, {time.monotonic() - start:.0f} s", True)]
    return parse


RESUME_STEPS = 4  # steps before the stop and after it; the one checkpoint between them is at this step
RESUME_VERDICT = ("import json, sys\nfrom pathlib import Path\nfrom gpu_acceptance.runs import run_difference\n"
                  "root = Path(sys.argv[1])\ninfo = json.loads((root / 'whole' / 'model.json').read_text())\n"
                  "difference = run_difference(root / 'split', root / 'whole', info)\n"
                  "print('bitwise equal' if difference is None else f'first difference: {difference}')\n")


def torchrun_resume(run: Runner, data: Path, folder: Path) -> Rows:
    """4 + 4 steps resumed against 8 uninterrupted, under torchrun with one process: bitwise, or the first
    tensor that differs. The tiny network of the tests (gpu_acceptance/runs.py's QUIET) keeps the three runs to
    their start-up (torchrun, CUDA, NCCL) and two DCP saves each: the first H200 run spent the 50 s budget on
    three 12-step runs that saved every 3 steps. The seconds of each phase are printed, for the next budget."""
    run.budget("torchrun resume")
    name = f"torchrun resume ({RESUME_STEPS}+{RESUME_STEPS} vs {2 * RESUME_STEPS} steps)"
    settings = ["fp16=True", "sample_rate=0.1", "deterministic=True", f"save_every_steps={RESUME_STEPS}",
                "num_epoch=100"]

    def torchrun(output: Path, steps: int, resume: bool = False) -> subprocess.Popen:
        return run.start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          "train.py", *arguments(data, output, *settings, f"max_steps={steps}", resume=resume)])

    start = time.monotonic()
    whole, first = torchrun(folder / "whole", 2 * RESUME_STEPS), torchrun(folder / "split", RESUME_STEPS)
    outcomes = [run.finish(whole), run.finish(first)]  # side by side
    side_by_side = time.monotonic()
    if not any(status for status, _ in outcomes):
        outcomes.append(run.finish(torchrun(folder / "split", 2 * RESUME_STEPS, resume=True)))
    resumed = time.monotonic()
    if any(status for status, _ in outcomes):
        yield failed(name, *next(o for o in outcomes if o[0]))
        return
    status, out = run.sh([sys.executable, "-c", RESUME_VERDICT, str(folder)])
    seconds = (f"{side_by_side - start:.0f} s side by side, {resumed - side_by_side:.0f} s resumed, "
               f"{time.monotonic() - resumed:.0f} s compared")
    yield from parsed(name, status, out, parse_resume(name, "the CPU RNG (no CUDA here)" if run.tiny else
                                                      "the CUDA RNG", seconds))


def parse_resume(name: str, rng: str, seconds: str) -> Callable[[str], list[Row]]:
    def parse(out: str) -> list[Row]:
        verdict = matches(r"(bitwise equal|first difference: .*)", out, "'bitwise equal' or 'first difference' line")
        equal = verdict[-1][0] == "bitwise equal"
        return [(name, f"bitwise equal, {rng} included ({seconds})" if equal else
                 f"DIFFERS, {verdict[-1][0]} ({seconds})", equal)]
    return parse


def host_syncs(run: Runner) -> Rows:
    run.budget("host syncs")
    status, out = run.sh([sys.executable, "-m", "bench.host_syncs", *device_args(run), "--sample-rates", "1.0", "0.1",
                          "0"])
    yield from parsed("host syncs per step", status, out, parse_host_syncs)


def parse_host_syncs(out: str) -> list[Row]:
    lines = [match[0].split(maxsplit=3) for match in matches(r"\s*[\d.]+\s+[\d.]+\s+\S+\s+.*", out,
                                                             "'sample_rate ops/step cuda/step where' table row")]
    return [(f"host syncs per step, sample_rate {rate}", f"{operations} counted, {cuda} from CUDA: {where}", True)
            for rate, operations, cuda, where in lines]


def device_args(run: Runner) -> list[str]:
    return [] if run.tiny else ["--device", "cuda"]


def one_line(run: Runner, check: str, name: str, command: list[str], pattern: str, what: str) -> Rows:
    """A check whose whole result is the last line its command prints that matches `pattern`."""
    run.budget(check)
    status, out = run.sh([sys.executable, *command])
    yield from parsed(name, status, out, parse_one_line(name, pattern, what))


def parse_one_line(name: str, pattern: str, what: str) -> Callable[[str], list[Row]]:
    return lambda out: [(name, matches(pattern, out, what)[-1][0].strip(), True)]


# The one-line checks' result lines (bench/memory_growth.py's and bench/decode_overlap.py's last print).
MEMORY_GROWTH_LINE = r"(reserved|resident) \d+ MiB after \d+ steps, \d+ MiB after \d+ more: .*"
DECODE_LINE = r"decode [\d.]+ ms/batch of .* step [\d.]+ ms, loop [\d.]+ ms/batch: .*"
PYTEST_LINE = r"=* ?\d+ (passed|skipped).*"


def pfc_precision(run: Runner) -> Rows:
    run.budget("pfc precision")
    status, out = run.sh([sys.executable, "-m", "bench.pfc_precision", *device_args(run),
                          "--classes", "1000" if run.tiny else "100000"])
    yield from parsed("PartialFC vs float32", status, out, parse_pfc_precision)


def parse_pfc_precision(out: str) -> list[Row]:
    """bench.pfc_precision's lines, one per margin family and dtype: 'family dtype  loss e  dX e  dW e'."""
    lines = matches(r"\s*(\w+)\s+(b?float16)\s+(loss \S+\s+dX \S+\s+dW \S+)", out,
                    "'FAMILY float16|bfloat16  loss .. dX .. dW ..' line")
    return [(f"PartialFC {family} {dtype} vs float32", errors, True) for family, dtype, errors in
            (line.groups() for line in lines)]


def pfc_step(run: Runner) -> Rows:
    run.budget("pfc step")
    command = ["-m", "bench.bench_pfc", "--step", "--rounds", "1" if run.tiny else "3", "--classes",
               "2000" if run.tiny else "1000000", *device_args(run), *([] if run.tiny else ["--fp16"])]
    status, out = run.sh([sys.executable, *command])
    yield from parsed("pfc step", status, out, parse_pfc_step)


def parse_pfc_step(out: str) -> list[Row]:
    """bench_pfc --step: a row per (classes, rate) cell, then the profile's largest shares."""
    cells = [match[0].split() for match in matches(r"\s*\d+\s+[\d.]+\s+[\d.]+\s.*", out,
                                                   "'CLASSES RATE MS ...' table row")]
    shares = [line.split(maxsplit=2) for line in out.splitlines() if re.match(r"\s+[\d.]+%\s+\d+\s", line)]
    rows = [(f"pfc step C={classes} rate {rate}", f"{ms} ms, {floor} its floor ({floor_ms} ms), {bare} torch's "
             f"bare kernels, {arcface} arcface_torch's", True)
            for classes, rate, ms, floor_ms, floor, _, bare, _, arcface in cells]
    largest = ("pfc step at rate 0.1: largest shares", ", ".join(f"{name} {share}" for share, _, name in shares[:4]),
               True) if shares else ("pfc step at rate 0.1: largest shares", "FAILED: found nothing to parse: no "
                                     "'SHARE% CALLS OPERATOR' profile line in the output", False)
    return [*rows, largest]


def bench_pfc(run: Runner) -> Rows:
    run.budget("bench_pfc")
    classes = ["10000"] if run.tiny else ["1000000", "4000000"]
    device = [] if run.tiny else ["--device", "cuda", "--fp16"]
    status, out = run.sh([sys.executable, "-m", "bench.bench_pfc", "--classes", *classes, *device])
    yield from parsed("bench_pfc", status, out, parse_bench_pfc)


def parse_bench_pfc(out: str) -> list[Row]:
    lines = [match[0].split() for match in matches(r"\s*\d+\s+(dense|pfc\S*)\s.*", out,
                                                   "'CLASSES dense|pfc ...' table row")]
    return [(f"bench_pfc {' '.join(line[:2])}", " ".join(line[2:]), True) for line in lines]


# tools.step_memory's configurations: the memory plan of each against a real step (one process).
MEMORY_PLAN_CASES = {
    "r50 fp16, 128 x 2 views, 1M classes at 10%": "network=r50 fp16=True batch_size=128 num_classes=1000000 "
                                                  "sample_rate=0.1",
    "vit_b fp16 (checkpointed), 128 x 2 views, 100k classes": "network=vit_b fp16=True batch_size=128 "
                                                              "num_classes=100000",
}
TINY_MEMORY_PLAN = ["network=r18", "network_kwargs={'width_mult':0.0625}", "batch_size=2", "num_classes=1000"]


def memory_plan(run: Runner) -> Rows:
    """The --dry-run memory plan against what a real step allocates (tools/step_memory.py): the total and
    plan/peak per item, from the CUDA caching allocator's statistics."""
    run.budget("memory plan")
    command = [sys.executable, "-m", "tools.step_memory", "configs/synthetic_pair.py", "--json", *device_args(run)]
    for item in ["rec=synthetic", "embedding_size=512", "num_workers=0", "optimizer=sgd", "network_kwargs={}",
                 *(TINY_MEMORY_PLAN if run.tiny else [])]:
        command += ["--set", item]
    for case in ([] if run.tiny else MEMORY_PLAN_CASES.values()):
        command += ["--case", case]
    status, out = run.sh(command)
    names = ["tiny r18 on the CPU"] if run.tiny else list(MEMORY_PLAN_CASES)
    yield from parsed("memory plan", status, out, parse_memory_plan(names))


def parse_memory_plan(names: list[str]) -> Callable[[str], list[Row]]:
    """tools.step_memory --json: one JSON line per case, in the order of `names`."""
    def parse(out: str) -> list[Row]:
        results = [json.loads(match[0]) for match in matches(r"\{.*\}$", out, "JSON line of a measured case")]
        if len(results) != len(names):
            return [("memory plan", f"FAILED: {len(results)} JSON lines for {len(names)} cases", False)]
        return [(f"memory plan {name}", ratios(result), True) for name, result in zip(names, results, strict=True)]
    return parse


def gpu_decode(run: Runner) -> Rows:
    name = "gpu decode vs cpu decode"
    if run.tiny:
        yield name, "skipped (needs a GPU)", True
        return
    run.budget("gpu decode")
    status, out = run.sh([sys.executable, "-m", "pytest", "-q", "tests/test_loader.py", "-k", "gpu", "-p",
                          "no:cacheprovider", "-p", "no:randomly"])
    yield from parsed(name, status, out, parse_one_line(name, PYTEST_LINE, "pytest summary line"))


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
        "memory growth": lambda: one_line(run, "memory growth", "memory growth", ["-m", "bench.memory_growth", *memory],
                                          MEMORY_GROWTH_LINE, "'... MiB after N steps, ... MiB after N more' line"),
        "pfc precision": lambda: pfc_precision(run),
        "decode": lambda: one_line(run, "decode", "gpu decode per batch, overlap with the step",
                                   ["-m", "bench.decode_overlap", "--rec", str(pairs), *decode], DECODE_LINE,
                                   "'decode ... ms/batch ..., step ... ms, loop ... ms/batch' line"),
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
    bad, seconds = [], []
    for check, rows in checks(run, work).items():
        if only and check not in only:
            print_row(check, "not run (not selected)")
            continue
        if end - time.monotonic() < BUDGETS[check] * budget_scale(run.tiny):
            print_row(check, "not run (time)")
            bad.append(check)
            continue
        start = time.monotonic()
        for name, result, passed in rows():
            print_row(name, result)
            if not passed:
                bad.append(name)
        seconds.append(f"{check} {time.monotonic() - start:.0f}/{BUDGETS[check] * budget_scale(run.tiny)}")
    if seconds:
        print(f"seconds per check, of its budget: {', '.join(seconds)}", flush=True)
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
