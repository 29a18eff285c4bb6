"""PartialFC under fp16 and bf16 autocast against float32: relative errors of the loss, of the gradient
of the embeddings (dX) and of the centres (dW), each the worst element's difference over the largest
element of the float32 result.

    python -m bench.pfc_precision --device cuda [--classes 100000]
    python -m bench.pfc_precision                    # CPU, 1000 classes

The float32 reference runs without TF32. Batch 128 x 2 views, D = 512, all centres; one row per margin
family (bench/bench_pfc.py's settings: ArcFace for the combined family, sub-center with K = 3), each run
from the same family state.
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.bench_pfc import FAMILIES, family_margin
from partial_fc import PartialFC
from tools.check_pfc import relative_error
from utils.device import configure_numerics

BATCH, VIEWS, DIM = 128, 2, 512


def loss_and_gradients(pfc: PartialFC, views: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype | None):
    """(loss, dX, dW) of one forward and backward, under autocast to `dtype` (None: float32), from the margin
    family's state as it was before the first call."""
    pfc.zero_grad(set_to_none=True)
    leaf = views.clone().requires_grad_(True)
    with torch.autocast(views.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss, _ = pfc(list(leaf), labels)
    loss.backward()
    return loss.detach(), leaf.grad, pfc.weight.grad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--classes", type=int, default=1000)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    configure_numerics(device, tf32=False, deterministic=False)
    print(f"PartialFC vs float32: {args.classes} classes, {BATCH} x {VIEWS} views, D={DIM}, {device}")
    for family in FAMILIES:
        torch.manual_seed(0)
        margin, k = family_margin(family)
        pfc = PartialFC(margin, DIM, args.classes, num_subcenters=k).to(device)
        start = pfc.margin_state_dict()
        views = torch.randn(VIEWS, BATCH, DIM, device=device) * 8  # feature norms around AdaFace's EMA start
        labels = torch.randint(0, args.classes, (BATCH,), device=device)
        reference = loss_and_gradients(pfc, views, labels, None)
        for dtype in (torch.float16, torch.bfloat16):
            pfc.load_margin_state_dict(start)
            errors = [relative_error(ours, theirs) for ours, theirs in
                      zip(loss_and_gradients(pfc, views, labels, dtype), reference, strict=True)]
            print(f"{family:>12} {str(dtype).removeprefix('torch.'):>8}  loss {errors[0]:.1e}  dX {errors[1]:.1e}  "
                  f"dW {errors[2]:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
