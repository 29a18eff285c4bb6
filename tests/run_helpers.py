"""Running train.py for the reliability tests and reading back what a run left.

Every test launches training through this module, in one of three ways, all taking the same
`--set` overrides on top of `base` (QUIET unless a test needs other settings): `run_here` calls
`train.main` in this process (no import cost: a few tenths of a second per start), `start_child` /
`run_child` fork a process that runs it (so a test can SIGKILL it or limit its file sizes), and
`start_cli` / `run_cli` run the real command line as `python train.py` or through torchrun. The run's settings
(CONFIG, QUIET, arguments) and what reads a run back (load_run, scalars, run_difference, ...) are
gpu_acceptance/runs.py's, which the device check's resume row shares.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

import train
from checkpoint.run_dir import LOCK_NAME
from gpu_acceptance.runs import CONFIG, QUIET, arguments, run_difference
from tests.distributed_helpers import FORKSERVER_PRELOAD
from tests.forked_commands import ForkedCommand

ROOT = Path(__file__).resolve().parent.parent


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


def run_here(data: Path, output: Path, *overrides: str, resume: bool = False, config: str = CONFIG,
             base: Sequence[str] = QUIET, stdout: io.StringIO | None = None,
             flags: Sequence[str] = ()) -> tuple[int, str]:
    """train.main in this process: (exit status, what it wrote to stderr); what it wrote to stdout (the
    terminal's log lines) goes to ``stdout`` when given. `flags`: more options of train.py (--start-over)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stderr = io.StringIO()
    try:
        with contextlib.chdir(ROOT), contextlib.redirect_stderr(stderr), \
                contextlib.redirect_stdout(stdout or io.StringIO()):
            status = train.main([*arguments(data, output, *overrides, resume=resume, config=config, base=base),
                                 *flags])
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


def same_tensors(a, b) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_run(split: Path, whole: Path, info: dict | None = None) -> None:
    """The resumed run `split` ended exactly as the uninterrupted run `whole`."""
    difference = run_difference(split, whole, info)
    assert difference is None, difference
