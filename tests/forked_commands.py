"""`python ...` and `torchrun ...` command lines for the tests, without the interpreter starts.

A command line the tests run (`python train.py ...`, `python -m tests.nan_injection ...`, `python -m
torch.distributed.run ... train.py ...`) costs seconds of CPU before it does anything: each process imports
torch (a torchrun of two workers: three imports). Most of the suite's CPU went there. Here the same command
runs in a process forked from the tests' forkserver (tests/run_helpers.py), which has imported train.py and
what its runs import on first use (DCP, torchvision, scikit-learn, TensorBoard) and run nothing:

- `python SCRIPT ARGS` / `python -m MODULE ARGS` runs the script or module as `__main__` with `sys.argv` as
  Python sets it (runpy, as the interpreter itself does), in the command's folder, environment, process
  group and with its stdout and stderr in files, and ends as the interpreter ends: it waits for its threads
  that are not daemons, then runs its exit handlers.
- `python -m torch.distributed.run ...` runs torchrun's own `main` (its argument parser, rendezvous, agent
  store, monitoring, restarts, signal forwarding and failure report) with one change: its workers are forked
  from the agent and run the script as above, instead of each starting an interpreter. Each worker starts a
  session of its own, as torchrun's workers do.

What a test reads is what the command line gives: the exit status (negative for a signal), stdout, stderr,
the process tree below it. Tests of the launchers themselves (the installed scripts, srun, the compatibility
tier's torchrun) still start the real command line.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import resource
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def run_python(arguments: Sequence[str]) -> None:
    """What `python -u ARGUMENTS` does in a fresh interpreter, in this one: the script or module as
    `__main__`. Returns normally only when it does (exit status 0); SystemExit passes through."""
    if arguments and arguments[0] == "-u":
        arguments = arguments[1:]
    if arguments[0] == "-m":
        sys.path.insert(0, os.getcwd())
        sys.argv = [arguments[1], *arguments[2:]]  # runpy puts the module's path in sys.argv[0]
        runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(arguments[0]).resolve().parent))
        sys.argv = list(arguments)
        runpy.run_path(arguments[0], run_name="__main__")


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def fresh_signal_handlers() -> None:
    """The handlers of the signals a launcher or the tests send, as a new interpreter started from a terminal has
    them (whatever the tests' own: a test sends Ctrl-C as a user would, also when the suite runs under nohup)."""
    for number in SIGNALS:
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_as_the_interpreter_does() -> None:
    """What the interpreter does on its way out and a forked process's os._exit does not: wait for every thread
    that is not a daemon, then run the exit handlers (Py_FinalizeEx's order)."""
    threading._shutdown()  # (no public equivalent)
    atexit._run_exitfuncs()


def _torchrun_worker(*arguments: str) -> None:
    """One torchrun worker: what `python -u SCRIPT ARGS` would run, in a session of its own as torchrun starts
    its workers (a signal to the launcher's process group does not reach them)."""
    os.setsid()
    fresh_signal_handlers()  # not the agent's, which turn SIGTERM into an exception
    # A test that finds a worker hung ends it with SIGABRT: every thread's Python stack then ends the command's
    # output (and no core file lands in the repository, the worker's folder).
    faulthandler.enable(all_threads=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        run_python(arguments)
    finally:
        exit_as_the_interpreter_does()


def _torchrun(arguments: Sequence[str]) -> None:
    """torchrun's main with its workers forked from this process (already holding train.py's imports)."""
    import torch.distributed.run as torchrun  # noqa: PLC0415 (a forked command's own import, not the helpers')

    command_of = torchrun.config_from_args

    def forked_workers(args):
        config, _, command = command_of(args)  # command: ["-u", SCRIPT or "-m" MODULE, ...]
        config.start_method = "fork"
        return config, _torchrun_worker, command

    torchrun.config_from_args = forked_workers
    torchrun.main(list(arguments))


def _command(argv: list[str], cwd: str, environment: dict[str, str], stdout: str, stderr: str,
             own_group: bool, prepare: Callable[[], None] | None) -> None:
    """The forked process: `argv` (`sys.executable` first) as a command line would run it; exits with its status.
    `prepare` runs first, as subprocess.Popen's preexec_fn does."""
    if own_group:
        os.setpgid(0, 0)
    fresh_signal_handlers()
    for path, flags, fd in ((os.devnull, os.O_RDONLY, 0), (stdout, os.O_WRONLY | os.O_APPEND, 1),
                            (stderr, os.O_WRONLY | os.O_APPEND, 2)):
        file = os.open(path, flags)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED as run_helpers sets it for a real start
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    if prepare is not None:
        prepare()
    status = 0
    try:
        if argv[1:3] == ["-m", "torch.distributed.run"]:
            _torchrun(argv[3:])
        else:
            run_python(argv[1:])
    except SystemExit as stop:  # as the interpreter ends on it: a number is the status, anything else is printed
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            sys.stderr.write(f"{stop.code}\n")
            status = 1
    except BaseException as error:  # what the interpreter prints for an uncaught exception, and its status
        traceback.print_exc()
        status = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    exit_as_the_interpreter_does()
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:  # Python ends itself with SIGINT after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


class ForkedCommand:
    """A command line running in a forked process, used as a `subprocess.Popen` with text pipes is (pid, poll,
    wait, communicate, send_signal, kill, returncode): what the tests call."""

    def __init__(self, context, argv: Sequence[str], cwd: str, environment: Mapping[str, str],
                 own_group: bool = False, prepare: Callable[[], None] | None = None, output: str | None = None):
        """`output`: a file for stdout and stderr together (then `communicate` returns none), to read as it runs."""
        self.args = list(argv)
        self._folder = tempfile.TemporaryDirectory(prefix="forked-command-")
        self._out, self._err = (output, output) if output else (
            os.path.join(self._folder.name, name) for name in ("stdout", "stderr"))
        for path in (self._out, self._err):
            Path(path).touch()  # there to read, whatever becomes of the process
        self._process = context.Process(target=_command, args=(self.args, str(cwd), environment, self._out,
                                                               self._err, own_group, prepare))
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._out == self._err:
            return "", ""
        return Path(self._out).read_text(errors="replace"), Path(self._err).read_text(errors="replace")

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
