"""Stopping a run between two steps, on a signal: a scheduler's preemption notice or the user's Ctrl-C.

SIGTERM and SIGUSR1 (what SLURM, Kubernetes and spot-instance notices send; torchrun forwards
SIGTERM to every worker) ask the run to save a checkpoint and stop; SIGINT (Ctrl-C) asks it to stop
without saving, and a second Ctrl-C stops it at once. A change of the project's code on disk under the
running process (utils/source_watch.py, checked at step boundaries about once a second) asks it to save and
stop too: it saves with the code it started with, and a resume runs the new code. A signal only records
the request: the training loop reads it at each step boundary, where every rank agrees on the strongest
request any rank received (a signal to one rank stops them all at the same step), so no signal ever lands in the
middle of a step or of a save. Repeated SIGTERMs or SIGUSR1s, as a scheduler or torchrun may send them
while the run saves, change nothing. Before the steps begin, and after they end, there is nothing to
wait for: a Ctrl-C stops the run at once (KeyboardInterrupt); a SIGTERM before the first step stops it
after that step, and one after the last step changes nothing (the final checkpoint is saved by then).
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from enum import IntEnum
from types import FrameType, TracebackType

import torch

from utils.distributed import all_reduce_max, host_group
from utils.source_watch import SourceWatch

log = logging.getLogger(__name__)

EXIT_PREEMPTED = os.EX_TEMPFAIL  # 75, "temporary failure: try again", for a scheduler to requeue on
# 74, "input/output error": a stop that promised a checkpoint and could not save it (its line says why); the
# previous checkpoint is whole, and a resume trains again the steps after it
EXIT_SAVE_FAILED = os.EX_IOERR
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, what a shell reports for a command stopped by Ctrl-C


class StopRequest(IntEnum):
    """What the signals received ask of the run; ranks agree on the largest."""

    NONE = 0
    INTERRUPT = 1     # Ctrl-C: stop at the step boundary without saving
    CODE_CHANGED = 2  # the project's code changed on disk: save at the step boundary, then stop
    PREEMPT = 3       # SIGTERM, SIGUSR1: save a checkpoint at the step boundary, then stop

    @property
    def saves(self) -> bool:
        return self >= StopRequest.CODE_CHANGED


_REQUESTS = {signal.SIGINT: StopRequest.INTERRUPT, signal.SIGTERM: StopRequest.PREEMPT,
             signal.SIGUSR1: StopRequest.PREEMPT}


class RunStopped(Exception):
    """The run stopped at a step boundary because a signal asked it to; `exit_code` says how."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """While inside `with StopSignals() as signals:`, SIGTERM, SIGUSR1 and SIGINT are requests that
    `signals.strongest_request()` turns into one decision for every rank; outside, they act as they did before,
    except that once a stop was asked for, the process ignores SIGTERM and SIGUSR1 until it exits.

    `watch`: the project's sources as the process started with them, checked at step boundaries (CODE_CHANGED).
    Collective to create (it may create the process group that carries the decision)."""

    def __init__(self, watch: SourceWatch | None = None) -> None:
        self.requested = StopRequest.NONE
        self.signal_name = ""  # the signal that asked for a save ("SIGTERM"), for the stop's line
        self.changed_sources: list[str] = []  # what CODE_CHANGED found
        self._watch = watch
        self.stepping = False  # set by the training loop while it runs steps: a Ctrl-C waits for the step's end
        self._interrupted = False
        self._group = host_group()
        self._previous: dict[int, object] = {}
        # The handler runs between two bytecodes of the main thread, which may be inside a log write (a
        # buffered stream refuses a reentrant write: "Logging error"). It only queues what it has to say
        # (SimpleQueue.put is reentrant); this thread logs it once the interrupted write is done, and before the
        # step boundary that acts on it says anything.
        self._announcements: queue.SimpleQueue[str | threading.Event | None] = queue.SimpleQueue()
        self._announcer = threading.Thread(target=self._announce, name="stop-announcer", daemon=True)

    def __enter__(self) -> StopSignals:
        self._announcer.start()
        self._previous = {number: signal.signal(number, self._receive) for number in _REQUESTS}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for number, handler in self._previous.items():
            # A process stopped by a signal has saved and is leaving: a later SIGTERM (torchrun ends the other
            # workers as soon as one exits, a scheduler may repeat itself) must not cut its exit short.
            stopping = self.requested != StopRequest.NONE and number != signal.SIGINT
            signal.signal(number, signal.SIG_IGN if stopping else handler)
        self._announcements.put(None)
        self._announcer.join()

    def _announce(self) -> None:
        while (item := self._announcements.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()  # everything queued before it has been logged
            else:
                log.info(item)

    def _wait_for_announcements(self) -> None:
        said = threading.Event()
        self._announcements.put(said)
        said.wait()

    def _receive(self, number: int, frame: FrameType | None) -> None:
        if number == signal.SIGINT:
            if self._interrupted or not self.stepping:
                raise KeyboardInterrupt  # nothing to wait for, or the user insists: every file written stays whole
            self._interrupted = True
            if self.requested == StopRequest.PREEMPT:
                self._announcements.put("Ctrl-C: the checkpoint asked for first is saved before the run stops "
                                        "(Ctrl-C again stops at once, without it)")
        request = _REQUESTS[number]
        if request <= self.requested:
            return
        self.requested = request
        if request == StopRequest.PREEMPT:
            self.signal_name = signal.Signals(number).name
        if not self.stepping:  # before the first step (which it stops after) or after the last: nothing to say
            return
        if request == StopRequest.INTERRUPT:
            self._announcements.put("Ctrl-C: stopping after this step without saving (Ctrl-C again stops at once; "
                                    "SIGTERM or SIGUSR1 instead would save first)")
        else:
            name = signal.Signals(number).name
            self._announcements.put(f"{name}: saving a checkpoint after this step, then stopping")

    def describe_changes(self) -> str:
        """The changed sources that asked this process to stop (CODE_CHANGED), in a few words."""
        return self._watch.describe(self.changed_sources) if self._watch else ""

    def strongest_request(self) -> StopRequest:
        """The strongest request any rank has received. Collective: every rank calls it at each step boundary.

        It travels through a host-side (gloo) group, so that asking costs the step no wait for the device."""
        if self._watch is not None and self.requested < StopRequest.CODE_CHANGED and self._watch.due():
            self.changed_sources = self._watch.changed()
            if self.changed_sources:
                self.requested = StopRequest.CODE_CHANGED
        if self.requested != StopRequest.NONE:
            self._wait_for_announcements()  # this rank's signal line comes before what the stop writes
        strongest = StopRequest(int(all_reduce_max(torch.tensor(float(self.requested)), group=self._group).item()))
        # A rank stopping for another rank's signal is stopped too: it also ignores SIGTERMs on its way out.
        self.requested = max(self.requested, strongest)
        return strongest
