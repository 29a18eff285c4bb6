"""The training loader: a seeded distributed order, batches on the device, any step a starting point.

The order of an epoch is exactly ``DistributedSampler(shuffle=True, drop_last=True, seed=seed)``'s.
Each index travels to the workers together with its epoch, so a sample's randomness never depends
on worker state. Where a run stands in the data is a function of its optimizer step alone
(``steps(start, ...)``), so a resumed run gets the very batches the uninterrupted run got next.
The workers decode, or (``gpu_decode``) hand over JPEG bytes that the training process decodes a
batch at a time on the GPU (facedata/device_decode.py), on a thread and a CUDA stream of its own;
either way the next batch is staged while the current one is in use (facedata/staging.py).
"""
from __future__ import annotations

import atexit
import logging
import signal
import weakref
from collections.abc import Iterator
from functools import partial

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from facedata.device_decode import decode_batch
from facedata.faces import FaceDataset
from facedata.staging import SideStream, in_background, one_ahead
from utils.errors import DataError

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]  # images uint8 (B, V, 3, H, W), labels int64 (B,)


class EpochOrder:
    """This rank's sample indices per epoch, cut into batches, starting at a given batch."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int,
                 drop_last: bool) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size, self.seed, self.drop_last = rank, world_size, seed, drop_last
        self.epoch, self.start_batch = 0, 0
        self.per_rank = num_samples // world_size

    def __len__(self) -> int:
        full, rest = divmod(self.per_rank, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def indices(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_samples, generator=generator)
        return order[:self.per_rank * self.world_size][self.rank::self.world_size]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        indices = self.indices(self.epoch).tolist()
        for batch in range(self.start_batch, len(self)):
            yield [(self.epoch, i) for i in indices[batch * self.batch_size:(batch + 1) * self.batch_size]]


class _EpochIndexed(Dataset):
    """Maps ``(epoch, index)`` to ``dataset.load(index, epoch)`` (or ``.encoded``) inside the workers."""

    def __init__(self, dataset: FaceDataset, encoded: bool) -> None:
        self.dataset, self.encoded = dataset, encoded

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, epoch_index: tuple[int, int]):
        epoch, index = epoch_index
        try:
            return self.dataset.encoded(index, epoch) if self.encoded else self.dataset.load(index, epoch)
        except DataError as error:
            # Returned, not raised: a DataLoader worker re-raises its exceptions with the worker's
            # whole traceback pasted into the message, and the user is owed the one sentence.
            return error


def _first_error(samples: list) -> DataError | None:
    """The first DataError among a batch's samples, which the training process raises."""
    return next((sample for sample in samples if isinstance(sample, DataError)), None)


def _collate(samples: list):
    """A batch, or the first DataError among its samples."""
    return _first_error(samples) or default_collate(samples)


def _collate_encoded(samples: list):
    """The list of encoded samples, or the first DataError among them."""
    return _first_error(samples) or samples


def _ignore_stop_signals(worker_id: int) -> None:
    """A Ctrl-C on the terminal, or a scheduler's SIGTERM to every process of a job, reaches the data workers
    too: they leave stopping to the training process, which ends them itself once it has stopped cleanly."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, signal.SIG_IGN)


def _raise_errors(batches):
    for batch in batches:
        if isinstance(batch, DataError):
            raise batch
        yield batch


class FaceLoader:
    """Iterates ``(images uint8 (B, V, 3, 112, 112), labels int64 (B,))`` already on ``device``.

    ``decode_on_device``: the workers hand over JPEG bytes and this process decodes each batch on
    ``device`` (nvJPEG on a GPU); the batches are the same as with decoding in the workers.
    """

    def __init__(self, dataset: FaceDataset, batch_size: int, rank: int, world_size: int, seed: int, num_workers: int,
                 device: torch.device, drop_last: bool, decode_on_device: bool = False) -> None:
        if decode_on_device and dataset.encoded_refusal() is not None:
            raise ValueError(f"decode_on_device cannot be used here: {dataset.encoded_refusal()}")
        self.dataset, self.device, self.decode_on_device = dataset, device, decode_on_device
        self.order = EpochOrder(len(dataset), batch_size, rank, world_size, seed, drop_last)
        if len(self.order) == 0:
            raise DataError(f"the dataset's {len(dataset)} samples give rank {rank} of {world_size} no batch of "
                             f"{batch_size}; lower batch_size or use more data")
        pin = device.type == "cuda" and not decode_on_device  # encoded samples go to nvJPEG from pageable memory
        # Its own generator: a DataLoader draws a worker seed each time it starts iterating, and from
        # torch's global generator that draw would shift the centre sampling and dropout of the steps
        # after every epoch start, which a run resumed at an epoch end does not replay.
        collate = _collate_encoded if decode_on_device else _collate
        self._loader = DataLoader(_EpochIndexed(dataset, encoded=decode_on_device), batch_sampler=self.order,
                                  num_workers=num_workers, collate_fn=collate, pin_memory=pin,
                                  persistent_workers=num_workers > 0, generator=torch.Generator().manual_seed(seed),
                                  worker_init_fn=_ignore_stop_signals)
        self.skipped = 0
        _open_loaders.add(self)

    def __len__(self) -> int:
        return len(self.order)

    def __enter__(self) -> FaceLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """End the data workers now, and wait for them (within seconds): on any way out of training.

        The workers outlive an epoch (persistent) and ignore SIGTERM, so left to the interpreter's exit they
        are never ended: multiprocessing's exit handler sends them SIGTERM and then waits for them without a
        limit. An error that stops the run also keeps this loader alive in its traceback's reference cycle,
        past the point where torch would end them itself. Iterating again afterwards starts new workers."""
        _open_loaders.discard(self)
        iterator, self._loader._iterator = self._loader._iterator, None  # torch's persistent-workers iterator
        workers = getattr(iterator, "_workers", [])
        if iterator is not None:
            iterator._shutdown_workers()  # tells the workers to stop and waits a few seconds for each
        for worker in workers:
            if worker.is_alive():  # still busy with a batch, and deaf to the SIGTERM torch then sent
                worker.kill()
                worker.join()

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter(loader)`` walks, as a DataLoader's sampler.set_epoch."""
        self.order.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        return self.batches(self.order.epoch)

    def batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """The batches of ``epoch`` from batch number ``start`` on."""
        self.order.epoch, self.order.start_batch = epoch, start
        for images, labels, skipped in self._staged(_raise_errors(self._loader)):
            self._note_skipped(int(skipped.sum()))
            yield images, labels

    def _staged(self, batches):
        """(images, labels, skipped) on the device, each batch staged while the one before is in use: copies
        on this thread (they only queue work), decoding on a thread of its own (it takes as long as a step)."""
        if self.decode_on_device:
            work, ahead = self._decode, partial(in_background, device=self.device)
        else:
            work, ahead = self._to_device, one_ahead
        if self.device.type != "cuda":
            return ahead(batches, work)
        side = SideStream(self.device, work)
        return map(side.hand_over, ahead(batches, side.stage))

    def _decode(self, samples):
        return decode_batch(samples, self.dataset, self.device)

    def _to_device(self, batch):
        images, labels, skipped = batch
        return images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True), skipped

    def steps(self, start: int, stop: int, batches_per_step: int = 1) -> Iterator[list[Batch]]:
        """The micro-batches of optimizer steps ``start`` .. ``stop - 1``, one list per step.

        An epoch holds ``len(self) // batches_per_step`` steps; batches left over at its end are
        dropped, as the sampler drops a short batch. The data workers of an epoch are released
        when it ends, and when the caller stops early.
        """
        per_epoch = len(self) // batches_per_step
        for epoch in range(start // per_epoch, -(-stop // per_epoch)):
            first, last = max(start, epoch * per_epoch), min(stop, (epoch + 1) * per_epoch)
            batches = self.batches(epoch, (first - epoch * per_epoch) * batches_per_step)
            try:
                for _ in range(first, last):
                    yield [next(batches) for _ in range(batches_per_step)]
            finally:
                batches.close()

    def _note_skipped(self, count: int) -> None:
        if count:
            self.skipped += count
            log.warning("%d bad records skipped in this batch, %d so far", count, self.skipped)

    def state_dict(self) -> dict:
        """What the position (a function of the step) does not tell: the count of skipped records."""
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = state["skipped"]


_open_loaders: weakref.WeakSet[FaceLoader] = weakref.WeakSet()


@atexit.register  # registered after multiprocessing's and torch's exit handlers, so it runs before them
def _close_open_loaders() -> None:
    """A loader its user never closed (a script, a test, a notebook) ends its workers at exit too."""
    for loader in list(_open_loaders):
        loader.close()


def build_loader(dataset: FaceDataset, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 num_workers: int = 2, device: torch.device | str = "cpu", drop_last: bool = True,
                 gpu_decode: bool = False) -> FaceLoader:
    """The loader over ``dataset`` (a :class:`FaceDataset`) for this rank: ``len()`` batches per epoch.

    ``gpu_decode`` (arcface_torch's ``dali``): JPEG decoded on the GPU by this process, where there is a
    GPU and the dataset's images are JPEG files; otherwise it says why once and decodes in the workers.
    """
    if not 0 <= rank < world_size or batch_size < 1:
        raise ValueError(f"rank {rank} of world_size {world_size} with batch_size {batch_size} is not a valid setup")
    device = torch.device(device)
    return FaceLoader(dataset, batch_size, rank, world_size, seed, num_workers, device, drop_last,
                      decode_on_device=gpu_decode and _can_decode_on(dataset, device))


def _can_decode_on(dataset: FaceDataset, device: torch.device) -> bool:
    if device.type != "cuda":
        log.warning("dali=True but no GPU: decoding JPEG on the CPU, in the data workers")
        return False
    refusal = dataset.encoded_refusal()
    if refusal is not None:
        log.warning("dali=True but %s: decoding on the CPU, in the data workers", refusal)
        return False
    return True
