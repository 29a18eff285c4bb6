"""The whole centre step (forward, backward and the optimizer's update of the centres) of PartialFC, against its
floor, its kernels run bare, and arcface_torch's PartialFC_V2 + SGD, with a profile of where the time goes.

    python -m bench.bench_pfc --step [--classes 10000 100000] [--threads 1] [--rounds 3]
    python -m bench.bench_pfc --step --device cuda --fp16 --classes 1000000 4000000   # issue 44's GPU cells

Three things, timed in one fresh process per (C, sample_rate), their rounds interleaved (each one's fastest
round counts, so that a machine others share slows a round, not a figure), and a floor computed there:

- pairface: PartialFC with the sparse centre gradient training uses, and training's optimizer (SGD, momentum
  0.9, weight decay 5e-4) stepping the centres; two views of 128 embeddings, D = 512, one process;
- the floor (bench/floor.py): the step's three GEMMs at the GEMM rate measured in that process, plus the bytes no
  step can avoid at the copy bandwidth measured there: the logits read once and their gradient written once,
  and the centres and their momentum read and written (with dense semantics every row moves every step);
- bare: the step's three GEMMs run bare (cosines, and the two gradients, over the sampled centres), plus torch's
  fused SGD kernel over the (C, D) centres and their momentum: what torch's own kernels make of the floor;
- arcface_torch: its PartialFC_V2's sampled step for one process, written from its code's description
  (`ArcfaceTorchPartialFC` below: sample with torch.unique, rand, topk; gather the sampled rows by indexing,
  whose backward zero-fills a (C, D) gradient; normalise both sides, clamp, the margin by arccos and cos over
  the whole matrix, its cross-entropy Function) and torch's default SGD as its train_v2.py builds it.

At sample_rate 0.1 the worker also profiles pairface's step (torch.profiler, CPU or CUDA): each operator's own
time, the largest first.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.floor import copy_bandwidth, gemm_rate, pfc_floor
from losses import CombinedMarginLoss
from partial_fc import PartialFC
from training.optimizer import RowSparseSGD

BATCH, VIEWS, DIM = 128, 2, 512
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
S, M2 = 64.0, 0.5
PROFILE_ROWS = 12


class ArcfaceTorchPartialFC(torch.nn.Module):
    """arcface_torch's PartialFC_V2 on one process (no collectives), with its CombinedMarginLoss for ArcFace
    (m1 = 1, m3 = 0) and DistCrossEntropyFunc, as its code does them."""

    def __init__(self, num_classes: int, sample_rate: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (num_classes, DIM)))
        self.sample_rate, self.num_local = sample_rate, num_classes
        self.num_sample = int(sample_rate * num_classes)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = labels.view(-1, 1).clone()
        weight = self.weight
        if self.sample_rate < 1:
            with torch.no_grad():
                positive = torch.unique(labels, sorted=True)
                perm = torch.rand(self.num_local, device=labels.device)
                perm[positive] = 2.0
                index = torch.topk(perm, k=self.num_sample)[1].sort()[0]
                labels = torch.searchsorted(index, labels)
            weight = self.weight[index]
        # its fp16 mode: the GEMM under autocast, the logits back in float32 for the margin and softmax
        logits = F.linear(F.normalize(embeddings), F.normalize(weight)).float().clamp(-1, 1)
        rows = torch.arange(labels.shape[0], device=labels.device)
        target_logit = logits[rows, labels.view(-1)]
        with torch.no_grad():
            target_logit.arccos_()
            logits.arccos_()
            logits[rows, labels.view(-1)] = target_logit + M2
            logits.cos_()
        return _ArcfaceTorchCrossEntropy.apply(logits * S, labels)


class _ArcfaceTorchCrossEntropy(torch.autograd.Function):
    """DistCrossEntropyFunc without its all-reduces (one process)."""

    @staticmethod
    def forward(ctx, logits, label):
        max_logits, _ = torch.max(logits, dim=1, keepdim=True)
        logits.sub_(max_logits).exp_()
        logits.div_(torch.sum(logits, dim=1, keepdim=True))
        index = torch.where(label != -1)[0]
        loss = torch.zeros(logits.shape[0], 1, device=logits.device)
        loss[index] = logits[index].gather(1, label[index])
        ctx.save_for_backward(index, logits, label)
        return loss.clamp_min_(1e-30).log_().mean() * (-1)

    @staticmethod
    def backward(ctx, loss_gradient):
        index, logits, label = ctx.saved_tensors
        one_hot = torch.zeros(size=[index.size(0), logits.size(1)], device=logits.device)
        one_hot.scatter_(1, label[index], 1)
        logits[index] -= one_hot
        logits.div_(logits.shape[0])
        return logits * loss_gradient.item(), None


def _inputs(num_classes: int, device: torch.device):
    views = [torch.randn(BATCH, DIM, device=device, requires_grad=True) for _ in range(VIEWS)]
    return views, torch.randint(0, num_classes, (BATCH,), device=device)


def pairface_step(num_classes: int, rate: float, device: torch.device, half: bool) -> Callable[[], None]:
    pfc = PartialFC(CombinedMarginLoss(S, 1.0, M2, 0.0), DIM, num_classes, sample_rate=rate,
                    sparse_grad=True).to(device)
    optimizer = RowSparseSGD(pfc.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, fused=True)
    views, labels = _inputs(num_classes, device)

    def step():
        with torch.autocast(device.type, dtype=torch.float16, enabled=half):
            loss = pfc(views, labels)[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def arcface_torch_step(num_classes: int, rate: float, device: torch.device, half: bool) -> Callable[[], None]:
    head = ArcfaceTorchPartialFC(num_classes, rate).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    views, labels = _inputs(num_classes, device)
    embeddings, all_labels = torch.cat(views), labels.repeat(VIEWS)  # the views as one batch

    def step():
        with torch.autocast(device.type, dtype=torch.float16, enabled=half):
            loss = head(embeddings, all_labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def bare_step(num_classes: int, rate: float, device: torch.device, half: bool) -> Callable[[], None]:
    """The three GEMMs over the sampled centres (in float16 where the others run under fp16 autocast), and torch's
    fused SGD pass over all centres and momentum."""
    sampled = num_classes if rate >= 1 else int(rate * num_classes)
    dtype = torch.float16 if half else torch.float32
    x, centres = (torch.randn(rows, DIM, device=device, dtype=dtype) for rows in (BATCH * VIEWS, sampled))
    grad_cos = torch.randn(BATCH * VIEWS, sampled, device=device, dtype=dtype)
    weight = torch.nn.Parameter(torch.randn(num_classes, DIM, device=device))
    weight.grad = torch.randn_like(weight)
    optimizer = torch.optim.SGD([weight], lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, fused=True)

    def step():
        x @ centres.t()
        grad_cos @ centres
        grad_cos.t() @ x
        optimizer.step()
    return step


STEPS = {"pairface": pairface_step, "bare": bare_step, "arcface_torch": arcface_torch_step}


def _seconds(step: Callable[[], None], repeats: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def measure(num_classes: int, rate: float, device: torch.device, rounds: int, repeats: int, fp16: bool) -> dict:
    """{name: the fastest round's seconds per step}, the floor (seconds, and how it was computed) and, at sample
    rates below 1, pairface's profile. `fp16`: under float16 autocast on a GPU (ignored on a CPU)."""
    torch.manual_seed(0)
    half = fp16 and device.type == "cuda"
    steps = {name: make(num_classes, rate, device, half) for name, make in STEPS.items()}
    for step in steps.values():
        step()  # the first step makes the optimizer state
    best = dict.fromkeys(steps, math.inf)
    gemm = bandwidth = 0.0
    for _ in range(rounds):
        for name, step in steps.items():
            best[name] = min(best[name], _seconds(step, repeats, device))
        # the rates in every round too, the best counting: measured under the load the steps ran under
        gemm = max(gemm, gemm_rate(device, torch.float16 if half else torch.float32))
        bandwidth = max(bandwidth, copy_bandwidth(device))
    sampled = num_classes if rate >= 1 else int(rate * num_classes)
    floor = pfc_floor(BATCH * VIEWS, DIM, num_classes, sampled, logit_bytes=2 if half else 4, update=True,
                      gemm=gemm, bandwidth=bandwidth)
    result = {"seconds": best, "floor": floor.seconds, "floor_terms": floor.describe()}
    if rate < 1:
        result["profile"] = profile(steps["pairface"], device)
    return result


def profile(step: Callable[[], None], device: torch.device) -> list[tuple[str, float, int]]:
    """(operator, share of the step's own time, calls per step), the largest first, over 2 steps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as recorded:
        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    # older torch calls the device time self_cuda_time_total
    attribute = "self_cpu_time_total"
    if device.type == "cuda":
        attribute = next(name for name in ("self_device_time_total", "self_cuda_time_total")
                         if hasattr(recorded.key_averages()[0], name))
    events = [event for event in recorded.key_averages() if getattr(event, attribute) > 0]
    total = sum(getattr(event, attribute) for event in events)
    events.sort(key=lambda event: getattr(event, attribute), reverse=True)
    return [(event.key, getattr(event, attribute) / total, event.count // 2) for event in events[:PROFILE_ROWS]]


def print_table(results: dict, args) -> None:
    print(f"Centre step (forward, backward, SGD momentum {MOMENTUM} weight decay {WEIGHT_DECAY} over every centre): "
          f"batch {BATCH} x {VIEWS} views, D={DIM}, one process, {args.device}, {args.threads} thread(s)"
          f"{', fp16 autocast' if args.fp16 and args.device != 'cpu' else ''}; each figure the fastest of "
          f"{args.rounds} interleaved rounds.")
    print("floor = the three GEMMs over the sampled centres at the GEMM rate measured in the cell's process + the "
          "logits' and the centres' passes at the copy bandwidth measured there (bench/floor.py); bare = those "
          "GEMMs and torch's fused SGD over all centres run bare; arcface_torch = its PartialFC_V2 + "
          "torch.optim.SGD, from its code.")
    header = (f"{'classes':>9} {'rate':>5} {'pairface ms':>12} {'floor ms':>9} {'x floor':>8} {'bare ms':>8} "
              f"{'x bare':>7} {'arcface_torch ms':>17} {'x arcface_torch':>16}")
    print(header)
    print("-" * len(header))
    for (num_classes, rate), result in results.items():
        s = result["seconds"]
        print(f"{num_classes:>9} {rate:>5} {s['pairface'] * 1e3:>12.1f} {result['floor'] * 1e3:>9.1f} "
              f"{s['pairface'] / result['floor']:>7.2f}x {s['bare'] * 1e3:>8.1f} {s['pairface'] / s['bare']:>6.2f}x "
              f"{s['arcface_torch'] * 1e3:>17.1f} {s['pairface'] / s['arcface_torch']:>15.2f}x")
    for (num_classes, rate), result in results.items():
        print(f"floor at C={num_classes}, rate {rate}: {result['floor_terms']}")
    for (num_classes, rate), result in results.items():
        if "profile" in result:
            print(f"\nWhere pairface's step goes, C={num_classes}, sample_rate {rate} (share of the operators' own "
                  "time, calls per step):")
            for name, share, calls in result["profile"]:
                print(f"  {share * 100:>5.1f}%  {calls:>4}  {name}")


def worker(num_classes: int, rate: float, args) -> None:
    repeats = 3 if num_classes <= 100_000 else 1
    print(json.dumps(measure(num_classes, rate, torch.device(args.device), args.rounds, repeats, args.fp16)))
