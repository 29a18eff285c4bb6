"""Data path throughput: read + decode + slice + flip + to tensor, from a packed .rec of 112x112
JPEG views (quality 95), V = 1 and V = 2, through pairface's loader with 0, 1 and 2 workers, next
to a straightforward PIL reader of the same records measured in the same run.

    python -m bench.bench_data [--records 2000] [--batch-size 64] [--rounds 3]

Ratios are against the PIL reader at the same V (one process). Each path runs once to warm up
(workers, page cache), then ``--rounds`` times interleaved with the others; the best round counts,
so that a burst of background load on a shared machine hits all paths alike.
"""
from __future__ import annotations

import argparse
import io
import os
import struct
import tempfile
import time

import numpy as np
import torch
from PIL import Image
from torchvision.io import decode_jpeg

from dataset import InsightfaceWriter, build_dataset, build_loader, encode, render_faces, side_by_side

DISTINCT_FACES = 240  # drawn once, reused across records: the bench measures reading, not drawing


def pack_bench_rec(out_dir: str, records: int, views: int) -> None:
    faces = render_faces(np.arange(DISTINCT_FACES) // 4, np.arange(DISTINCT_FACES) % 4, seed=0)
    with InsightfaceWriter(out_dir) as writer:
        per_identity = 4
        for start in range(0, records, per_identity):
            writer.write_identity([
                encode(side_by_side([faces[(start + r + v * 7) % DISTINCT_FACES] for v in range(views)]), quality=95)
                for r in range(min(per_identity, records - start))])


class PlainPILReader:
    """What one writes without thinking about speed: seek + read per record, PIL decode, numpy flip."""

    def __init__(self, folder: str, views: int) -> None:
        self.rec = open(os.path.join(folder, "train.rec"), "rb")
        self.offsets = {}
        with open(os.path.join(folder, "train.idx")) as f:
            for line in f:
                key, offset = line.split()
                self.offsets[int(key)] = int(offset)
        first_identity_key = int(struct.unpack_from("<f", self.raw(0), 8 + 24)[0])
        self.keys = list(range(1, first_identity_key))  # key 0: header (images 1..a-1, then identities)
        self.views = views

    def raw(self, key: int) -> bytes:
        self.rec.seek(self.offsets[key])
        magic, lrec = struct.unpack("<II", self.rec.read(8))
        return struct.pack("<II", magic, lrec) + self.rec.read(lrec & ((1 << 29) - 1))

    def sample(self, key: int, rng: np.random.Generator) -> tuple[torch.Tensor, int]:
        data = self.raw(key)[8:]
        flag, label = struct.unpack_from("<If", data)
        image = np.asarray(Image.open(io.BytesIO(data[24 + 4 * flag:])).convert("RGB"))
        views = [image[:, v * 112:(v + 1) * 112] for v in range(self.views)]
        views = [np.ascontiguousarray(v[:, ::-1]) if rng.random() < 0.5 else v for v in views]
        return torch.from_numpy(np.stack(views)).permute(0, 3, 1, 2).contiguous(), int(label)


def rate_pil(reader: PlainPILReader, keys: list[int]) -> float:
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for key in keys:
        reader.sample(key, rng)
    return len(keys) / (time.perf_counter() - start)


def rate_loader(loader, epoch: int, batch_size: int) -> float:
    loader.set_epoch(epoch)
    start = time.perf_counter()
    batches = sum(1 for _ in loader)
    return batches * batch_size / (time.perf_counter() - start)


def rate_decode_only(payloads: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for payload in payloads:
        decode_jpeg(payload)
    return len(payloads) / (time.perf_counter() - start)


def measure(folder: str, views: int, batch_size: int, rounds: int) -> dict[str, float]:
    """Best records/s of each path over ``rounds`` interleaved passes, so that every path meets
    the same background load."""
    reader = PlainPILReader(folder, views)
    payloads = [torch.frombuffer(bytearray(reader.raw(k)[8 + 24:]), dtype=torch.uint8) for k in reader.keys[:500]]
    ds = build_dataset(folder, num_views=views, flip=True)
    loaders = {workers: build_loader(ds, batch_size, num_workers=workers) for workers in (0, 1, 2)}
    for loader in loaders.values():
        rate_loader(loader, 0, batch_size)  # starts the workers, warms the page cache
    best: dict[str, float] = {}
    for epoch in range(1, rounds + 1):
        results = {"pil": rate_pil(reader, reader.keys), "decode": rate_decode_only(payloads)}
        results.update({f"loader{w}": rate_loader(loader, epoch, batch_size) for w, loader in loaders.items()})
        best = {name: max(rate, best.get(name, 0.0)) for name, rate in results.items()}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2000, help="images per V (records: this / V)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes; the best of each path counts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for views in (1, 2):
            folder = os.path.join(tmp, f"v{views}")
            pack_bench_rec(folder, args.records // views, views)
            best = measure(folder, views, args.batch_size, args.rounds)
            rows.append(("plain PIL reader (1 process)", "-", views, best["pil"], 1.0))
            rows.append(("decode_jpeg alone (no read)", "-", views, best["decode"], best["decode"] / best["pil"]))
            for workers in (0, 1, 2):
                rate = best[f"loader{workers}"]
                rows.append(("pairface loader", str(workers), views, rate, rate / best["pil"]))
    print(f"data path: read + decode + slice + flip + batch, {args.records} 112x112 JPEG (q95) views per V, "
          f"batch {args.batch_size}, best of {args.rounds} interleaved rounds")
    print(f"{os.cpu_count()} CPU cores, shared with other work: absolute rates move with the load, "
          "ratios measured together hold better")
    print(f"{'path':<30} {'workers':>7} {'V':>2} {'records/s':>10} {'images/s':>9} {'x PIL':>6}")
    for path, workers, views, rate, ratio in rows:
        print(f"{path:<30} {workers:>7} {views:>2} {rate:>10.0f} {rate * views:>9.0f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
