"""arcface_torch's train_v2.py and pairface's train.py on the same config file, one after the other on the
same machine: samples/s of each (the mean of its last log lines' "Speed ... samples/sec"), the GPU memory
each used, and the ratio pairface / arcface_torch.

    python -m gpu_acceptance.side_by_side --arcface-torch /tmp/arcface_torch    # configs/ms1mv3_r50_onegpu_synthetic.py
    python -m gpu_acceptance.side_by_side --config configs/X.py --nproc 8       # arcface_torch fetched from GitHub
    python -m gpu_acceptance.side_by_side --tiny                                # a CPU rehearsal of pairface's side

The config is an arcface_torch config file (`config = edict()`, `config.key = value`), which both programs
read as it is; each run gets its own output folder in a temporary folder, and pairface `max_steps`.
arcface_torch is insightface's `recognition/arcface_torch` folder: `--arcface-torch DIR` (copied, never
changed), or else a shallow, sparse `git clone` of insightface into the temporary folder. Nothing of it enters the
repository. Its run gets two things its users would otherwise add by hand, each said in the output:

- torch's LR scheduler takes no `verbose` argument in recent versions, and arcface_torch's
  PolynomialLRWarmup passes one (`TypeError` before the first step): removed in the temporary copy when the
  running torch's scheduler has no such parameter, not otherwise;
- its dataset.py and eval/verification.py import mxnet at the top even for `rec = "synthetic"`, and mxnet
  has no wheel for current Pythons: when it cannot be imported and the data is synthetic (which never calls
  it), an empty stand-in module is put on its path.

arcface_torch has no step limit and its synthetic epoch is a million samples, so its run is stopped (SIGTERM
to its process group) once it printed `--skip` + `--lines` Speed lines; pairface runs exactly the steps that
print as many. The first `--skip` lines include start-up (cudnn's search, the first allocations) and are left
out of the mean. GPU memory is nvidia-smi's memory.used at its peak during the run, less what was used before
it (a program-independent measure: arcface_torch logs none).

arcface_torch's train_v2.py needs CUDA (torch.cuda.set_device, NCCL): without it only pairface's side can run,
and only as `--tiny`, a rehearsal with a tiny network and a few steps (not a measurement).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import queue
import re
import runpy
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from training.config import load_config
from utils.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = "configs/ms1mv3_r50_onegpu_synthetic.py"
INSIGHTFACE = "https://github.com/deepinsight/insightface"
ARCFACE_FOLDER = "recognition/arcface_torch"
CONFIG_NAME = "side_by_side_config"  # the config's name in the copy's configs/ (its get_config imports configs.<name>)
# arcface_torch's utils/utils_logging.py formats each line "Training: %(asctime)s-%(message)s", and its
# utils/utils_callbacks.py CallBackLogging writes "Speed %.2f samples/sec   Loss %.4f   LearningRate %.6f ..."
# (speed_total, which is inf after a zero interval).
ARCFACE_SPEED = re.compile(r"Training: .*?-Speed (\S+) samples/sec   Loss ")
# pairface's utils/log.py: the same prefix, and SpeedLogger's "Speed %.2f samples/sec %.2f images/sec   Loss ..."
PAIRFACE_SPEED = re.compile(r"Training: .*?-Speed (\S+) samples/sec \S+ images/sec   Loss ")
# arcface_torch's lr_scheduler.py: `super().__init__(optimizer, last_epoch=last_epoch, verbose=verbose)`
VERBOSE_PASSED = re.compile(r"super\(\)\.__init__\(([^()]*?),\s*verbose=verbose\s*\)")
# What arcface_torch's train_v2.py imports beyond torch and the standard library, for any config: module -> pip name
ARCFACE_NEEDS = {"easydict": "easydict", "numpy": "numpy", "torchvision": "torchvision",
                 "tensorboard": "tensorboard", "sklearn": "scikit-learn", "scipy": "scipy"}
VIT_NEEDS = {"timm": "timm"}  # its backbones/vit.py, for the vit_* networks
MXNET_STANDIN = ('"""A stand-in for mxnet from pairface\'s gpu_acceptance/side_by_side.py: arcface_torch imports mxnet '
                 'at the top of dataset.py and\neval/verification.py, and its synthetic data never calls it."""\n')
# --tiny: pairface's side on a CPU in seconds (the tests' r18 at 1/16 of its widths), a rehearsal, not a measurement
TINY = ["network=r18", "network_kwargs={'width_mult': 0.0625}", "embedding_size=32", "batch_size=2",
        "num_classes=100", "num_workers=0", "fp16=False", "frequent=1", "val_targets=()", "save_all_states=False"]
TINY_SKIP, TINY_LINES = 1, 2
# Keys whose defaults say nothing of the training: where each writes, and W&B's names (it is off in both by default)
NOT_COMPARED = ("output", "resume", "wandb_", "suffix_run_name", "save_artifacts", "notes")
PROGRAMS = ("arcface_torch", "pairface")
NAME_WIDTH, SPEED_WIDTH = 16, 12


class SideBySideError(RuntimeError):
    """A problem the user fixes (a missing folder, package or network): one sentence, no traceback."""


@dataclass
class Run:
    """One program's run: its Speed values in order, the GPU memory it used, or why there is no figure."""
    speeds: list[float] = field(default_factory=list)
    memory_gib: float | None = None
    not_run: str | None = None  # why it was not run
    failed: str | None = None  # how it failed (its exit status and last line)


def speeds(text: str, pattern: re.Pattern) -> list[float]:
    """Every Speed value of the log lines `pattern` recognises, in order."""
    return [float(match[1]) for line in text.splitlines() if (match := pattern.match(line))]


def mean_of_last(values: Sequence[float], count: int) -> float:
    if not values:
        raise ValueError("no Speed line to average")
    return statistics.fmean(values[-count:])


def scheduler_takes_verbose() -> bool:
    """Whether the running torch's LR scheduler base class accepts the `verbose` argument PolynomialLRWarmup
    passes it (torch deprecated it, then removed it)."""
    parameters = inspect.signature(torch.optim.lr_scheduler.LRScheduler.__init__).parameters.values()
    return any(p.name == "verbose" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def without_verbose(source: str) -> str | None:
    """lr_scheduler.py's text with the `verbose` argument no longer passed to torch's scheduler, or None when
    it passes none (nothing to remove)."""
    patched, count = VERBOSE_PASSED.subn(r"super().__init__(\1)", source)
    return patched if count else None


def fetch_arcface_torch(work: Path) -> Path:
    """A shallow clone of insightface in `work` holding the arcface_torch folder alone (the whole repository's
    files are hundreds of MB): that folder."""
    clone = work / "insightface"
    reason = None
    for command in (["git", "clone", "--quiet", "--depth", "1", "--filter=blob:none", "--sparse", INSIGHTFACE,
                     str(clone)],
                    ["git", "-C", str(clone), "sparse-checkout", "set", ARCFACE_FOLDER]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as error:
            reason = str(error)
            break
        if done.returncode:
            # git's first "fatal:" line says why ("Could not resolve host: github.com"); advice follows it
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            fatal = [line for line in lines if line.startswith("fatal:")]
            reason = (fatal or lines or [f"git exited with status {done.returncode}"])[0]
            break
    if reason is not None:
        raise SideBySideError(f"could not fetch arcface_torch ({INSIGHTFACE}: {reason}); pass --arcface-torch DIR, a "
                              f"copy of insightface's {ARCFACE_FOLDER} folder made on a machine with a network")
    return clone / ARCFACE_FOLDER


def copy_arcface_torch(source: Path, work: Path) -> tuple[Path, list[str]]:
    """arcface_torch copied into `work` (the user's folder never changes), its LR scheduler made to start under
    the running torch when it needs that: (the copy, what was changed and why)."""
    if not (source / "train_v2.py").is_file():
        raise SideBySideError(f"--arcface-torch {source} holds no train_v2.py; pass insightface's {ARCFACE_FOLDER} "
                              "folder")
    copy = work / "arcface_torch"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".git", "work_dirs", "__pycache__"))
    notes = []
    if not scheduler_takes_verbose():
        scheduler = copy / "lr_scheduler.py"
        patched = without_verbose(scheduler.read_text())
        if patched is not None:
            scheduler.write_text(patched)
            notes.append(f"patched lr_scheduler.py in the temporary copy: PolynomialLRWarmup passes `verbose` to "
                         f"torch's LR scheduler, which takes none under torch {torch.__version__} (TypeError before "
                         "the first step); that one argument removed")
    return copy, notes


def arcface_environment(work: Path, rec: str, network: str) -> tuple[dict[str, str], list[str]]:
    """The environment arcface_torch's run gets, and what it adds: every package its imports need must be
    importable, but mxnet, which synthetic data never calls and which has no wheel for current Pythons, gets a
    stand-in when it cannot be imported."""
    needs = {**ARCFACE_NEEDS, **(VIT_NEEDS if network.startswith("vit") else {})}
    missing = [package for module, package in needs.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise SideBySideError(f"arcface_torch's train_v2.py imports {', '.join(missing)}, which {sys.executable} "
                              f"cannot import; install them (pip install {' '.join(missing)}) or, on a machine "
                              "without a network, their wheels carried over (docs/gpu.md)")
    environment, notes = dict(os.environ), []
    if not importable("mxnet"):
        if rec != "synthetic":
            raise SideBySideError(f"arcface_torch reads rec={rec!r} with mxnet, which {sys.executable} cannot import; "
                                  "install mxnet, or compare on rec = \"synthetic\"")
        standins = work / "standins"
        (standins / "mxnet").mkdir(parents=True)
        (standins / "mxnet" / "__init__.py").write_text(MXNET_STANDIN)
        (standins / "mxnet" / "ndarray.py").write_text(MXNET_STANDIN)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(standins), environment.get("PYTHONPATH")]))
        notes.append("mxnet cannot be imported here: an empty stand-in put on arcface_torch's path (its dataset.py and "
                     "eval/verification.py import it at the top; rec = \"synthetic\" never calls it)")
    return environment, notes


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # mxnet 1.9 fails under numpy 2 with AttributeError, not ImportError
        return False
    return True


def arcface_config_file(config: Path, copy: Path, output: Path) -> Path:
    """The config as arcface_torch's get_config takes it (a module of the copy's configs/, named relative to the
    folder it runs in), its output folder set."""
    target = copy / "configs" / f"{CONFIG_NAME}.py"
    target.write_text(config.read_text() + f"\n# added by pairface's gpu_acceptance/side_by_side.py\nconfig.output = "
                                            f"{str(output)!r}\n")
    return target


def check_arcface_style(config: Path) -> None:
    try:
        names = runpy.run_path(str(config))
    except Exception as error:  # a config is user code; easydict, its import, may be missing
        raise SideBySideError(f"config file {config} failed to run ({type(error).__name__}: {error}); fix it, or "
                              "install what it imports (arcface_torch's configs import easydict)") from None
    if not isinstance(names.get("config"), Mapping):
        raise SideBySideError(f"config file {config} is not in arcface_torch's style (config = edict(); "
                              "config.key = value), so its train_v2.py cannot read it; pass such a file, e.g. "
                              f"{DEFAULT_CONFIG}")


class MemoryWatch:
    """nvidia-smi's memory.used, summed over the GPUs, at its peak while the watch runs, less its value at the
    start: None without nvidia-smi."""

    INTERVAL = 0.25

    def __init__(self) -> None:
        self.start = self._used()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    @staticmethod
    def _used() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            return sum(float(line) for line in out.split())
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None

    def _watch(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            used = self._used()
            if used is not None and self.peak is not None:
                self.peak = max(self.peak, used)

    def __enter__(self) -> MemoryWatch:
        if self.start is not None:
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def gib(self) -> float | None:
        return None if self.start is None else (self.peak - self.start) / 1024


def run_for_lines(command: list[str], cwd: Path, environment: Mapping[str, str], pattern: re.Pattern, lines: int,
                  timeout: float, watch_memory: bool, stop_at_lines: bool) -> Run:
    """`command` run within `timeout` seconds until it exits or, with `stop_at_lines`, has printed `lines` lines
    `pattern` recognises (then its process group is stopped: SIGTERM, which torchrun hands to its workers, then
    SIGKILL)."""
    process = subprocess.Popen(command, cwd=cwd, env=dict(environment), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=forward_lines, args=(process, output), daemon=True).start()
    seen, found, stopped = [], [], False
    deadline = time.monotonic() + timeout
    with MemoryWatch() if watch_memory else contextlib.nullcontext() as watch:
        while True:
            try:
                line = output.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                stop(process)
                return Run(failed=f"no {lines} Speed lines within {timeout:.0f} s (printed {len(found)})")
            if line is None:
                break
            seen.append(line)
            if pattern.match(line):
                found.append(line)
                if stop_at_lines and len(found) == lines and process.poll() is None:
                    stop(process)
                    stopped = True
    status = process.wait()
    run = Run(speeds=speeds("".join(seen), pattern), memory_gib=watch.gib() if watch else None)
    if status and not stopped:
        last = [text.strip() for text in seen if text.strip()]
        run.failed = f"exit {status}: {last[-1] if last else 'no output'}"
    elif len(run.speeds) < lines:
        run.failed = f"{len(run.speeds)} Speed lines, fewer than {lines}"
    return run


def forward_lines(process: subprocess.Popen, output: queue.Queue) -> None:
    """The command's lines as they come, then None: read on a thread of its own, so a silent command cannot
    outlast the timeout."""
    for line in process.stdout:
        output.put(line)
    output.put(None)


def stop(process: subprocess.Popen) -> None:
    for sent in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sent)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
            return


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def device_name(tiny: bool) -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "CPU (no CUDA)" if tiny else "no CUDA"


def row(program: str, run: Run, skip: int, lines: int) -> str:
    if run.not_run or run.failed:
        why = f"not run: {run.not_run}" if run.not_run else f"FAILED: {run.failed}"
        return f"{program:<{NAME_WIDTH}}{'-':>{SPEED_WIDTH}}  {why}"
    memory = "-" if run.memory_gib is None else f"{run.memory_gib:.1f} GiB"
    return (f"{program:<{NAME_WIDTH}}{mean_of_last(run.speeds, lines):>{SPEED_WIDTH}.2f}  "
            f"mean of the last {lines} of {len(run.speeds)} lines (the first {skip} left out), GPU memory {memory}")


def ratio_line(runs: Mapping[str, Run], lines: int) -> str:
    ours, theirs = runs["pairface"], runs["arcface_torch"]
    if any(run.not_run or run.failed for run in (ours, theirs)):
        return "ratio pairface / arcface_torch: not measured (a side has no figure)"
    ratio = mean_of_last(ours.speeds, lines) / mean_of_last(theirs.speeds, lines)
    return f"ratio pairface / arcface_torch: {ratio:.2f}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m gpu_acceptance.side_by_side")
    parser.add_argument("--config", type=Path, default=ROOT / DEFAULT_CONFIG,
                        help=f"an arcface_torch-style config file both programs read (default {DEFAULT_CONFIG})")
    parser.add_argument("--arcface-torch", type=Path, metavar="DIR",
                        help=f"insightface's {ARCFACE_FOLDER} folder (copied); fetched from GitHub when not given")
    parser.add_argument("--nproc", type=int, default=1, help="processes under torchrun for each program")
    parser.add_argument("--lines", type=int, help="Speed lines averaged (default 12; --tiny 2)")
    parser.add_argument("--skip", type=int, help="Speed lines before them, left out (default 3; --tiny 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each program may run")
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU rehearsal: pairface's side only, tiny network, a few steps (not a measurement)")
    args = parser.parse_args(argv)
    args.lines = args.lines or (TINY_LINES if args.tiny else 12)
    args.skip = TINY_SKIP if args.skip is None and args.tiny else 3 if args.skip is None else args.skip
    if args.nproc < 1 or args.lines < 1 or args.skip < 0:
        parser.error("--nproc and --lines must be positive and --skip not negative")
    return args


def prepared(source: Path, work: Path, config: Path) -> Path:
    """arcface_torch's copy, what was changed in it and the defaults the two programs do not share, printed."""
    copy, notes = copy_arcface_torch(source, work)
    for note in notes:
        print(f"arcface_torch: {note}")
    differing = differing_defaults(copy, config)
    if differing:
        print("defaults the config leaves to each program, which differ: " + "; ".join(
            f"{key} {theirs!r} (arcface_torch) and {ours!r} (pairface)" for key, (theirs, ours) in differing.items()))
    return copy


def differing_defaults(copy: Path, config: Path) -> dict[str, tuple[object, object]]:
    """{key: (arcface_torch's default, pairface's)} for the keys both have that the config does not set and whose
    defaults differ: each program runs with its own there, as its users get it."""
    theirs = runpy.run_path(str(copy / "configs" / "base.py"))["config"]
    given = runpy.run_path(str(config))["config"]
    ours = vars(load_config(ROOT / "configs" / "base.py"))

    def same(a: object, b: object) -> bool:
        return (list(a) if isinstance(a, tuple | list) else a) == (list(b) if isinstance(b, tuple | list) else b)

    return {key: (value, ours[key]) for key, value in theirs.items()
            if key in ours and key not in given and not key.startswith(NOT_COMPARED) and not same(value, ours[key])}


def compare(args: argparse.Namespace, work: Path) -> dict[str, Run]:
    config = args.config.resolve()
    check_arcface_style(config)
    pairface_sets = [*(TINY if args.tiny else []), f"output={work / 'pairface_output'}"]
    cfg = load_config(config, pairface_sets)  # the values both read: a config error is pairface's one sentence
    lines = args.skip + args.lines
    runs: dict[str, Run] = {}

    copy = None
    if args.arcface_torch is not None:
        copy = prepared(args.arcface_torch.resolve(), work, config)
    if args.tiny or not torch.cuda.is_available():
        runs["arcface_torch"] = Run(not_run="its train_v2.py needs CUDA (torch.cuda.set_device, NCCL), and "
                                            f"{'--tiny rehearses on the CPU' if args.tiny else 'there is none here'}")
    else:
        if copy is None:
            copy = prepared(fetch_arcface_torch(work), work, config)
        environment, notes = arcface_environment(work, cfg.rec, cfg.network)
        for note in notes:
            print(f"arcface_torch: {note}")
        config_file = arcface_config_file(config, copy, work / "arcface_torch_output")
        runs["arcface_torch"] = run_for_lines(
            [*torchrun(args.nproc), "train_v2.py", f"configs/{config_file.name}"], copy, environment, ARCFACE_SPEED,
            lines, args.timeout, watch_memory=True, stop_at_lines=True)

    steps = lines * cfg.frequent  # pairface logs at every multiple of frequent, the first included
    # --tiny: one plain process (torchrun's start and gloo's collectives would triple a rehearsal's seconds)
    command = [*([sys.executable] if args.tiny else torchrun(args.nproc)), "train.py", str(config)]
    for item in [*pairface_sets, f"max_steps={steps}"]:
        command += ["--set", item]
    runs["pairface"] = run_for_lines(command, ROOT, os.environ, PAIRFACE_SPEED, lines, args.timeout,
                                     watch_memory=torch.cuda.is_available(), stop_at_lines=False)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("side by side: error: there is no CUDA here and arcface_torch's train_v2.py needs it; run on a GPU "
              "machine, or pass --tiny for a CPU rehearsal of pairface's side", file=sys.stderr)
        return 2
    print(f"side by side: torch {torch.__version__}, {device_name(args.tiny)}, {args.nproc} process(es) each, "
          f"config {args.config}{', --tiny (a rehearsal, not a measurement)' if args.tiny else ''}")
    with tempfile.TemporaryDirectory(prefix="side_by_side_") as folder:
        try:
            runs = compare(args, Path(folder))
        except (SideBySideError, ConfigError) as error:
            print(f"side by side: error: {error}", file=sys.stderr)
            return 2
    print(f"{'program':<{NAME_WIDTH}}{'samples/s':>{SPEED_WIDTH}}  how measured")
    for program in PROGRAMS:
        print(row(program, runs[program], args.skip, args.lines))
    print(ratio_line(runs, args.lines))
    return 1 if any(run.failed for run in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
