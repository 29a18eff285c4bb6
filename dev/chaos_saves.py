"""Chaos for checkpoints: runs of a tiny synthetic config killed again and again with SIGKILL or SIGTERM at random
moments (saves included) under CPU load, each resumed (`resume="auto"`) until it finishes, then compared with the
uninterrupted run: every tensor saved, the loader positions, the random generators, backbone.pth and the logged
scalars must be equal, bit for bit (CPU training resumes exactly: docs/operations.md). Not part of `make test`.

    python -m dev.chaos_saves                      # 4 runs, up to 3 kills each, 2 busy processes beside them
    python -m dev.chaos_saves --runs 10 --kills 4 --load 4 --work /tmp/chaos

After every kill it checks what a restart would find: the last published checkpoint is still there, whole (it
loads), never older than before; a SIGTERM's promised save either exits 75 with the checkpoint at the step it
names, or says in one line why not (exit 74). Prints the figures docs/failures.md quotes, and exits 1 when a
checkpoint was lost, a promise broken without its line, or a resumed run ended other than the uninterrupted one.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu_acceptance.runs import arguments, load_run, run_difference
from tools import make_synthetic

ROOT = Path(__file__).resolve().parent.parent
POINTER = "checkpoint.json"
# 40 two-view records, batch 2: 20 steps an epoch; a save every 2 steps, so that kills land in saves often
SETTINGS = ("batch_size=2", "num_workers=1", "save_every_steps=2", "max_steps=10", "resume=auto")
PREEMPTED = re.compile(r"preempted at global step (\d+): checkpoint saved")


@dataclass
class Figures:
    runs: int = 0
    signals: dict[str, int] = field(default_factory=lambda: {"SIGKILL": 0, "SIGTERM": 0})
    saves_interrupted: int = 0   # signals sent while a checkpoint folder was being written
    promises_kept: int = 0       # SIGTERMs answered by exit 75 with the checkpoint at the step named
    promises_said: int = 0       # SIGTERMs answered by a line saying why not (exit 74)
    promises_broken: int = 0     # SIGTERMs answered otherwise
    before_training: int = 0     # SIGTERMs that ended a start before it promised anything (SIGTERM's default action)
    lost_checkpoints: int = 0    # a published checkpoint gone, older, or not loading after a kill
    resumes_exact: int = 0
    differences: list[str] = field(default_factory=list)


def busy() -> None:
    while True:
        pass


def launch(data: Path, output: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *arguments(data, output, *SETTINGS)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def published(output: Path) -> int | None:
    """The step the run folder's checkpoint.json names, after checking that checkpoint loads whole."""
    if not (output / POINTER).exists():
        return None
    load_run(output)
    return json.loads((output / POINTER).read_text())["global_step"]


def saving(output: Path) -> bool:
    return any(output.glob(".tmp-checkpoint-*"))


def steps_logged(output: Path, start: int) -> int:
    """How many step lines this launch has logged (its part of training.log begins at byte `start`)."""
    try:
        with open(output / "training.log", "rb") as log:
            log.seek(start)
            return log.read().count(b"Global Step: ")
    except OSError:
        return 0


def kill_at_random(process: subprocess.Popen, output: Path, start: int, rng: random.Random,
                   figures: Figures) -> str | None:
    """Send SIGKILL or SIGTERM at a random moment of training (a start-up takes most of a launch on a loaded
    machine, and is not what this checks): half of the time 0-20 ms into a save being written, else 0-0.3 s after
    a random step of this launch. The signal sent, or None when the run finished first."""
    number = rng.choice((signal.SIGKILL, signal.SIGTERM))
    mid_save = rng.random() < 0.5
    after = rng.randint(1, 6)
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline:
        if (saving(output) if mid_save else steps_logged(output, start) >= after):
            break
        time.sleep(0.001)
    time.sleep(rng.uniform(0, 0.02) if mid_save else rng.uniform(0, 0.3))
    if process.poll() is not None:
        return None
    figures.saves_interrupted += saving(output)
    process.send_signal(number)
    figures.signals[signal.Signals(number).name] += 1
    return signal.Signals(number).name


def one_run(data: Path, output: Path, reference: Path, kills: int, rng: random.Random, figures: Figures) -> None:
    before = None
    for _ in range(kills):
        log = output / "training.log"
        start = log.stat().st_size if log.exists() else 0
        process = launch(data, output)
        sent = kill_at_random(process, output, start, rng, figures)
        _, stderr = process.communicate(timeout=600)
        try:
            now = published(output)
        except Exception as error:  # a checkpoint that does not load
            figures.lost_checkpoints += 1
            figures.differences.append(f"{output}: the published checkpoint does not load ({error})")
            return
        if before is not None and (now is None or now < before):
            figures.lost_checkpoints += 1
            figures.differences.append(f"{output}: checkpoint of step {before} lost ({now} after a {sent})")
        before = now if now is not None else before
        if sent == "SIGTERM":
            log = (output / "training.log").read_text()
            stop = PREEMPTED.findall(log[log.rindex("config: "):])
            if process.returncode == 75 and stop and int(stop[-1]) == now:
                figures.promises_kept += 1
            elif process.returncode == 74:
                figures.promises_said += 1
            elif process.returncode == -signal.SIGTERM:  # before training began: its handler was not there yet
                figures.before_training += 1
            elif process.returncode != 0:  # 0: it finished before the signal mattered
                figures.promises_broken += 1
                figures.differences.append(f"{output}: SIGTERM ended with status {process.returncode}: "
                                           f"{stderr.strip()[-500:]}")
        if sent is None:
            break
    process = launch(data, output)
    _, stderr = process.communicate(timeout=600)
    if process.returncode != 0:
        figures.differences.append(f"{output}: the last resume failed ({process.returncode}): {stderr[-500:]}")
        return
    difference = run_difference(output, reference)
    if difference is None:
        figures.resumes_exact += 1
    else:
        figures.differences.append(f"{output}: {difference}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--kills", type=int, default=3, help="signals sent to each run at most before it may finish")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", help="folder for the data and the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    figures = Figures()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        data = work / "data"
        make_synthetic.main(["--output", str(data), "--identities", "20", "--images-per-identity", "4",
                             "--val-identities", "10", "--val-pairs", "20", "--workers", "1"])
        load = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
        for process in load:
            process.start()
        started = time.monotonic()
        try:
            reference = work / "uninterrupted"
            if launch(data, reference).wait() != 0:
                print("error: the uninterrupted run failed")
                return 1
            for run in range(args.runs):
                one_run(data, work / f"run{run}", reference, args.kills, rng, figures)
                figures.runs += 1
        finally:
            for process in load:
                process.kill()
    print(f"runs tried {figures.runs}, signals sent {sum(figures.signals.values())} ({figures.signals['SIGKILL']} "
          f"SIGKILL, {figures.signals['SIGTERM']} SIGTERM), saves interrupted {figures.saves_interrupted}, "
          f"SIGTERM saves kept {figures.promises_kept}, said not kept {figures.promises_said}, broken "
          f"{figures.promises_broken}, ended before training began {figures.before_training}, resumes exact "
          f"{figures.resumes_exact}/{figures.runs}, lost checkpoints {figures.lost_checkpoints} "
          f"({time.monotonic() - started:.0f} s, {args.load} busy processes beside them)")
    for difference in figures.differences:
        print(f"  {difference}")
    failed = figures.lost_checkpoints or figures.promises_broken or figures.resumes_exact != figures.runs
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
