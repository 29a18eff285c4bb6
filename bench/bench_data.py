"""Data path throughput: read + decode + slice + flip + to tensor, from a packed .rec of 112x112
JPEG views (quality 95), V = 1 and V = 2, through pairface's loader with 0, 1 and 2 workers, next
to a straightforward PIL reader of the same records measured in the same run; the same loaders
with ``dali_aug`` on; and what each dali_aug operation costs per view.

    python -m bench.bench_data [--records 2000] [--batch-size 64] [--rounds 3]
    python -m bench.bench_data --gpu-decode [--records 8192] [--batch-size 128]   # on a GPU machine

Ratios are against the PIL reader at the same V (one process), and for dali_aug rows against the
same loader without it. Each path runs once to warm up (workers, page cache), then ``--rounds``
times interleaved with the others; the best round counts, so that a burst of background load on a
shared machine hits all paths alike.

``--gpu-decode`` compares decoding in the workers with decoding on the GPU (``gpu_decode``,
arcface_torch's ``dali``), batches delivered on the GPU, V = 2, dali_aug off and on: records/s, and
how far the GPU-decoded batches are from the CPU-decoded ones (the two JPEG decoders round differently).
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
from facedata.dali_aug import gaussian_blur, grey, hue_saturation, low_resolution

DISTINCT_FACES = 240  # drawn once, reused across records: the bench measures reading, not drawing
COMPARED_BATCHES = 8  # of GPU- vs CPU-decoded batches


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
    if loader.device.type == "cuda":
        torch.cuda.synchronize(loader.device)
    return batches * batch_size / (time.perf_counter() - start)


def rate_decode_only(payloads: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for payload in payloads:
        decode_jpeg(payload)
    return len(payloads) / (time.perf_counter() - start)


def measure(folder: str, views: int, batch_size: int, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best records/s of each path over ``rounds`` interleaved passes, so that every path meets
    the same background load; and the least CPU time per record of the loaders without workers."""
    reader = PlainPILReader(folder, views)
    payloads = [torch.frombuffer(bytearray(reader.raw(k)[8 + 24:]), dtype=torch.uint8) for k in reader.keys[:500]]
    loaders = {}
    for aug in (False, True):
        ds = build_dataset(folder, num_views=views, flip=True, dali_aug=aug)
        loaders.update({f"loader{w}{'aug' * aug}": build_loader(ds, batch_size, num_workers=w) for w in (0, 1, 2)})
    for loader in loaders.values():
        rate_loader(loader, 0, batch_size)  # starts the workers, warms the page cache
    best: dict[str, float] = {}
    cpu: dict[str, float] = {}  # microseconds of this process's CPU time per record, loaders without workers
    for epoch in range(1, rounds + 1):
        results = {"pil": rate_pil(reader, reader.keys), "decode": rate_decode_only(payloads)}
        for name, loader in loaders.items():
            start = time.process_time()
            results[name] = rate_loader(loader, epoch, batch_size)
            if name.startswith("loader0"):
                used = (time.process_time() - start) * 1e6 / (len(loader) * batch_size)
                cpu[name] = min(used, cpu.get(name, float("inf")))
        best = {name: max(rate, best.get(name, 0.0)) for name, rate in results.items()}
    return best, cpu


def augment_costs(rounds: int) -> list[tuple[str, float, float]]:
    """(operation, microseconds of CPU time per view on one thread, how often upstream applies it): the
    best of ``rounds`` passes over 64 views one at a time, as the workers apply them."""
    views = torch.from_numpy(render_faces(np.arange(64), 0, seed=1)).permute(0, 3, 1, 2).contiguous()
    operations = [("low resolution (72 px)", lambda v: low_resolution(v, 72), 0.1),
                  ("Gaussian blur, window 3", lambda v: gaussian_blur(v, 3), 0.1),
                  ("Gaussian blur, window 5", lambda v: gaussian_blur(v, 5), 0.1),
                  ("hue/saturation", lambda v: hue_saturation(v, [10.0], [1.1]), 0.2),
                  ("grey", grey, 0.1)]
    costs = []
    for name, operation, rate in operations:
        best = float("inf")
        for _ in range(rounds + 1):
            start = time.process_time()
            for n in range(len(views)):
                operation(views[n:n + 1].clone())
            best = min(best, (time.process_time() - start) / len(views))
        costs.append((name, best * 1e6, rate))
    return costs


def gpu_decode_rows(folder: str, batch_size: int, rounds: int) -> tuple[list[tuple], list[tuple]]:
    """Records/s of decoding in the workers vs on the GPU (batches on the GPU either way), and the
    GPU-decoded batches' distance from the CPU-decoded ones, for dali_aug off and on."""
    workers = min(8, os.cpu_count() or 1)
    loaders, distances = {}, []
    for aug in (False, True):
        ds = build_dataset(folder, num_views=2, flip=True, dali_aug=aug)
        for gpu_decode in (False, True):
            loaders[aug, gpu_decode] = build_loader(ds, batch_size, num_workers=workers, device="cuda",
                                                    gpu_decode=gpu_decode)
        counts = torch.zeros(256, dtype=torch.int64, device="cuda")  # how many pixels differ by 0, 1, ... levels
        for _, (on_cpu, _), (on_gpu, _) in zip(range(COMPARED_BATCHES), loaders[aug, False], loaders[aug, True]):
            counts += torch.bincount((on_gpu.int() - on_cpu.int()).abs().flatten(), minlength=256)
        share = counts.double().cumsum(0) / counts.sum()
        levels = torch.arange(256, device="cuda", dtype=torch.float64)
        distances.append(("on" if aug else "off", float((counts * levels).sum() / counts.sum()),
                          int(torch.searchsorted(share, 0.999)), int(levels[counts > 0].max()), 1 - float(share[0])))
    best: dict = {}
    for epoch in range(1, rounds + 1):
        best = {key: max(rate_loader(loader, epoch, batch_size), best.get(key, 0.0)) for key, loader in loaders.items()}
    rows = [("workers decode (CPU)" if not gpu_decode else "GPU decodes (nvJPEG)", "on" if aug else "off", workers,
             rate, rate / best[aug, False]) for (aug, gpu_decode), rate in best.items()]
    return rows, distances


def main_gpu_decode(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("--gpu-decode needs a GPU: torch.cuda.is_available() is False here")
        return
    with tempfile.TemporaryDirectory() as tmp:
        pack_bench_rec(tmp, args.records // 2, 2)
        rows, distances = gpu_decode_rows(tmp, args.batch_size, args.rounds)
    print(f"GPU decoding ({torch.cuda.get_device_name()}): {args.records // 2} two-view records, batch "
          f"{args.batch_size}, batches delivered on the GPU, best of {args.rounds} rounds")
    print(f"{'path':<24} {'dali_aug':>8} {'workers':>7} {'records/s':>10} {'images/s':>9} {'x CPU':>6}")
    for path, aug, workers, rate, ratio in rows:
        print(f"{path:<24} {aug:>8} {workers:>7} {rate:>10.0f} {2 * rate:>9.0f} {ratio:6.2f}")
    print("GPU- vs CPU-decoded batches, |difference| in uint8 levels:")
    print(f"{'dali_aug':>8} {'mean':>6} {'p99.9':>6} {'max':>5} {'pixels differing':>17}")
    for aug, mean, p999, largest, share in distances:
        print(f"{aug:>8} {mean:6.2f} {p999:6.1f} {largest:5.0f} {share:17.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=None, help="images per V (records: this / V); "
                        "default 2000, 16384 with --gpu-decode")
    parser.add_argument("--batch-size", type=int, default=None, help="default 64, 128 with --gpu-decode")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes; the best of each path counts")
    parser.add_argument("--gpu-decode", action="store_true", help="workers vs the GPU decoding (needs a GPU)")
    args = parser.parse_args()
    if args.gpu_decode:
        args.records, args.batch_size = args.records or 16384, args.batch_size or 128
        main_gpu_decode(args)
        return
    args.records, args.batch_size = args.records or 2000, args.batch_size or 64
    torch.set_num_threads(1)
    rows, cpu_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for views in (1, 2):
            folder = os.path.join(tmp, f"v{views}")
            pack_bench_rec(folder, args.records // views, views)
            best, cpu = measure(folder, views, args.batch_size, args.rounds)
            rows.append(("plain PIL reader (1 process)", "-", views, best["pil"], 1.0, None))
            rows.append(("decode_jpeg alone (no read)", "-", views, best["decode"], best["decode"] / best["pil"], None))
            for workers in (0, 1, 2):
                rate = best[f"loader{workers}"]
                rows.append(("pairface loader", str(workers), views, rate, rate / best["pil"], None))
            for workers in (0, 1, 2):
                rate = best[f"loader{workers}aug"]
                rows.append(("pairface loader, dali_aug", str(workers), views, rate, rate / best["pil"],
                             rate / best[f"loader{workers}"]))
            cpu_rows.append((views, cpu["loader0"], cpu["loader0aug"]))
        costs = augment_costs(args.rounds)
    print(f"data path: read + decode + slice + flip + batch, {args.records} 112x112 JPEG (q95) views per V, "
          f"batch {args.batch_size}, best of {args.rounds} interleaved rounds")
    print(f"{os.cpu_count()} CPU cores, shared with other work: absolute rates move with the load, "
          "ratios measured together hold better")
    print(f"{'path':<30} {'workers':>7} {'V':>2} {'records/s':>10} {'images/s':>9} {'x PIL':>6} {'x no aug':>8}")
    for path, workers, views, rate, ratio, aug_ratio in rows:
        aug_column = "-" if aug_ratio is None else f"{aug_ratio:.2f}"
        print(f"{path:<30} {workers:>7} {views:>2} {rate:>10.0f} {rate * views:>9.0f} {ratio:6.2f} {aug_column:>8}")
    print("CPU time per record with 0 workers (everything in one process; steadier than rates on a busy machine):")
    print(f"{'V':>2} {'no aug us':>10} {'dali_aug us':>12} {'x no aug':>8}")
    for views, plain, augmented in cpu_rows:
        print(f"{views:>2} {plain:>10.0f} {augmented:>12.0f} {plain / augmented:8.2f}")
    print("dali_aug per view, CPU time on one thread (the workers' setting):")
    print(f"{'operation':<26} {'us/view':>8} {'applied':>8} {'us/view on average':>19}")
    for name, micros, rate in costs:
        print(f"{name:<26} {micros:8.0f} {rate:8.0%} {micros * rate:19.0f}")
    print(f"{'all of dali_aug':<26} {'':>8} {'':>8} {sum(m * r for _, m, r in costs):19.0f}")


if __name__ == "__main__":
    main()
