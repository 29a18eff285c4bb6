"""Train a face-recognition backbone with a multi-view margin softmax over sharded class centres.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair.py
    python train.py configs/synthetic_pair.py --set num_epoch=2 --set lr=0.05
    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair.py --resume

One step: the loader's (B, V, 3, 112, 112) uint8 batch -> one backbone pass over the B*V images
-> V embedding tensors -> PartialFC (one loss over all views) -> one backward -> clip -> one
optimizer step over backbone and centres -> LR step. Run folder: training.log, tensorboard/,
checkpoint.json + checkpoint-<step>/ (the full state, sharded, resumable on any world size),
backbone.pth (arcface_torch-compatible) and model.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from backbones import get_model
from dataset import FaceLoader, build_dataset, build_loader
from eval.callback import VerificationCallback, check_val_targets
from losses import CombinedMarginLoss
from partial_fc import PartialFC
from utils.checkpoint import BACKBONE_NAME, Checkpointer, Progress
from utils.config import check_data_path, load_config
from utils.device import choose_device, configure_numerics, describe_device
from utils.distributed import (
    all_reduce_max,
    backend,
    cleanup,
    init_distributed,
    is_main,
    launched_rank,
    local_process,
    lost_peer,
    nodes,
    rank,
    world,
)
from utils.errors import ConfigError, TrainingError, UserError, agreed, report
from utils.image import normalize
from utils.log import SpeedLogger, setup_logging
from utils.lr_scheduler import build_scheduler
from utils.memory_plan import describe, device_bytes, memory_plan, processes_that_fit
from utils.metrics import Metrics, open_metrics
from utils.run_dir import lock_run_dir, resolve_resume

log = logging.getLogger("train")

# TEST ONLY: "2,12" makes rank 0's loss NaN at global steps 2 and 12 (1-based, as logged), to drive
# the non-finite guard through the real command line.
DEBUG_NAN_STEPS_VARIABLE = "PAIRFACE_DEBUG_NAN_STEPS"


class StepOutcome(IntEnum):
    """What became of an optimizer step; ranks agree on the worst (largest) one."""

    TAKEN = 0
    GRAD_NONFINITE = 1  # finite loss, non-finite gradient (routine for fp16: the grad scaler backs off)
    LOSS_NONFINITE = 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pairface training (arcface_torch-style, multi-view)")
    parser.add_argument("config", help="experiment file, e.g. configs/ms1mv3_r50_pair.py")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override a config key (value parsed as a Python literal); repeatable")
    parser.add_argument("--resume", action="store_true", help="continue the run in the config's output folder")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config and each process's memory plan; read no data, start no "
                             "process group, write nothing")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --dry-run: plan for N processes (default: WORLD_SIZE, else 1)")
    parser.add_argument("--json", action="store_true", help="with --dry-run: one JSON object {config, memory}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set + (["resume=True"] if args.resume else []))
        if args.dry_run:
            print(dry_run_report(cfg, args.world_size or int(os.environ.get("WORLD_SIZE", "1")), args.json))
            return 0
        check_data_path(cfg)
        check_val_targets(cfg.val_targets, cfg.rec)  # before any model is built (minutes for a large one)
        device = choose_device(cfg.device, *local_process())
        configure_numerics(device, cfg.tf32, cfg.deterministic)
        init_distributed(device, cfg.timeout_minutes)
        if device.type == "cpu":
            _share_cpu(cfg.num_workers)
        try:
            train(cfg, device)
        except Exception as error:
            if (failure := lost_peer(error)) is None:
                raise
            raise TrainingError(f"lost contact with another process ({failure}), which stopped or became "
                                "unreachable: its own error line, if it printed one, says why; fix that, then "
                                "start again (--resume continues from the last checkpoint)") from error
        finally:
            cleanup()
    except UserError as error:
        # Config errors happen identically on every process, before the process group exists: one copy is enough.
        if launched_rank() == 0 or not isinstance(error, ConfigError):
            report(error)
        return 1
    return 0


def dry_run_report(cfg: SimpleNamespace, world_size: int, as_json: bool) -> str:
    """The resolved configuration and the memory plan of one process of `world_size`."""
    plan = memory_plan(cfg, cfg.num_classes, world_size)
    if as_json:
        return json.dumps({"config": vars(cfg), "memory": {"world_size": world_size, **plan}})
    keys = "\n".join(f"{key} = {value!r}" for key, value in vars(cfg).items())
    return f"{keys}\n\nmemory per process, {world_size} process(es) (activations not included):\n{describe(plan)}"


def _share_cpu(num_workers: int) -> None:
    """Compute threads for CPU training: the cores left by the data workers and this machine's other
    training processes, unless OMP_NUM_THREADS says otherwise (torchrun sets it to 1).

    More threads than free cores is far worse than slow here: OpenMP threads wait for each other at
    every operation, and one that is descheduled stalls all of them (10-20x slower steps measured on
    2 cores with one decoding worker beside two compute threads)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    per_process = (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, per_process - num_workers))


@dataclass
class Model:
    """Everything a step changes: the networks, their optimizer, schedule and grad scaler."""

    backbone: nn.Module            # the plain backbone (checkpoints, verification)
    ddp_backbone: nn.Module        # what the step calls: the backbone wrapped in DDP when world > 1
    pfc: PartialFC
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    precision: torch.dtype | None  # the autocast type of the step (float16, bfloat16), None for float32
    bn_buffers: list[torch.Tensor] = field(default_factory=list)  # room to keep BatchNorm statistics in

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.precision is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.precision)

    def keep_bn_buffers(self) -> None:
        """BatchNorm statistics move in the forward pass, before the loss is known: kept to be put back
        when the step is skipped, so that a non-finite batch leaves the model exactly as it was."""
        buffers = list(self.backbone.buffers())
        if len(self.bn_buffers) != len(buffers):
            self.bn_buffers = [torch.empty_like(buffer) for buffer in buffers]
        _copy_all(self.bn_buffers, buffers)

    def restore_bn_buffers(self) -> None:
        _copy_all(list(self.backbone.buffers()), self.bn_buffers)


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One fused copy of every tensor (a backbone may have no buffers at all)."""
    if targets:
        torch._foreach_copy_(targets, sources)


def precision(cfg: SimpleNamespace) -> torch.dtype | None:
    """The one precision switch: arcface_torch's `fp16` (with a GradScaler), or `bf16`."""
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None


def build_model(cfg: SimpleNamespace, num_classes: int, device: torch.device) -> tuple[nn.Module, PartialFC]:
    """Backbone and class centres, initialised from cfg.seed alone (the same on any world size)."""
    torch.manual_seed(cfg.seed)
    backbone = get_model(cfg.network, num_features=cfg.embedding_size, dropout=cfg.dropout,
                         **cfg.network_kwargs).to(device)
    margin = CombinedMarginLoss(cfg.margin_scale, *cfg.margin_list, cfg.interclass_filtering_threshold,
                                straight_through=cfg.straight_through_margin)
    # On a GPU the label check would make every step wait for the device: deferred to a NaN loss instead.
    pfc = PartialFC(margin, cfg.embedding_size, num_classes, cfg.sample_rate, view_weights=cfg.view_weights,
                    seed=cfg.seed, defer_label_check=device.type == "cuda").to(device)
    return backbone, pfc


def build_optimizer(cfg: SimpleNamespace, backbone: nn.Module, pfc: PartialFC) -> torch.optim.Optimizer:
    """One optimizer, two parameter groups (backbone, centres), the same lr and weight decay (upstream).
    Fused: one kernel updates each group in place, where the default one would allocate a centre-sized
    temporary for the weight decay term."""
    groups = [{"params": list(backbone.parameters())}, {"params": list(pfc.parameters())}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)


def build_training(cfg: SimpleNamespace, num_classes: int, device: torch.device, steps_per_epoch: int) -> Model:
    """Everything a step needs, single-process (`wrap_in_ddp` makes it distributed)."""
    backbone, pfc = build_model(cfg, num_classes, device)
    optimizer = build_optimizer(cfg, backbone, pfc)
    scheduler = build_scheduler(optimizer, steps_per_epoch * cfg.warmup_epoch, steps_per_epoch * cfg.num_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16, growth_interval=100)
    return Model(backbone=backbone, ddp_backbone=backbone, pfc=pfc, optimizer=optimizer, scheduler=scheduler,
                 scaler=scaler, precision=precision(cfg))


def wrap_in_ddp(model: Model, device: torch.device) -> None:
    if world() > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        model.ddp_backbone = DistributedDataParallel(model.backbone, device_ids=device_ids,
                                                     forward_sync_buffers=False)


def model_info(cfg: SimpleNamespace, num_classes: int) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    return {"network": cfg.network, "network_kwargs": dict(cfg.network_kwargs),
            "embedding_size": cfg.embedding_size, "num_classes": num_classes}


def _forward_backward(model: Model, images: torch.Tensor, labels: torch.Tensor, accumulation: int,
                      inject_nan: bool) -> torch.Tensor:
    """One micro-batch: returns [loss, loss of view 1..V] (detached); gradients accumulate."""
    batch, views = images.shape[:2]
    flat = normalize(images).reshape(batch * views, *images.shape[2:])  # row b*V + v = record b, view v
    with model.autocast(flat.device.type):
        embeddings = model.ddp_backbone(flat)
        loss, per_view = model.pfc(embeddings.reshape(batch, views, -1).unbind(dim=1), labels)
    if inject_nan:
        loss = loss + float("nan")
    model.scaler.scale(loss / accumulation).backward()
    return torch.cat([loss.detach().reshape(1), per_view])


def train_step(model: Model, micro_batches, cfg, inject_nan: bool = False) -> tuple[torch.Tensor, StepOutcome]:
    """One optimizer step over the micro-batches. Returns ([loss, view losses...] averaged over the
    micro-batches, detached, on the device; the outcome every rank agreed on): a step is taken on
    every rank, or skipped on every rank."""
    model.keep_bn_buffers()
    micro_losses = []
    for i, (images, labels) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        accumulating = not last and model.ddp_backbone is not model.backbone
        with model.ddp_backbone.no_sync() if accumulating else contextlib.nullcontext():
            micro_losses.append(_forward_backward(model, images, labels, len(micro_batches), inject_nan))
    model.scaler.unscale_(model.optimizer)
    grad_norm = nn.utils.clip_grad_norm_(model.backbone.parameters(), cfg.max_grad_norm)
    losses = torch.stack(micro_losses).mean(dim=0)
    outcome = _agreed_outcome(losses[0], grad_norm, model.pfc.weight.grad)
    if outcome == StepOutcome.LOSS_NONFINITE and model.pfc.defer_label_check:
        for _, labels in micro_batches:  # a bad label is a data error, not a diverging loss
            model.pfc.check_labels(labels)
    if outcome:
        model.optimizer.zero_grad(set_to_none=True)
        model.restore_bn_buffers()
        if model.scaler.is_enabled():
            _back_off(model.scaler)
        with warnings.catch_warnings():  # torch warns when the very first step is skipped: that is on purpose
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"))
            model.scheduler.step()
    else:
        model.scaler.step(model.optimizer)
        model.scaler.update()
        model.optimizer.zero_grad(set_to_none=True)
        model.scheduler.step()
    return losses, outcome


def _agreed_outcome(loss: torch.Tensor, grad_norm: torch.Tensor, centre_grad: torch.Tensor) -> StepOutcome:
    """The worst outcome over ranks, computed on the device: the step's one wait for the device."""
    # The sum is non-finite exactly when an element is (short of an overflow no real gradient reaches), and
    # unlike isfinite(centre_grad) it needs no temporaries the size of the centre matrix.
    grads_finite = torch.isfinite(grad_norm) & torch.isfinite(centre_grad.sum())
    local = torch.where(torch.isfinite(loss), torch.where(grads_finite, 0.0, 1.0), 2.0).to(torch.float32)
    return StepOutcome(int(all_reduce_max(local).item()))


def _back_off(scaler: torch.amp.GradScaler) -> None:
    """A skipped step backs the grad scale off as if the scaler had found the overflow itself: scale
    times backoff_factor, growth counted from zero again."""
    state = scaler.state_dict()
    scaler.update()  # forgets this step's unscale_, so that the next step may unscale again
    scaler.load_state_dict({**state, "scale": state["scale"] * state["backoff_factor"], "_growth_tracker": 0})


def _count_nonfinite(outcome: StepOutcome, progress: Progress, cfg, checkpointer: Checkpointer) -> None:
    """Count skipped steps; fp16 gradient overflow alone is routine (the scale backs off) and not counted."""
    if outcome == StepOutcome.TAKEN or (outcome == StepOutcome.GRAD_NONFINITE and cfg.fp16):
        progress.nonfinite_in_a_row = 0
        return
    progress.nonfinite_in_a_row += 1
    progress.nonfinite_total += 1
    what = "loss" if outcome == StepOutcome.LOSS_NONFINITE else "gradient"
    log.warning("Global Step %d: non-finite %s, step skipped (%d in a row, %d in this run)", progress.global_step,
                what, progress.nonfinite_in_a_row, progress.nonfinite_total)
    if progress.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
        raise TrainingError(f"stopped at global step {progress.global_step}: {progress.nonfinite_in_a_row} "
                            f"non-finite losses in a row (max_nonfinite_steps={cfg.max_nonfinite_steps}); "
                            f"{checkpointer.last_good()}; lower lr, try bf16 instead of fp16, or check the data")


def _debug_nan_steps() -> frozenset[int]:
    text = os.environ.get(DEBUG_NAN_STEPS_VARIABLE, "")
    return frozenset(int(step) for step in text.split(",") if step.strip())


def train(cfg: SimpleNamespace, device: torch.device) -> dict[str, float]:
    """Run training as configured; returns the final verification accuracies (rank 0; {} elsewhere)."""
    source = agreed(lambda: resolve_resume(cfg.output, cfg.resume))
    lock = agreed(lambda: lock_run_dir(cfg.output), share=False)
    try:
        return _train_in_folder(cfg, device, source)
    finally:
        if lock is not None:
            lock.close()


def _train_in_folder(cfg: SimpleNamespace, device: torch.device, source) -> dict[str, float]:
    """Config -> data -> model -> resume -> loop (with its saves) in the locked run folder."""
    setup_logging(cfg.output)
    log.info("config: %s", ", ".join(f"{k}={v!r}" for k, v in sorted(vars(cfg).items())))
    log.info("device %s, backend %s, %d process(es) on %d node(s)", describe_device(device), backend(), world(),
             nodes())
    if cfg.fp16 and device.type == "cpu":
        log.warning("fp16 on a CPU: float16 convolutions have no fast CPU kernel (measured 25x slower than "
                    "bfloat16); set bf16=True instead of fp16 for CPU runs")
    dataset = build_dataset(cfg.rec, num_views=cfg.num_views, view_source=cfg.view_source,
                            num_classes=cfg.num_classes, flip=cfg.flip, skip_bad_records=cfg.skip_bad_records,
                            seed=cfg.seed, dali_aug=cfg.dali_aug, num_samples=cfg.num_image)
    loader = build_loader(dataset, cfg.batch_size, rank=rank(), world_size=world(), seed=cfg.seed,
                          num_workers=cfg.num_workers, device=device, gpu_decode=cfg.dali)
    progress = Progress(steps_per_epoch=_steps_per_epoch(loader, cfg.gradient_acc))
    _check_memory(cfg, dataset.num_classes, device)
    model = build_training(cfg, dataset.num_classes, device, progress.steps_per_epoch)
    checkpointer = Checkpointer(cfg.output, model, loader, model_info(cfg, dataset.num_classes), vars(cfg),
                                save_every_steps=cfg.save_every_steps, save_all_states=cfg.save_all_states)
    torch.manual_seed(cfg.seed + 1 + rank())  # per-rank streams for centre sampling and dropout
    if source:
        checkpointer.resume(source, progress)  # replaces those streams with the saved ones
    wrap_in_ddp(model, device)
    total_steps = progress.steps_per_epoch * cfg.num_epoch
    stop = min(total_steps, cfg.max_steps) if cfg.max_steps else total_steps
    log.info("%d records, %d classes, %d process(es), %d steps per epoch, %d steps in all, starting at step %d",
             len(dataset), dataset.num_classes, world(), progress.steps_per_epoch, total_steps, progress.global_step)
    metrics = open_metrics(cfg)
    try:
        results = _loop(cfg, model, loader, progress, checkpointer, stop, metrics)
    finally:
        metrics.close()  # flushes the last scalars, also when the run stops on an error
    log.info("training finished at global step %d: %s", progress.global_step,
             ", ".join(f"{name} Accuracy-Flip {acc:.5f}" for name, acc in results.items()) or "no val_targets")
    if device.type == "cuda":
        log.info("peak GPU memory %.2f GiB", torch.cuda.max_memory_allocated(device) / 2 ** 30)
    return results


def _check_memory(cfg: SimpleNamespace, num_classes: int, device: torch.device) -> None:
    """Log the memory plan; warn, with what would fit, when it exceeds what this process may use."""
    plan, available = memory_plan(cfg, num_classes, world()), device_bytes(device)
    log.info("memory plan per process: %.2f GiB (class centres %.2f GiB), %.2f GiB available on %s",
             plan["total"] / 2 ** 30, plan["class_centres"] / 2 ** 30, available / 2 ** 30, device)
    if plan["total"] > available:
        fits = processes_that_fit(cfg, num_classes, world(), available)
        advice = f"use {fits} processes or more" if fits else "use a smaller network"
        log.warning("the memory plan (%.2f GiB per process) exceeds the %.2f GiB available on %s: lower sample_rate "
                    "(now %g) or batch_size, or %s", plan["total"] / 2 ** 30, available / 2 ** 30, device,
                    cfg.sample_rate, advice)


def _steps_per_epoch(loader: FaceLoader, gradient_acc: int) -> int:
    if len(loader) < gradient_acc:
        raise ConfigError(f"an epoch has {len(loader)} batches per process, fewer than gradient_acc={gradient_acc}; "
                          "lower gradient_acc or batch_size")
    return len(loader) // gradient_acc


def _loop(cfg, model: Model, loader: FaceLoader, progress: Progress, checkpointer: Checkpointer, stop: int,
          metrics: Metrics) -> dict[str, float]:
    """Steps progress.global_step .. stop - 1: train, log, verify, save. The final verification accuracies."""
    verification = VerificationCallback(cfg.verbose, cfg.val_targets, cfg.rec, summary_writer=metrics)
    speed = SpeedLogger(cfg.frequent, stop, cfg.batch_size * world() * cfg.gradient_acc, cfg.num_views,
                        summary_writer=metrics, start_step=progress.global_step)
    nan_steps = _debug_nan_steps()
    grad_scale = model.scaler.get_scale if model.scaler.is_enabled() else None
    results, verified_at = {}, -1
    model.backbone.train()  # verification leaves it in train mode again
    start = progress.global_step
    for step, micro_batches in enumerate(loader.steps(start, stop, cfg.gradient_acc), start=start):
        epoch, lr = progress.epoch, model.optimizer.param_groups[0]["lr"]  # of this step, for the log
        losses, outcome = train_step(model, micro_batches, cfg, inject_nan=is_main() and step + 1 in nan_steps)
        progress.global_step = step + 1
        _count_nonfinite(outcome, progress, cfg, checkpointer)
        if outcome != StepOutcome.LOSS_NONFINITE:  # a skipped fp16 overflow step still has a loss worth logging
            speed(progress.global_step, losses, epoch, lr, grad_scale)
        with speed.paused():
            accuracy = verification(progress.global_step, model.backbone)
            final = progress.global_step == stop
            if checkpointer.after_step(progress, final) and is_main():
                name = "Final" if final else f"step{progress.global_step}"
                metrics.log_artifact(Path(cfg.output) / BACKBONE_NAME, name)
        if accuracy is not None:
            results, verified_at = accuracy, progress.global_step
    if verified_at != progress.global_step:
        with speed.paused():
            results = verification.evaluate_now(model.backbone, progress.global_step)
    return results


if __name__ == "__main__":
    sys.exit(main())
