"""GPU decoding (arcface_torch's `dali = True`): the time to decode a batch, and whether the loader's
decoding overlaps the training step.

    python -m bench.decode_overlap --device cuda --rec data/synthetic_pair [--batch-size 128]
    python -m bench.decode_overlap --rec data/synthetic_pair          # CPU decoder: a smoke test

decode: facedata.device_decode.decode_batch of one batch alone, waited for, the median of a few.
overlap: the loader (decoding on its own thread and stream) feeds a stand-in step, a fixed device
workload about as long as one decode that uses each batch. Per batch the loop takes about
max(decode, step) when the two overlap and decode + step when they do not; the share of the shorter
one hidden, (decode + step - loop) / min(decode, step), is printed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dataset import FaceLoader, build_dataset
from facedata.device_decode import decode_batch

WARMUP_BATCHES = 3


def wait_for(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(work, device: torch.device) -> float:
    """Seconds `work()` takes, the device's queue drained before and after."""
    wait_for(device)
    start = time.perf_counter()
    work()
    wait_for(device)
    return time.perf_counter() - start


def decode_seconds(dataset, batch_size: int, device: torch.device, repeats: int = 5) -> float:
    """Median time to decode one batch on `device`, the encoded samples read beforehand."""
    samples = [dataset.encoded(index, 0) for index in range(batch_size)]
    times = [timed(lambda: decode_batch(samples, dataset, device), device) for _ in range(repeats + 1)]
    return statistics.median(times[1:])  # the first: nvJPEG's set-up


def stand_in_step(seconds: float, device: torch.device):
    """A device workload of about `seconds` that depends on the batch it is given: matrix products."""
    size = 2048 if device.type == "cuda" else 256
    weights = torch.randn(size, size, device=device) / size ** 0.5
    state = torch.randn(size, size, device=device)

    def step(images: torch.Tensor, repeats: int) -> None:
        nonlocal state
        state = state + images.float().mean() * 1e-6
        for _ in range(repeats):
            state = torch.tanh(state @ weights)

    per_repeat = timed(lambda: step(torch.zeros(1, device=device), 10), device) / 10
    repeats = max(1, round(seconds / per_repeat))
    return lambda images: step(images, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rec", required=True, help="a folder with train.rec/train.idx of JPEG records")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--views", type=int, default=2)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # on a CPU the step and the decoding thread then take a core each
    device = torch.device(args.device)
    dataset = build_dataset(args.rec, num_views=args.views)
    decode = decode_seconds(dataset, args.batch_size, device)
    step = stand_in_step(decode, device)
    step_seconds = statistics.median(timed(lambda: step(torch.zeros(1, device=device)), device) for _ in range(5))

    loader = FaceLoader(dataset, args.batch_size, 0, 1, 0, args.workers, device, True, decode_on_device=True)
    batches = (batch for micro_batches in loader.steps(0, WARMUP_BATCHES + args.batches) for batch in micro_batches)
    for _, (images, _) in zip(range(WARMUP_BATCHES), batches):
        step(images)
    loop = timed(lambda: [step(images) for images, _ in batches], device) / args.batches
    hidden = (decode + step_seconds - loop) / min(decode, step_seconds)
    print(f"decode {decode * 1e3:.1f} ms/batch of {args.batch_size} x {args.views} views on {device}, step "
          f"{step_seconds * 1e3:.1f} ms, loop {loop * 1e3:.1f} ms/batch: {min(max(hidden, 0.0), 1.0):.0%} of the "
          "shorter one hidden")
    return 0


if __name__ == "__main__":
    sys.exit(main())
