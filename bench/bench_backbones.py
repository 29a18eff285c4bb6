"""Backbone sizes, FLOPs and CPU inference speed, and what channels_last / fused BN earn.

    python -m bench.bench_backbones                       # all sixteen networks, several minutes
    python -m bench.bench_backbones --networks r18 mbf    # a subset

For each network at full width: parameters, GFLOPs per 112x112 image (counted by
torch.utils.flop_counter on a forward on the meta device, so r2060's 4.5 GB of weights are never
allocated: 2 per multiply-add of conv/linear/attention; BN and activations not counted) and, for
networks up to MAX_TIMED_GFLOPS, eval-mode float32 images/s at batch 8 on 2 threads for several
variants timed round-robin in the same run: "arcface ops" (the operations arcface_torch's forward
runs, the baseline), channels_last, BN folded into the preceding conv/linear
(backbones.fuse_batchnorm), both; for ViTs, the fused attention kernel our forward uses. Each
variant's speed is its best iteration (the least disturbed by other processes on this machine's
shared cores). Width-scaled networks, as used for CPU demos and tests, follow.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import time
import types

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from backbones import NETWORKS, fuse_batchnorm, get_model
from backbones.vit import Attention

BATCH = 8
THREADS = 2
# arcface_torch's own networks measured earlier on this machine (issue 3): eval, float32, batch 8, 2 threads.
ARCFACE_TORCH_IMAGES_PER_S = {"r18": 17.6, "r50": 7.4, "mbf": 52.9, "vit_t": 24.7}
# Networks above this are sized but not timed (r2060, vit_h): on 2 cores one batch of 8 would take
# tens of seconds per variant, and their weights and fused copies would need 10+ GB.
MAX_TIMED_GFLOPS = 100.0
# A network is called practical for CPU demos when it embeds at least this many images per second.
DEMO_IMAGES_PER_S = 15.0
DEMO_NETWORKS = (("r18", 0.25), ("r50", 0.25), ("mbf", 0.5), ("vit_t", 0.25))


def _cpu_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # The flop counter knows the GPU attention kernels but not the CPU one scaled_dot_product_attention uses.
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def gflops_per_image(model: nn.Module) -> float:
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}
    device = next(model.parameters()).device
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(torch.zeros(1, 3, 112, 112, device=device))
    return counter.get_total_flops() / 1e9


def size(name: str, width_mult: float) -> tuple[float, float]:
    """(millions of parameters, GFLOPs per image), on the meta device: no memory, no arithmetic."""
    with torch.device("meta"):
        model = get_model(name, width_mult=width_mult).eval()
    return sum(p.numel() for p in model.parameters()) / 1e6, gflops_per_image(model)


def explicit_attention(self: Attention, x: torch.Tensor) -> torch.Tensor:
    """arcface_torch's attention as written upstream: q k^T, softmax, times v, all materialised."""
    batch, tokens, dim = x.shape
    qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    weights = (q @ k.transpose(-2, -1) * (dim // self.num_heads) ** -0.5).softmax(dim=-1)
    return self.proj((weights @ v).transpose(1, 2).reshape(batch, tokens, dim))


def with_explicit_attention(model: nn.Module) -> nn.Module:
    copied = copy.deepcopy(model)
    for module in copied.modules():
        if isinstance(module, Attention):
            module.forward = types.MethodType(explicit_attention, module)
    return copied


def variants(model: nn.Module, is_convnet: bool) -> dict[str, tuple[nn.Module, bool]]:
    """name -> (its own copy of the model, channels_last input). The first runs the same operations
    as arcface_torch's forward: the in-run baseline."""
    fused = fuse_batchnorm(model)
    if not is_convnet:
        return {"arcface ops": (with_explicit_attention(model), False), "fused attention": (model, False),
                "+ fused BN": (fused, False)}
    return {
        "arcface ops": (model, False),
        "channels_last": (copy.deepcopy(model).to(memory_format=torch.channels_last), True),
        "fused BN": (fused, False),
        "fused BN + channels_last": (copy.deepcopy(fused).to(memory_format=torch.channels_last), True),
    }


def best_images_per_second(candidates: dict[str, tuple[nn.Module, bool]], min_seconds: float,
                           max_rounds: int) -> dict[str, float]:
    images = torch.rand(BATCH, 3, 112, 112) * 2 - 1
    inputs = {name: images.contiguous(memory_format=torch.channels_last) if cl else images
              for name, (_, cl) in candidates.items()}
    best: dict[str, float] = {}
    with torch.inference_mode():
        start = time.perf_counter()
        for name, (model, _) in candidates.items():  # warm-up: allocations, oneDNN primitive caches
            model(inputs[name])
        per_round = (time.perf_counter() - start) or 1e-3
        rounds = max(2, min(max_rounds, math.ceil(min_seconds / per_round)))
        for _ in range(rounds):  # round-robin, so a burst of load hits every variant alike
            for name, (model, _) in candidates.items():
                began = time.perf_counter()
                model(inputs[name])
                elapsed = time.perf_counter() - began
                best[name] = min(best.get(name, math.inf), elapsed)
    return {name: BATCH / seconds for name, seconds in best.items()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", nargs="+", choices=NETWORKS, default=list(NETWORKS))
    parser.add_argument("--min-seconds", type=float, default=3.0, help="timed seconds per network (at least 2 rounds)")
    parser.add_argument("--max-rounds", type=int, default=12)
    return parser.parse_args()


def measure(name: str, width_mult: float, args: argparse.Namespace) -> dict:
    """Size, and (unless it is over MAX_TIMED_GFLOPS) each variant's speed and the fastest one."""
    params, gflops = size(name, width_mult)
    if gflops > MAX_TIMED_GFLOPS:
        return {"params": params, "gflops": gflops, "speeds": None, "best": None}
    model = get_model(name, width_mult=width_mult).eval()
    speeds = best_images_per_second(variants(model, not name.startswith("vit")), args.min_seconds,
                                    args.max_rounds)
    return {"params": params, "gflops": gflops, "speeds": speeds, "best": max(speeds, key=speeds.get)}


def print_variants(label: str, row: dict) -> None:
    print(f"{label}: {row['params']:.2f}M parameters, {row['gflops']:.2f} GFLOPs per image")
    if row["speeds"] is None:
        print(f"    not timed: over {MAX_TIMED_GFLOPS:g} GFLOPs per image, too slow for {THREADS} CPU threads")
        return
    baseline = row["speeds"]["arcface ops"]
    for variant, speed in row["speeds"].items():
        print(f"    {variant:<26}{speed:>8.1f} images/s   x{speed / baseline:.2f}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(THREADS)
    torch.set_flush_denormal(True)  # untrained deep nets produce denormals that would slow some ops
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {THREADS} threads, batch {BATCH}, eval, float32, "
          f"load average at start {os.getloadavg()[0]:.1f}")
    print(f"note: this machine's {os.cpu_count()} cores are shared with other engineers' jobs; absolute "
          f"images/s move with their load, ratios are between variants timed round-robin in this run.\n")
    rows = {}
    for name in args.networks:
        rows[name] = measure(name, 1.0, args)
        print_variants(name, rows[name])
    print("\nwidth-scaled networks (width_mult) as used for CPU demos and tests:")
    for name, width in DEMO_NETWORKS:
        print_variants(f"{name} x{width}", measure(name, width, args))

    header = (f"{'network':<22}{'params':>9}{'GFLOPs':>8}{'arcface ops':>13}{'best':>8}  {'best variant':<26}"
              f"{'gain':>6}{'issue ref':>11}  CPU demo")
    print(f"\nsummary (images/s)\n{header}\n{'-' * len(header)}")
    for name, row in rows.items():
        reference = ARCFACE_TORCH_IMAGES_PER_S.get(name, "-")
        size_columns = f"{name:<22}{row['params']:>8.1f}M{row['gflops']:>8.2f}"
        if row["speeds"] is None:
            print(f"{size_columns}{'-':>13}{'-':>8}  {'not timed (too large)':<26}{'-':>6}{reference:>11}  no")
            continue
        baseline, best = row["speeds"]["arcface ops"], row["speeds"][row["best"]]
        print(f"{size_columns}{baseline:>13.1f}{best:>8.1f}  "
              f"{row['best']:<26}{f'x{best / baseline:.2f}':>6}{reference:>11}  "
              f"{'yes' if best >= DEMO_IMAGES_PER_S else 'no'}")
    print(f"\narcface ops = the same operations as arcface_torch's forward, timed in this run (ViT: its "
          f"explicit softmax attention). issue ref = arcface_torch measured earlier on this machine, not "
          f"in this run. CPU demo = best >= {DEMO_IMAGES_PER_S:g} images/s here. GFLOPs count 2 per "
          f"multiply-add. not timed = over {MAX_TIMED_GFLOPS:g} GFLOPs per image, too slow for "
          f"{THREADS} threads (sized on the meta device only). Load average at end {os.getloadavg()[0]:.1f}.")

if __name__ == "__main__":
    main()
