"""arcface_torch's ``dali=True`` (decoding on the GPU) without DALI.

The data workers read each sample's JPEG bytes and make its draws (identity picks, flips,
dali_aug, crop_scale, erase_p) exactly as for decoding in the workers; the training process decodes
a whole batch in one nvJPEG call, then cuts, flips and augments the views on the GPU with those
draws. A batch is therefore the one the workers would have built, up to the two JPEG decoders'
rounding, for any number of workers and from any resume point.
"""
from __future__ import annotations

import torch

from facedata.faces import Encoded, FaceDataset
from facedata.images import decode_jpegs
from utils.image import IMAGE_SIZE


def decode_batch(samples: list[Encoded], dataset: FaceDataset, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(images uint8 (B, V, 3, 112, 112) on ``device``, labels (B,) on ``device``, records skipped (B,)).

    A sample with a JPEG the decoder refuses is rebuilt by ``dataset.load`` on the CPU, which skips
    the record or raises its DataError exactly as a data worker would have.
    """
    pieces = _decode_pieces(samples, device)
    good = [s for s, decoded in enumerate(pieces) if decoded is not None]
    batch = torch.empty((len(samples), dataset.num_views, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8, device=device)
    if good:
        batch[good] = _finished_views([samples[s] for s in good], [pieces[s] for s in good], dataset, device)
    labels, skipped = [sample.label for sample in samples], [sample.skipped for sample in samples]
    for s in sorted(set(range(len(samples))) - set(good)):
        rebuilt, labels[s], skipped[s] = dataset.load(samples[s].index, samples[s].epoch)
        batch[s] = rebuilt.to(device)
    return batch, torch.tensor(labels, dtype=torch.int64).to(device), torch.tensor(skipped)


def _finished_views(samples: list[Encoded], pieces: list[list[torch.Tensor]], dataset: FaceDataset,
                    device: torch.device) -> torch.Tensor:
    """(n, V, 3, H, W): the samples' views cut from their decoded pieces, flipped, and (crop_scale,
    dali_aug, erase_p) augmented with the workers' draws, the whole batch at once."""
    views = torch.stack([view for sample, decoded in zip(samples, pieces)
                         for piece, index in zip(decoded, sample.piece_indices) for view in dataset.cut(piece, index)])
    flips = torch.tensor([flip for sample in samples for flip in sample.flips], device=device)
    views = torch.where(flips[:, None, None, None], views.flip(-1), views)
    augments = [aug for sample in samples for aug in sample.augments] if dataset.dali_aug else None
    crop_erase = [draw for sample in samples for draw in sample.crop_erase] if dataset.crops_or_erases else None
    views = dataset.augment(views, augments, crop_erase)
    return views.unflatten(0, (len(samples), dataset.num_views))


def _decode_pieces(samples: list[Encoded], device: torch.device) -> list[list[torch.Tensor] | None]:
    """Each sample's pieces decoded on ``device``, or None for a sample with a JPEG the decoder refuses."""
    decoded = [[piece.to(device) if isinstance(piece, torch.Tensor) else None for piece in sample.pieces]
               for sample in samples]
    jpegs = [(s, p) for s, sample in enumerate(samples) for p, piece in enumerate(sample.pieces)
             if isinstance(piece, bytes)]
    payloads = [torch.frombuffer(bytearray(samples[s].pieces[p]), dtype=torch.uint8) for s, p in jpegs]
    if not payloads:
        return decoded
    try:
        images = decode_jpegs(payloads, device)
    except RuntimeError:
        # One bad image fails the whole batched call: find the bad ones one at a time.
        images = [_decode_or_none(payload, device) for payload in payloads]
    for (s, p), image in zip(jpegs, images):
        decoded[s][p] = image
    return [None if any(image is None for image in pieces) else pieces for pieces in decoded]


def _decode_or_none(payload: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    try:
        return decode_jpegs([payload], device)[0]
    except RuntimeError:
        return None
