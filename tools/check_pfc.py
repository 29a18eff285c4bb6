"""Check PartialFC's loss and gradients on this cluster against a dense float64 reference.

    torchrun --nproc_per_node=8 -m tools.check_pfc          # NCCL on GPUs, gloo on CPU
    python -m tools.check_pfc --views 3 --classes 1001       # one process
    python -m tools.check_pfc --compile-margin-softmax       # the softmax's passes compiled (compile_margin_softmax)

Every rank builds the same random problem (a small backbone, V views of a global batch, uneven
class shards), runs one PartialFC step with the backbone in DistributedDataParallel, and rank 0
compares the loss, the backbone's gradient after DDP's averaging and every class centre's
gradient with a dense computation of the same global loss in one process (full softmax,
float64, plain autograd). Prints the worst relative error per tensor and PASS/FAIL.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from losses import CombinedMarginLoss
from partial_fc import PartialFC, initial_centres
from utils import distributed
from utils.device import choose_device, configure_numerics
from utils.launcher import adopt_srun_environment, local_process


def dense_reference(views: list[torch.Tensor], labels: torch.Tensor, centres: torch.Tensor,
                    margin: tuple[float, float, float], s: float,
                    view_weights: list[float] | None = None) -> torch.Tensor:
    """sum_v w_v * mean cross-entropy of view v, full softmax over ``centres``, written from scratch.

    Target logit s * (cos(m1 * acos(cos) + m2) - m3), others s * cos. (No clamping: random test
    data never comes near cos = +-1 or past pi - m2.)
    """
    m1, m2, m3 = margin
    weights = view_weights or [1.0 / len(views)] * len(views)
    unit_centres = centres / centres.norm(dim=1, keepdim=True)
    loss = 0.0
    for weight, emb in zip(weights, views):
        cos = (emb / emb.norm(dim=1, keepdim=True)) @ unit_centres.t()
        target = cos.gather(1, labels[:, None])
        target_logit = s * (torch.cos(m1 * torch.acos(target) + m2) - m3)
        logits = torch.scatter(s * cos, 1, labels[:, None], target_logit)
        loss = loss + weight * F.cross_entropy(logits, labels)
    return loss


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Worst element-wise difference, relative to the largest element of the reference."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def make_backbone(in_features: int, embedding_size: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(in_features, 64), torch.nn.PReLU(64),
                               torch.nn.Linear(64, embedding_size))


def run_check(num_views: int, num_classes: int, batch: int, embedding_size: int, margin: tuple,
              sample_rate: float, dtype: torch.dtype, device: torch.device, seed: int = 0,
              compile_margin_softmax: bool = False) -> dict[str, float]:
    """One PartialFC step on every rank; returns {tensor name: relative error} (on rank 0)."""
    rank, world_size = distributed.rank(), distributed.world()
    gen = torch.Generator().manual_seed(seed)
    in_features = 32
    inputs = torch.randn(world_size * batch, num_views, in_features, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, num_classes, (world_size * batch,), generator=gen)
    centres = initial_centres(seed, 0, num_classes, embedding_size).double()  # the matrix PartialFC starts from
    torch.manual_seed(seed)
    reference_backbone = make_backbone(in_features, embedding_size).double()
    backbone = make_backbone(in_features, embedding_size).to(device=device, dtype=dtype)
    backbone.load_state_dict(reference_backbone.state_dict())

    margin_loss = CombinedMarginLoss(64.0, *margin)
    pfc = PartialFC(margin_loss, embedding_size, num_classes, sample_rate=sample_rate, seed=seed,
                    compile_margin_softmax=compile_margin_softmax)
    pfc = pfc.to(device=device, dtype=dtype)
    model = backbone
    if distributed.is_initialized():
        device_ids = [device] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(backbone, device_ids=device_ids)

    mine = slice(rank * batch, (rank + 1) * batch)
    local_inputs = inputs[mine].to(device=device, dtype=dtype)
    features = model(local_inputs.reshape(batch * num_views, in_features)).view(batch, num_views, -1)
    loss, _ = pfc(features.unbind(1), labels[mine].to(device))
    loss.backward()

    sampled = None if pfc.last_sampled_classes is None else pfc.last_sampled_classes.cpu()
    shards = distributed.gather_objects((pfc.weight.grad.detach().cpu(), sampled))
    if rank != 0:
        return {}
    centre_grads = torch.cat([grad for grad, _ in shards])
    subset = None if sampled is None else torch.cat([classes for _, classes in shards])
    ref_features = reference_backbone(inputs.reshape(-1, in_features)).view(world_size * batch, num_views, -1)
    ref_centres = centres.clone().requires_grad_(True)
    used_centres, used_labels = ref_centres, labels
    if subset is not None:
        used_centres = ref_centres[subset]
        used_labels = torch.searchsorted(subset, labels)
    ref_loss = dense_reference(list(ref_features.unbind(1)), used_labels, used_centres, margin, 64.0)
    ref_loss.backward()
    errors = {"loss": relative_error(loss.detach(), ref_loss.detach()),
              "centres.grad": relative_error(centre_grads, ref_centres.grad)}
    for (name, param), ref_param in zip(backbone.named_parameters(), reference_backbone.parameters()):
        errors[f"backbone.{name}.grad"] = relative_error(param.grad, ref_param.grad)
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--views", type=int, default=2)
    parser.add_argument("--classes", type=int, default=1001, help="odd on purpose: uneven shards")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank")
    parser.add_argument("--embedding-size", type=int, default=64)
    parser.add_argument("--margin", type=float, nargs=3, default=(1.0, 0.5, 0.0), metavar=("M1", "M2", "M3"))
    parser.add_argument("--sample-rate", type=float, default=1.0)
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--compile-margin-softmax", action="store_true",
                        help="PartialFC's softmax passes compiled by torch.compile, as the config key of that name")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="worst relative error allowed (default 1e-5 for float64, 1e-4 for float32)")
    args = parser.parse_args()
    adopt_srun_environment()
    device = choose_device("auto", *local_process())
    configure_numerics(device, tf32=False, deterministic=False)  # compared with float64: no TF32 rounding
    distributed.init_distributed(device, timeout_minutes=10)
    rank, world_size = distributed.rank(), distributed.world()
    dtype = getattr(torch, args.dtype)
    tolerance = args.tolerance or (1e-5 if dtype == torch.float64 else 1e-4)
    try:
        errors = run_check(args.views, args.classes, args.batch, args.embedding_size, tuple(args.margin),
                           args.sample_rate, dtype, device, compile_margin_softmax=args.compile_margin_softmax)
    finally:
        distributed.cleanup()
    if rank != 0:
        return 0
    print(f"PartialFC check: world {world_size}, {device.type}, {args.views} views, {args.classes} classes, "
          f"batch {args.batch}/rank, margin {tuple(args.margin)}, sample_rate {args.sample_rate}, {args.dtype}"
          + (", softmax compiled" if args.compile_margin_softmax else ""))
    width = max(len(name) for name in errors)
    for name, err in errors.items():
        print(f"  {name:<{width}}  worst relative error {err:.3e}")
    worst = max(errors.values())
    ok = math.isfinite(worst) and worst <= tolerance
    print(f"{'PASS' if ok else 'FAIL'}: worst {worst:.3e} (tolerance {tolerance:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
