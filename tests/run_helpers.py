"""Running train.py for the reliability tests and reading back what a run left.

Every test launches training through this module, in one of three ways, all taking the same
`--set` overrides on top of `base` (QUIET unless a test needs other settings): `run_here` calls
`train.main` in this process (no import cost: a few tenths of a second per start), `start_child` /
`run_child` fork a process that runs it (so a test can SIGKILL it or limit its file sizes), and
`start_cli` / `run_cli` run the real command line as `python train.py` or through torchrun.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import train
from backbones import get_model
from checkpoint.pointer import POINTER_NAME
from checkpoint.run_dir import LOCK_NAME
from tests.distributed_helpers import FORKSERVER_PRELOAD
from tests.forked_commands import ForkedCommand

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/synthetic_pair.py"
# 40 two-view records of 20 identities (the `data` fixture of tests/test_train.py), batch 4: 10 steps
# per epoch on 1 process, 5 on 2. Every step logged; no verification (it is not what these tests check).
# The GPU recipe (SGD with momentum, ArcFace) is pinned so that retuning the demo config cannot change
# which optimizer state and margin these tests exercise. r18 at 1/16 of its widths: the smallest r18 that the
# fp16 runs also afford (float16 convolutions' backward has no fast CPU kernel).
QUIET = ["network=r18", "network_kwargs={'width_mult': 0.0625}", "embedding_size=32", "batch_size=4", "num_workers=0",
         "frequent=1", "verbose=1000", "val_targets=()", "num_epoch=4", "optimizer=sgd", "lr=0.1",
         "weight_decay=5e-4", "margin_list=(1.0, 0.5, 0.0)", "margin_scale=64.0"]
INFO = {"network": "r18", "network_kwargs": {"width_mult": 0.0625}, "embedding_size": 32, "num_classes": 20}


def continue_command(data: Path, output: Path, *overrides: str, config: str = CONFIG, base: Sequence[str] = QUIET,
                     launcher: str = "python") -> str:
    """The command line a user types to continue the run `arguments(data, output, *overrides)` started, as its
    stop lines must print it: each --set once (a later one of a key in the place of the first), then --resume."""
    sets: dict[str, str] = {}
    for item in [f"rec={data}", f"output={output}", *base, *overrides]:
        sets[item.split("=", 1)[0]] = item
    return " ".join([launcher, "train.py", config, *(f"--set {shlex.quote(item)}" for item in sets.values()),
                     "--resume"])


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def arguments(data: Path, output: Path, *overrides: str, resume: bool = False, config: str = CONFIG,
              base: Sequence[str] = QUIET) -> list[str]:
    argv = [config]
    for item in [f"rec={data}", f"output={output}", *base, *overrides]:
        argv += ["--set", item]
    return argv + (["--resume"] if resume else [])


def run_here(data: Path, output: Path, *overrides: str, resume: bool = False, config: str = CONFIG,
             base: Sequence[str] = QUIET, stdout: io.StringIO | None = None) -> tuple[int, str]:
    """train.main in this process: (exit status, what it wrote to stderr); what it wrote to stdout (the
    terminal's log lines) goes to ``stdout`` when given."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stderr = io.StringIO()
    try:
        with contextlib.chdir(ROOT), contextlib.redirect_stderr(stderr), \
                contextlib.redirect_stdout(stdout or io.StringIO()):
            status = train.main(arguments(data, output, *overrides, resume=resume, config=config, base=base))
    finally:
        # train.py's logging setup replaced the root handlers (pytest's among them): put them back.
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = handlers, level
    return status, stderr.getvalue()


def _command(nproc: int, nan_steps: str | None, injection: Sequence[str] = ()) -> list[str]:
    """The launch of train.py, of train.py under tests.nan_injection (rank 0's loss NaN at `nan_steps`), or
    under another fault injection module (`injection`: "-m", module and its arguments)."""
    script = list(injection) or (["train.py"] if nan_steps is None else ["-m", "tests.nan_injection", nan_steps])
    if not nproc:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *script]


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}


def start_command(argv: Sequence[str], env: Mapping[str, str] | None = None, own_group: bool = False,
                  real: bool = False, prepare: Callable[[], None] | None = None,
                  output: Path | None = None) -> subprocess.Popen | ForkedCommand:
    """A `python ...` or `python -m torch.distributed.run ...` command line (`sys.executable` first), started in
    ROOT with `env` added, not awaited; text stdout and stderr. Forked from the tests' forkserver
    (tests/forked_commands.py) unless `real`: a new interpreter, as a user's shell starts it, for the tests of
    the launch itself. `own_group`: in a process group of its own, which os.killpg(process.pid, ...) signals as
    a terminal or scheduler would. `prepare` (picklable: a module-level function) runs in the process first.
    `output`: a file that stdout and stderr go to together, to read while the command runs."""
    if not real:
        return ForkedCommand(_CHILDREN, argv, ROOT, _environment(env), own_group=own_group, prepare=prepare,
                             output=None if output is None else str(output))
    def popen(stdout, stderr) -> subprocess.Popen:
        return subprocess.Popen(list(argv), cwd=ROOT, env=_environment(env), stdout=stdout, stderr=stderr, text=True,
                                preexec_fn=prepare, process_group=0 if own_group else None)

    if output is None:
        return popen(subprocess.PIPE, subprocess.PIPE)
    with output.open("a") as file:  # the process has its own copy
        return popen(file, subprocess.STDOUT)


def start_cli(data: Path, output: Path, *overrides: str, nproc: int = 2, resume: bool = False,
              base: Sequence[str] = QUIET, env: Mapping[str, str] | None = None,
              nan_steps: str | None = None, own_group: bool = False, injection: Sequence[str] = (),
              real: bool = False, console: Path | None = None) -> subprocess.Popen | ForkedCommand:
    """`torchrun --nproc_per_node <nproc> train.py ...` (`python train.py ...` for nproc 0), started, not
    awaited (start_command), so that tests start independent runs side by side. `injection`: "-m", a fault
    injection module and its arguments, run instead of train.py. `console`: start_command's `output`."""
    command = _command(nproc, nan_steps, injection) + arguments(data, output, *overrides, resume=resume, base=base)
    return start_command(command, env=env, own_group=own_group, real=real, output=console)


def run_cli(data: Path, output: Path, *overrides: str, nproc: int = 0, resume: bool = False,
            base: Sequence[str] = QUIET, env: Mapping[str, str] | None = None,
            nan_steps: str | None = None, injection: Sequence[str] = (),
            real: bool = False) -> subprocess.CompletedProcess:
    """The command line, run to its end (`python train.py` for nproc 0, else torchrun)."""
    command = _command(nproc, nan_steps, injection) + arguments(data, output, *overrides, resume=resume, base=base)
    return run_command(command, env=env, real=real)


def run_command(argv: Sequence[str], env: Mapping[str, str] | None = None, real: bool = False,
                timeout: float = 400) -> subprocess.CompletedProcess:
    """start_command's command line, run to its end (killed with all its processes after `timeout` seconds)."""
    process = start_command(argv, env=env, real=real)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            kill_node(process)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def finish(process: subprocess.Popen | ForkedCommand, timeout: float = 400) -> str:
    """Wait for a started command line; assert it succeeded; its stderr."""
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-3000:] + err[-3000:]
    return err


def _child(argv: list[str], stderr_path: str, prepare: Callable[[], None] | None) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # keeps train.main from raising the thread count of a forked pool
    os.chdir(ROOT)
    if prepare is not None:
        prepare()
    with open(stderr_path, "w") as stderr, contextlib.redirect_stderr(stderr), \
            contextlib.redirect_stdout(io.StringIO()):
        status = train.main(argv)
    os._exit(status)


# Children fork from a server process that has imported train.py and run nothing: forking the test process
# itself would hand each child whatever earlier tests left there (autograd or OpenMP thread pools that a
# forked child cannot use), and spawning would import torch again for every child (seconds each). train.py
# imports DCP and torchvision only when it first saves or decodes: preloaded, so that no child pays them. The
# same server forks run_world's ranks.
_CHILDREN = multiprocessing.get_context("forkserver")
_CHILDREN.set_forkserver_preload(FORKSERVER_PRELOAD)


def start_child(data: Path, output: Path, *overrides: str, resume: bool = False,
                prepare: Callable[[], None] | None = None) -> tuple[multiprocessing.Process, Path]:
    """A process running train.main (its stderr goes to the returned file). `prepare` (picklable: a
    module-level function or object) runs in the child first, e.g. to lower its resource limits."""
    stderr_path = output.parent / f"{output.name}.stderr"
    child = _CHILDREN.Process(
        target=_child, args=(arguments(data, output, *overrides, resume=resume), str(stderr_path), prepare))
    child.start()
    return child, stderr_path


def run_child(data: Path, output: Path, *overrides: str, resume: bool = False,
              prepare: Callable[[], None] | None = None, timeout: float = 120) -> tuple[int, str]:
    child, stderr_path = start_child(data, output, *overrides, resume=resume, prepare=prepare)
    child.join(timeout)
    assert child.exitcode is not None, f"training did not end within {timeout} s"
    return child.exitcode, stderr_path.read_text()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own, out of reach of a
    process-group kill)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_node(node: subprocess.Popen | ForkedCommand) -> None:
    """SIGKILL a launcher and all its workers at once, as a node that loses power."""
    for pid in [node.pid, *descendants(node.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for_log(output: Path, text: str, running: Callable[[], bool], timeout: float = 300) -> None:
    """Until `text` appears in `output`'s training.log; fails if the run ends first (`running()` turns false)."""
    deadline = time.monotonic() + timeout
    log = output / "training.log"
    while text not in (log.read_text() if log.exists() else ""):
        assert running() and time.monotonic() < deadline, f"the run ended, or {timeout} s passed, before {text!r}"
        time.sleep(0.01)


def file_states(folder: Path) -> dict[str, tuple[str, int, int]]:
    """(sha256, mtime in ns, size) of every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): (digest(p), p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_nothing_lost(before: dict[str, tuple[str, int, int]], folder: Path) -> None:
    """Every file is still there, unchanged; training.log may only have grown (a failed start appends),
    and .lock names whichever process held the folder last."""
    after = file_states(folder)
    for name, (sha, mtime, size) in before.items():
        assert name in after, f"{name} was removed"
        if name == LOCK_NAME:
            continue
        if name == "training.log":
            kept = (folder / name).read_bytes()[:size]
            assert hashlib.sha256(kept).hexdigest() == sha, "training.log lost lines"
        else:
            assert after[name] == (sha, mtime, size), f"{name} was changed"


def load_run(output: Path, info: dict | None = None) -> dict:
    """The checkpoint `output/checkpoint.json` names, assembled whole in this process by torch's own
    DCP-to-torch.save converter and plain json: {"model", "config", "world_size", "progress", "backbone",
    "class_centres" (all rows), "optimizer" (state with all centre rows, param_groups), "scheduler",
    "grad_scaler", "per_rank": [{"rng", "loader"} of each rank]}. Asserts the model is `info`."""
    pointer = json.loads((output / POINTER_NAME).read_text())
    folder = output / pointer["directory"]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, f"{tmp}/whole.pt")
        whole = torch.load(f"{tmp}/whole.pt", weights_only=True)
    saved = json.loads((folder / "state.json").read_text())
    run = saved["run"]
    assert pointer["model"] == run["model"] == (info or INFO), (pointer["model"], run["model"])
    return {**{key: run[key] for key in ("model", "config", "world_size", "progress", "scheduler", "grad_scaler")},
            "backbone": torch.load(folder / "backbone.pth", weights_only=True), "class_centres": whole["centres"],
            "optimizer": {"state": {int(index): state for index, state in whole.get("optimizer", {}).items()},
                          "param_groups": run["param_groups"]},
            "per_rank": saved["ranks"]}


def load_backbone_strict(path: Path, info: dict | None = None) -> torch.nn.Module:
    info = info or INFO
    backbone = get_model(info["network"], num_features=info["embedding_size"], **info["network_kwargs"])
    backbone.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return backbone


def scalars(output: Path, tag: str) -> dict[int, float]:
    """step -> value of a TensorBoard scalar over every event file of the run (resumes add files; a
    step logged again replaces the old value, as TensorBoard shows it)."""
    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def same_tensors(a, b) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


TAGS = ("loss", "loss_view1", "loss_view2", "learning_rate")
SAVED_STATE = ("backbone", "class_centres", "optimizer", "scheduler", "grad_scaler", "progress")


def first_difference(a, b, where: str = "") -> str | None:
    """None when `a` and `b` are bitwise equal (as same_tensors), else the path of the first tensor or value
    that differs and how: 'optimizer.state.0.momentum_buffer: 3 of 512 elements differ, the largest by 1e-07'."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {describe(a)} against {describe(b)}"
        if torch.equal(a, b):
            return None
        unequal = a != b
        largest = (a.double() - b.double()).abs()[unequal].nan_to_num(nan=float("inf")).max().item()
        return f"{where}: {int(unequal.sum())} of {a.numel()} elements differ, the largest by {largest:.3g}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"
        return next((d for key in a if (d := first_difference(a[key], b[key], f"{where}.{key}".lstrip("."))) is not
                     None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items against {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{where}[{i}]")) is not
                     None), None)
    return None if a == b else f"{where}: {a!r} against {b!r}"


def describe(value) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__


def run_difference(split: Path, whole: Path, info: dict | None = None) -> str | None:
    """None when the resumed run `split` ended exactly as the uninterrupted run `whole` (logged scalars, every
    saved tensor, each rank's loader position and torch/CUDA generators, backbone.pth), else the first thing
    that differs."""
    for tag in TAGS:
        if (difference := first_difference(scalars(split, tag), scalars(whole, tag), f"logged {tag}")) is not None:
            return difference
    resumed, uninterrupted = load_run(split, info), load_run(whole, info)
    for key in SAVED_STATE:
        if (difference := first_difference(resumed[key], uninterrupted[key], key)) is not None:
            return difference
    for rank, (mine, theirs) in enumerate(zip(resumed["per_rank"], uninterrupted["per_rank"], strict=True)):
        if mine["loader"] != theirs["loader"]:
            return f"rank {rank}'s loader position: {mine['loader']} against {theirs['loader']}"
        # torch's generators draw the sampled centres and dropout masks (on a GPU, CUDA's). Python's and numpy's
        # global generators are seeded by nobody (training draws nothing from them): they differ between any two runs.
        if mine["rng"].keys() != theirs["rng"].keys():
            return f"rank {rank}'s generators: {sorted(mine['rng'])} against {sorted(theirs['rng'])}"
        for generator in sorted({"torch", "cuda"} & mine["rng"].keys()):
            if mine["rng"][generator] != theirs["rng"][generator]:
                return f"rank {rank}'s {generator} generator state"
    return first_difference(load_backbone_strict(split / "backbone.pth", info).state_dict(),
                            load_backbone_strict(whole / "backbone.pth", info).state_dict(), "backbone.pth")


def assert_same_run(split: Path, whole: Path, info: dict | None = None) -> None:
    """The resumed run `split` ended exactly as the uninterrupted run `whole`."""
    difference = run_difference(split, whole, info)
    assert difference is None, difference
