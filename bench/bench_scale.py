"""Classifier scale-out: peak memory per process and checkpoint save/load seconds for 10^6 identities.

    python -m bench.bench_scale                                   # C = 1M and 2M on 1, 2 and 4 processes
    python -m bench.bench_scale --classes 1000000 --processes 1 2
    python -m bench.bench_scale --checkpoints --processes 4       # what checksums and async saves cost

`--checkpoints` measures, per C on the largest process count: the seconds of a synchronous save and
of the resume's load with crc32c checksums written and verified, and with them turned off (the bench
replaces the checksum functions by no-ops; training has no such switch), and the step's stall per
async save (the copy to host memory, of the second save: the first also allocates the buffers) against
the synchronous save.

Each row is a real `torchrun` run of train.py (gloo, CPU) on speed-mode data (one fixed image, nothing
decoded), D = 512, SGD with momentum, a tiny backbone (r18 at 1/16 width) so that the classifier is
what grows: 2 steps and a save, then a second run that resumes from that checkpoint and takes one
more step. Per process it reports the peak resident memory above the interpreter's baseline (after
imports, before training: VmHWM - VmRSS), the seconds of the save and of the load, and the
`--dry-run` memory plan of the same configuration as a ratio of that peak. A last row saves on 4
processes at the largest C and resumes on 2. Then, per item of the plan, the plan against one real
step on 1 process at each C (tools/step_memory.py). GPU figures would need the same script with
`--device cuda` processes on a GPU machine: there the centres, logits and optimizer state live in GPU memory
and the host holds only the staging of the save.
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

import train
from checkpoint import checkpointer, manifest, sharded
from tools.step_memory import table
from training.config import load_config
from training.memory_plan import memory_plan

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["rec=synthetic", "network=r18", "network_kwargs={'width_mult': 0.0625}", "embedding_size=512",
            "num_views=2", "batch_size=32", "num_workers=0", "optimizer=sgd", "frequent=1000", "verbose=100000",
            "val_targets=()", "num_epoch=1", "save_every_steps=0"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[1_000_000, 2_000_000])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--checkpoints", action="store_true", help="checksum and async-save costs (see above)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="--checkpoints: extra config overrides (e.g. momentum=0 to fit C = 2M in the RAM)")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def worker(report_dir: str, argv: list[str]) -> int:
    """Inside one torchrun process: train.main with the save and load timed, then this process's figures.
    PAIRFACE_BENCH_NO_CHECKSUMS=1 turns the crc32c work into no-ops (sizes are still written and checked)."""
    baseline = _status("VmRSS")
    seconds: dict[str, list[float]] = {"save": [], "load": [], "staging": []}

    def timed(name, function):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name].append(time.perf_counter() - start)
        return run

    if os.environ.get("PAIRFACE_BENCH_NO_CHECKSUMS") == "1":
        manifest.file_crc32c = lambda path: 0
        sharded.verify_file = lambda folder, name, expected: None
    checkpointer.write_state = timed("save", checkpointer.write_state)
    checkpointer.restore_state = timed("load", checkpointer.restore_state)
    checkpointer.stage_state = timed("staging", checkpointer.stage_state)
    status = train.main(argv)
    rank = int(os.environ.get("RANK", "0"))
    Path(report_dir, f"rank{rank}.json").write_text(json.dumps(
        {"status": status, "baseline": baseline, "peak": _status("VmHWM"),
         **{name: sum(values) for name, values in seconds.items()}, "each_staging": seconds["staging"]}))
    return status


def run(classes: int, processes: int, output: Path, *extra: str, env: dict | None = None) -> list[dict]:
    reports = Path(tempfile.mkdtemp(prefix="scale-"))
    overrides = [f"num_classes={classes}", f"output={output}", *SETTINGS, *extra]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", "bench.bench_scale", "--worker", str(reports), "configs/synthetic_pair.py"]
    for item in overrides:
        command += ["--set", item]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{classes} classes on {processes} processes failed:\n{done.stderr[-3000:]}")
    return [json.loads(path.read_text()) for path in sorted(reports.glob("rank*.json"))]


def planned(classes: int, processes: int) -> int:
    cfg = load_config(ROOT / "configs" / "synthetic_pair.py", [f"num_classes={classes}", *SETTINGS])
    return memory_plan(cfg, classes, processes)["total"]


def row(classes: int, saved_on: int, resumed_on: int, first: list[dict], second: list[dict]) -> str:
    peak = max(r["peak"] - r["baseline"] for r in first + second)
    plan = max(planned(classes, saved_on), planned(classes, resumed_on))
    return (f"{classes:>9} {saved_on:>5} {resumed_on:>7} {peak / 2 ** 30:>10.2f} {max(r['save'] for r in first):>7.1f} "
            f"{max(r['load'] for r in second):>7.1f} {plan / 2 ** 30:>8.2f} {plan / peak:>10.2f}")


def checkpoint_costs(classes: int, processes: int, extra: list[str]) -> str:
    """One row: save and load seconds with and without checksums, the async stall and the sync save."""
    figures = {}
    for mode, env in (("checked", {}), ("unchecked", {"PAIRFACE_BENCH_NO_CHECKSUMS": "1"})):
        with tempfile.TemporaryDirectory() as tmp:
            first = run(classes, processes, Path(tmp) / "run", "max_steps=2", "async_save=False", *extra, env=env)
            second = run(classes, processes, Path(tmp) / "run", "max_steps=3", "async_save=False", "resume=True",
                         *extra, env=env)
        figures[mode] = (max(r["save"] for r in first), max(r["load"] for r in second))
    with tempfile.TemporaryDirectory() as tmp:
        # async saves at steps 2 and 4, each written in the background while training goes on
        timed = run(classes, processes, Path(tmp) / "run", "max_steps=5", "save_every_steps=2", "async_save=True",
                    *extra)
    (save, load), (bare_save, bare_load) = figures["checked"], figures["unchecked"]
    # the copy to host memory of the second save: its buffers are those of the first (the first pays for
    # allocating them once per run)
    stall = max(r["each_staging"][1] for r in timed)
    return (f"{classes:>9} {processes:>5} {bare_save:>8.1f} {save:>8.1f} {save / bare_save - 1:>8.1%} "
            f"{bare_load:>8.1f} {load:>8.1f} {load / bare_load - 1:>8.1%} {stall:>8.2f} {save:>8.1f} "
            f"{stall / save:>8.1%}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker[0], args.worker[1:])
    if args.checkpoints:
        print("save/load = seconds of a synchronous save (write_state) and of the resume's load (restore_state), the "
              "slowest process; +% = what crc32c checksums add (target <= 10%); stall = seconds the step waits for "
              "an async save (its copy to host memory), against the synchronous save (target <= 10%)")
        print(f"{'classes':>9} {'procs':>5} {'save':>8} {'save+crc':>8} {'+%':>8} {'load':>8} {'load+crc':>8} "
              f"{'+%':>8} {'stall':>8} {'sync':>8} {'ratio':>8}")
        for classes in args.classes:
            print(checkpoint_costs(classes, max(args.processes), args.extra), flush=True)
        return 0
    print("peak = the largest VmHWM - VmRSS-after-imports of any process, over a 2-step run with a save and a "
          "resumed run with one more step; plan = train.py --dry-run's total for the same configuration")
    print(f"{'classes':>9} {'saved':>5} {'resumed':>7} {'peak GiB':>10} {'save s':>7} {'load s':>7} {'plan GiB':>8} "
          f"{'plan/peak':>10}")
    peaks: dict[tuple[int, int], float] = {}
    for classes in args.classes:
        for processes in args.processes:
            with tempfile.TemporaryDirectory() as tmp:
                first = run(classes, processes, Path(tmp) / "run", "max_steps=2")
                second = run(classes, processes, Path(tmp) / "run", "max_steps=3", "resume=True")
            peaks[classes, processes] = max(r["peak"] - r["baseline"] for r in first + second)
            print(row(classes, processes, processes, first, second), flush=True)
    largest, most = max(args.classes), max(args.processes)
    if most > 2:
        with tempfile.TemporaryDirectory() as tmp:
            first = run(largest, most, Path(tmp) / "run", "max_steps=2")
            # step 2 of `most` processes is step 2 * most / 2 of 2 (the same fraction of the epoch): one more
            second = run(largest, 2, Path(tmp) / "run", f"max_steps={2 * most // 2 + 1}", "resume=True")
        print(row(largest, most, 2, first, second), flush=True)
    for classes in args.classes:
        if (classes, 1) in peaks and (classes, most) in peaks:
            print(f"C = {classes}: {most}-process peak / 1-process peak = "
                  f"{peaks[classes, most] / peaks[classes, 1]:.2f} (target <= 0.35 at C = 1M)")
    print_items(args.classes)
    return 0


def print_items(classes: list[int]) -> None:
    """The plan per item against what one real step allocates on 1 process (tools/step_memory.py)."""
    command = [sys.executable, "-m", "tools.step_memory", "configs/synthetic_pair.py", "--json"]
    for item in SETTINGS:
        command += ["--set", item]
    for count in classes:
        command += ["--case", f"num_classes={count}"]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, check=True)
    print("\nper item, 1 process: the plan against one real step (tensor bytes from torch.profiler's allocation "
          "record)")
    for line in done.stdout.splitlines():
        result = json.loads(line)
        print(table(f"C = {result['case'].split('=')[1]}", result))


if __name__ == "__main__":
    sys.exit(main())
