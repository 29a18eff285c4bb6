"""Handing batches over ahead of time: the next batch is staged (copied to the GPU, or decoded there)
while the training step works on the current one."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from utils.device import use_device_in_this_thread

Item = TypeVar("Item")
Staged = TypeVar("Staged")


def one_ahead(items: Iterable[Item], stage: Callable[[Item], Staged]) -> Iterator[Staged]:
    """``stage(item)`` for each item, item k + 1 fetched and staged before item k is handed over.

    An error fetching or staging item k + 1 (a bad record) is raised only after item k was handed
    over: the consumer gets every good batch before it, as it would without the staging.
    """
    iterator = iter(items)
    try:
        staged = stage(next(iterator))
    except StopIteration:
        return
    while True:
        failure = None
        try:
            upcoming = stage(next(iterator))
        except StopIteration:
            yield staged
            return
        except Exception as error:  # any error: the batch staged before it is owed to the consumer first
            failure = error
        yield staged
        if failure is not None:
            raise failure
        staged = upcoming


def in_background(items: Iterable[Item], stage: Callable[[Item], Staged], device: torch.device,
                  depth: int = 2) -> Iterator[Staged]:
    """``stage(item)`` for each item, fetched and staged by a thread of its own up to ``depth`` items ahead,
    with ``device`` as that thread's current device.

    For staging that takes as long as a step (decoding a batch): on the consumer's thread it would sit
    between steps however early it starts, on its own thread it runs while the step does. Items are
    handed over in order; an error fetching or staging one is raised where that item would have been
    handed over, after every good one before it. Closing the iterator stops the thread.
    """
    handed: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry: tuple[bool, object]) -> bool:
        while not stop.is_set():
            try:
                handed.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        iterator = iter(items)
        try:
            use_device_in_this_thread(device)
            for item in iterator:
                if not put((True, stage(item))):
                    return
            put((True, StopIteration()))
        except Exception as error:  # handed to the consumer, in its place in the order
            put((False, error))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # releases a DataLoader's workers from the thread that iterated them

    thread = threading.Thread(target=produce, name="batch staging", daemon=True)
    thread.start()
    try:
        while True:
            good, value = handed.get()
            if not good:
                raise value
            if isinstance(value, StopIteration):
                return
            yield value
    finally:
        stop.set()
        thread.join()


class SideStream:
    """Runs a batch's host-to-device work on a side CUDA stream; ``hand_over`` makes the compute
    stream wait for it, so that the work overlaps the step before."""

    def __init__(self, device: torch.device, work: Callable[[Item], tuple[torch.Tensor, ...]]) -> None:
        self.device, self.work = device, work
        self.stream = torch.cuda.Stream(device)

    def stage(self, batch: Item) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            tensors = self.work(batch)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return tensors, ready

    def hand_over(self, staged: tuple[tuple[torch.Tensor, ...], torch.cuda.Event]) -> tuple[torch.Tensor, ...]:
        tensors, ready = staged
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(current)  # the allocator must not reuse this memory before compute ends
        return tensors
