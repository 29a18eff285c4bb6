"""Data path throughput: read + decode + slice + flip + to tensor, from a packed .rec of 112x112
JPEG views (quality 95), V = 1 and V = 2, through pairface's loader with 0, 1 and 2 workers, next
to a straightforward PIL reader of the same records measured in the same run.

    python bench/bench_data.py [--records 3000] [--batch-size 64]

Ratios are against the PIL reader at the same V (one process). Timings are of a second pass over
the data (the first warms workers and the page cache). On a shared machine, absolute numbers move
with the load; the ratios measured in one run are what to compare.
"""
from __future__ import annotations

import argparse
import io
import os
import struct
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image
from torchvision.io import decode_jpeg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataset import build_dataset, build_loader  # noqa: E402
from facedata.packing import InsightfaceWriter, encode, side_by_side  # noqa: E402
from facedata.synthetic import render_faces  # noqa: E402

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
        self.keys = sorted(self.offsets)[1:]  # key 0 is the header; identity records follow the images
        self.views = views

    def _raw(self, key: int) -> bytes:
        self.rec.seek(self.offsets[key])
        magic, lrec = struct.unpack("<II", self.rec.read(8))
        return struct.pack("<II", magic, lrec) + self.rec.read(lrec & ((1 << 29) - 1))

    def sample(self, key: int, rng: np.random.Generator) -> tuple[torch.Tensor, int]:
        data = self._raw(key)[8:]
        flag, label = struct.unpack_from("<If", data)
        image = np.asarray(Image.open(io.BytesIO(data[24 + 4 * flag:])).convert("RGB"))
        views = [image[:, v * 112:(v + 1) * 112] for v in range(self.views)]
        views = [np.ascontiguousarray(v[:, ::-1]) if rng.random() < 0.5 else v for v in views]
        return torch.from_numpy(np.stack(views)).permute(0, 3, 1, 2).contiguous(), int(label)


def time_pil(folder: str, views: int, images: int) -> float:
    reader = PlainPILReader(folder, views)
    keys = [k for k in reader.keys if k <= images // views]
    rng = np.random.default_rng(0)
    for key in keys[:50]:
        reader.sample(key, rng)
    start = time.perf_counter()
    for key in keys:
        reader.sample(key, rng)
    return len(keys) / (time.perf_counter() - start)


def time_loader(folder: str, views: int, workers: int, batch_size: int) -> float:
    ds = build_dataset(folder, num_views=views, flip=True)
    loader = build_loader(ds, batch_size, num_workers=workers, drop_last=True)
    for epoch in range(2):
        loader.set_epoch(epoch)
        start = time.perf_counter()
        batches = sum(1 for _ in loader)
        elapsed = time.perf_counter() - start
    return batches * batch_size / elapsed


def time_decode_only(folder: str, views: int) -> float:
    reader = PlainPILReader(folder, views)
    payloads = [reader._raw(k)[8 + 24:] for k in reader.keys[:500]]
    tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]
    start = time.perf_counter()
    for t in tensors:
        decode_jpeg(t)
    return len(tensors) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=3000, help="records of the V=1 file (V=2: half as many)")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for views in (1, 2):
            folder = os.path.join(tmp, f"v{views}")
            records = args.records // views
            pack_bench_rec(folder, records, views)
            pil = time_pil(folder, views, args.records)
            rows.append(("plain PIL reader", "-", views, pil, 1.0))
            rows.append(("torchvision decode_jpeg only", "-", views, time_decode_only(folder, views),
                         None))
            for workers in (0, 1, 2):
                rate = time_loader(folder, views, workers, args.batch_size)
                rows.append(("pairface loader", str(workers), views, rate, rate / pil))
    print(f"data path, {os.cpu_count()} CPU cores (shared with other work: absolute rates vary, ratios hold);"
          f" {args.records} images of 112x112 per V, JPEG q95, batch {args.batch_size}")
    print(f"{'path':<30} {'workers':>7} {'V':>2} {'records/s':>10} {'images/s':>9} {'x PIL':>6}")
    for path, workers, views, rate, ratio in rows:
        ratio_text = f"{ratio:6.2f}" if ratio is not None else f"{'':>6}"
        print(f"{path:<30} {workers:>7} {views:>2} {rate:>10.0f} {rate * views:>9.0f} {ratio_text}")


if __name__ == "__main__":
    main()
