"""Saves off the critical path: a save copies the state to host memory at a step boundary (the only
part the step waits for), and a thread writes and publishes that copy while training goes on.

The host buffers are kept from one save to the next (the memory plan counts them as
`checkpoint_staging`); at most one save is in flight, so one set of buffers serves every save.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from utils.device import use_device_in_this_thread


class HostStaging:
    """Host copies of one save's tensors, in buffers reused by every save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values now, in this staging's buffer for `name` (pinned when the tensor is on a GPU)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[name] = buffer
        buffer.copy_(tensor.detach())
        return buffer


class BackgroundSave:
    """`write()` running in a thread with `device` as its current device; wait() returns its result or
    raises its error."""

    def __init__(self, write: Callable[[], Path], device: torch.device) -> None:
        self._result: Path | None = None
        self._error: BaseException | None = None
        # A daemon: a process that stops on an error does not wait for the write, which leaves the
        # previous checkpoint published (the write publishes only at its very end).
        self._thread = threading.Thread(target=self._run, args=(write, device), name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], Path], device: torch.device) -> None:
        try:
            use_device_in_this_thread(device)
            self._result = write()
        except BaseException as error:  # handed to the training thread, which reports it
            self._error = error

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
