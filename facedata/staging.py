"""Handing batches over one ahead: the next batch is staged (copied to the GPU, or decoded there)
while the training step works on the current one."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

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
