"""Train a face-recognition backbone with a multi-view margin softmax over sharded class centres.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair.py
    python train.py configs/synthetic_pair.py --set num_epoch=2 --set lr=0.05
    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair.py --resume

One step: the loader's (B, V, 3, 112, 112) uint8 batch -> one backbone pass over the B*V images
-> V embedding tensors -> PartialFC (one loss over all views) -> one backward -> clip -> one
optimizer step over backbone and centres -> LR step. Run folder: training.log, tensorboard/,
checkpoint.pt (full state, resumable on any world size), backbone.pth (arcface_torch-compatible).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from backbones import get_model, load_backbone
from dataset import build_dataset, build_loader
from eval.callback import VerificationCallback
from losses import CombinedMarginLoss
from partial_fc import PartialFC, class_range
from utils.checkpoint import (BACKBONE_NAME, CHECKPOINT_NAME, load_checkpoint, my_rank_state,
                              restore_training_state, save_backbone, save_checkpoint, set_rng_state)
from utils.config import check_data_path, load_config
from utils.distributed import (all_reduce_max, broadcast_object, cleanup, init_distributed, is_main, launched_rank,
                               rank, world)
from utils.image import normalize
from utils.log import SpeedLogger, setup_logging
from utils.lr_scheduler import build_scheduler
from utils.errors import ConfigError, TrainingError, UserError, report
from utils.run_dir import lock_run_dir, resolve_resume

log = logging.getLogger("train")


LOSS_NONFINITE, GRAD_NONFINITE = 2.0, 1.0  # severities agreed over ranks with a max


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pairface training (arcface_torch-style, multi-view)")
    parser.add_argument("config", help="experiment file, e.g. configs/ms1mv3_r50_pair.py")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override a config key (value parsed as a Python literal); repeatable")
    parser.add_argument("--resume", action="store_true", help="continue the run in the config's output folder")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set + (["resume=True"] if args.resume else []))
        check_data_path(cfg)
        env = init_distributed()
        if env.device.type == "cpu":
            _share_cpu(cfg.num_workers)
        try:
            train(cfg, env.device)
        finally:
            cleanup()
    except UserError as error:
        # Config errors happen identically on every process, before the process group exists: one copy is enough.
        if launched_rank() == 0 or not isinstance(error, ConfigError):
            report(error)
        return 1
    return 0


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


def _agreed(decide, share: bool = True):
    """Run `decide()` on rank 0 and raise its user error on every rank, so that no process is left
    waiting at a collective for one that stopped. Returns the result on every rank (`share`), or
    on rank 0 only (None elsewhere) for results that cannot travel, such as an open file."""
    outcome, error = None, None
    if is_main():
        try:
            outcome = decide()
        except UserError as raised:
            error = raised
    error = broadcast_object(error)
    if error is not None:
        raise error
    return broadcast_object(outcome) if share else outcome


@dataclass
class Model:
    backbone: nn.Module            # the plain backbone (checkpoints, verification)
    forward: nn.Module             # what the step calls: DDP-wrapped when world > 1
    pfc: PartialFC
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler


def build_model(cfg: SimpleNamespace, num_classes: int, device: torch.device) -> tuple[nn.Module, PartialFC]:
    """Backbone and class centres, initialised from cfg.seed alone (the same on any world size)."""
    torch.manual_seed(cfg.seed)
    backbone = get_model(cfg.network, num_features=cfg.embedding_size, dropout=cfg.dropout, fp16=cfg.fp16,
                         **cfg.network_kwargs).to(device)
    margin = CombinedMarginLoss(cfg.margin_scale, *cfg.margin_list, cfg.interclass_filtering_threshold,
                                straight_through=cfg.straight_through_margin)
    pfc = PartialFC(margin, cfg.embedding_size, num_classes, cfg.sample_rate, fp16=cfg.fp16,
                    view_weights=cfg.view_weights).to(device)
    # Draw the whole centre matrix and keep this rank's rows: every rank's shard is distinct and
    # a 1-process and an N-process run start from the same classifier.
    start, count = class_range(num_classes, rank(), world())
    full = torch.normal(0.0, 0.01, (num_classes, cfg.embedding_size), generator=torch.Generator().manual_seed(cfg.seed))
    with torch.no_grad():
        pfc.weight.copy_(full[start:start + count])
    return backbone, pfc


def build_optimizer(cfg: SimpleNamespace, backbone: nn.Module, pfc: PartialFC) -> torch.optim.Optimizer:
    """One optimizer, two parameter groups (backbone, centres), the same lr and weight decay (upstream)."""
    groups = [{"params": list(backbone.parameters())}, {"params": list(pfc.parameters())}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_training(cfg: SimpleNamespace, num_classes: int, device: torch.device, steps_per_epoch: int) -> Model:
    """Everything a step needs, single-process (the caller wraps `forward` in DDP when world > 1)."""
    backbone, pfc = build_model(cfg, num_classes, device)
    optimizer = build_optimizer(cfg, backbone, pfc)
    scheduler = build_scheduler(optimizer, steps_per_epoch * cfg.warmup_epoch, steps_per_epoch * cfg.num_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16, growth_interval=100)
    return Model(backbone=backbone, forward=backbone, pfc=pfc, optimizer=optimizer, scheduler=scheduler, scaler=scaler)


def model_info(cfg: SimpleNamespace, num_classes: int) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    return {"network": cfg.network, "network_kwargs": dict(cfg.network_kwargs),
            "embedding_size": cfg.embedding_size, "num_classes": num_classes}


@dataclass
class Progress:
    global_step: int = 0           # optimizer steps done
    steps_per_epoch: int = 1
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0

    @property
    def epoch(self) -> int:
        return self.global_step // self.steps_per_epoch


def _resume(cfg, source, model: Model, loader, progress: Progress, info: dict) -> None:
    """Load the resume source into the run: weights, optimizer, schedule, data position and, with an
    unchanged world size, this rank's random streams (the loader draws from none of them)."""
    kind, path = source
    if kind == "backbone":
        weights = load_backbone(cfg.network, path, num_features=cfg.embedding_size, dropout=cfg.dropout,
                                **cfg.network_kwargs)
        model.backbone.load_state_dict(weights.state_dict())
        log.info("initialised the backbone from %s (a bare backbone: class centres, optimizer and schedule "
                 "start fresh)", path)
        return
    checkpoint = load_checkpoint(path, info)
    restore_training_state(checkpoint, backbone=model.backbone, pfc=model.pfc, optimizer=model.optimizer,
                           scheduler=model.scheduler, grad_scaler=model.scaler)
    saved = checkpoint["progress"]
    progress.nonfinite_total = saved["nonfinite_total"]
    mine = my_rank_state(checkpoint)
    if saved["steps_per_epoch"] == progress.steps_per_epoch and mine is not None:
        progress.global_step = saved["global_step"]
        loader.load_state_dict(mine["loader"])
    else:
        # Another world size, batch size or accumulation: keep the fraction of training done, so the
        # LR schedule and the epoch continue where they were (the exact sample order cannot).
        progress.global_step = round(saved["global_step"] * progress.steps_per_epoch / saved["steps_per_epoch"])
        model.scheduler.last_epoch = progress.global_step
        loader.load_state_dict({**checkpoint["per_rank"][0]["loader"], "epoch": progress.epoch,
                                "batch_size": cfg.batch_size, "world_size": world(),
                                "batches_consumed": (progress.global_step % progress.steps_per_epoch)
                                * cfg.gradient_acc})
        log.warning("resuming a run of %d process(es) and %d steps per epoch with %d and %d: step %d becomes "
                    "step %d; the data order of this epoch differs from the original run",
                    checkpoint["world_size"], saved["steps_per_epoch"], world(), progress.steps_per_epoch,
                    saved["global_step"], progress.global_step)
    log.info("resumed from %s at global step %d (epoch %d), lr %.6f", path, progress.global_step, progress.epoch,
             model.optimizer.param_groups[0]["lr"])
    _log_config_changes(checkpoint["config"], vars(cfg))
    if mine is not None:
        set_rng_state(mine["rng"])


def _log_config_changes(saved: dict, current: dict) -> None:
    changed = [f"{key}: {saved[key]!r} -> {current[key]!r}" for key in sorted(current)
               if key in saved and saved[key] != current[key] and key != "resume"]
    if changed:
        log.info("config differs from the checkpoint's: %s", "; ".join(changed))


def _forward_backward(model: Model, images: torch.Tensor, labels: torch.Tensor, cfg,
                      inject_nan: bool) -> torch.Tensor:
    """One micro-batch: returns [loss, loss of view 1..V] (detached); gradients accumulate."""
    batch, views = images.shape[:2]
    flat = normalize(images).reshape(batch * views, *images.shape[2:])  # row b*V + v = record b, view v
    precision = torch.autocast(flat.device.type, dtype=torch.bfloat16) if cfg.bf16 else contextlib.nullcontext()
    with precision:
        embeddings = model.forward(flat)
    per_view = embeddings.float().reshape(batch, views, -1).unbind(dim=1)
    loss = model.pfc(per_view, labels)
    if inject_nan:
        loss = loss + float("nan")
    model.scaler.scale(loss / cfg.gradient_acc).backward()
    return torch.cat([loss.detach().reshape(1), model.pfc.last_view_losses.to(loss.device)])


def train_step(model: Model, micro_batches, cfg, inject_nan: bool = False) -> tuple[list[float], float]:
    """One optimizer step over `gradient_acc` micro-batches. Returns ([loss, view losses...], verdict):
    verdict 0 = stepped, else the step was skipped on every rank (LOSS_/GRAD_NONFINITE)."""
    # BatchNorm statistics move during the forward pass, before the loss is known: kept to be put back
    # when the step is skipped, so that a non-finite batch leaves the model exactly as it was.
    statistics = [buffer.detach().clone() for buffer in model.backbone.buffers()]
    stats = []
    for i, (images, labels) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or model.forward is model.backbone else model.forward.no_sync()
        with sync:
            stats.append(_forward_backward(model, images, labels, cfg, inject_nan))
    model.scaler.unscale_(model.optimizer)
    grad_norm = nn.utils.clip_grad_norm_(model.backbone.parameters(), cfg.max_grad_norm)
    grads_finite = torch.isfinite(grad_norm) & torch.isfinite(model.pfc.weight.grad).all()
    values = torch.cat([torch.stack(stats).mean(dim=0), grads_finite.reshape(1).to(stats[0])]).tolist()
    losses, grads_ok = values[:-1], values[-1] > 0
    local = LOSS_NONFINITE if not math.isfinite(losses[0]) else (0.0 if grads_ok else GRAD_NONFINITE)
    verdict = all_reduce_max(local)  # every rank steps, or none does
    if verdict:
        model.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, kept in zip(model.backbone.buffers(), statistics):
                buffer.copy_(kept)
        if model.scaler.is_enabled():
            model.scaler.update(model.scaler.get_scale() * model.scaler.get_backoff_factor())
        with warnings.catch_warnings():  # torch warns when the very first step is skipped: that is on purpose
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"))
            model.scheduler.step()
    else:
        model.scaler.step(model.optimizer)
        model.scaler.update()
        model.optimizer.zero_grad(set_to_none=True)
        model.scheduler.step()
    return losses, verdict


def _check_nonfinite(verdict: float, progress: Progress, cfg) -> None:
    """Count skipped steps; fp16 gradient overflow alone is routine (the scale backs off) and not counted."""
    if not verdict or (verdict == GRAD_NONFINITE and cfg.fp16):
        progress.nonfinite_in_a_row = 0
        return
    progress.nonfinite_in_a_row += 1
    progress.nonfinite_total += 1
    what = "loss" if verdict == LOSS_NONFINITE else "gradient"
    log.warning("Global Step %d: non-finite %s, step skipped (%d in a row, %d in this run)", progress.global_step,
                what, progress.nonfinite_in_a_row, progress.nonfinite_total)
    if progress.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
        raise TrainingError(f"stopped at global step {progress.global_step}: {progress.nonfinite_in_a_row} "
                            f"non-finite losses in a row (max_nonfinite_steps={cfg.max_nonfinite_steps}); "
                            f"{_checkpoint_hint(cfg)}; lower lr, try bf16 instead of fp16, or check the data")


def train(cfg: SimpleNamespace, device: torch.device) -> dict[str, float]:
    """Run training as configured; returns the final verification accuracies (rank 0; {} elsewhere)."""
    source = _agreed(lambda: resolve_resume(cfg.output, cfg.resume))
    lock = _agreed(lambda: lock_run_dir(cfg.output), share=False)
    try:
        return _run(cfg, device, source)
    finally:
        if lock is not None:
            lock.close()


def _run(cfg: SimpleNamespace, device: torch.device, source) -> dict[str, float]:
    setup_logging(cfg.output)
    log.info("config: %s", ", ".join(f"{k}={v!r}" for k, v in sorted(vars(cfg).items())))
    dataset = build_dataset(cfg.rec, num_views=cfg.num_views, view_source=cfg.view_source,
                            num_classes=cfg.num_classes, flip=cfg.flip, skip_bad_records=cfg.skip_bad_records,
                            seed=cfg.seed)
    loader = build_loader(dataset, cfg.batch_size, rank=rank(), world_size=world(), seed=cfg.seed,
                          num_workers=cfg.num_workers, device=device)
    steps_per_epoch = len(loader) // cfg.gradient_acc
    if steps_per_epoch < 1:
        raise ConfigError(f"an epoch has {len(loader)} batches per process, fewer than gradient_acc="
                          f"{cfg.gradient_acc}; lower gradient_acc or batch_size")
    total_steps = steps_per_epoch * cfg.num_epoch
    model = build_training(cfg, dataset.num_classes, device, steps_per_epoch)
    backbone, optimizer = model.backbone, model.optimizer
    progress = Progress(steps_per_epoch=steps_per_epoch)
    info = model_info(cfg, dataset.num_classes)
    # Per-rank streams for centre sampling and dropout (a resume replaces them with the saved ones).
    torch.manual_seed(cfg.seed + 1 + rank())
    if source:
        _resume(cfg, source, model, loader, progress, info)
    if world() > 1:
        model.forward = DistributedDataParallel(backbone, device_ids=[device.index] if device.type == "cuda" else None,
                                                forward_sync_buffers=False)
    writer = _summary_writer(cfg.output)
    verification = VerificationCallback(cfg.verbose, cfg.val_targets, cfg.rec, summary_writer=writer)
    stop_at = min(total_steps, cfg.max_steps) if cfg.max_steps else total_steps
    speed = SpeedLogger(cfg.frequent, stop_at, cfg.batch_size * world() * cfg.gradient_acc, cfg.num_views,
                        summary_writer=writer, start_step=progress.global_step)
    log.info("%d records, %d classes, %d process(es), %d steps per epoch, %d steps in all, starting at step %d",
             len(dataset), dataset.num_classes, world(), steps_per_epoch, total_steps, progress.global_step)

    def save(final: bool = False) -> None:
        nonlocal saved_at, save_due
        # While losses are non-finite the last good checkpoint stays (a stop for too many of them leaves
        # it as it was); the save waits for a step taken, or for the end of the run.
        save_due = progress.nonfinite_in_a_row > 0 and not final
        if not save_due and saved_at != progress.global_step:
            with speed.paused():
                _save(cfg, model, loader, progress, info)
            saved_at = progress.global_step

    results: dict[str, float] = {}
    verified_at = saved_at = -1
    save_due = False
    model.backbone.train()  # verification leaves it in train mode again
    try:
        while progress.global_step < stop_at:
            loader.set_epoch(progress.epoch)
            batches = iter(loader)
            epoch_end = (progress.epoch + 1) * steps_per_epoch
            while progress.global_step < min(epoch_end, stop_at):
                micro_batches = [next(batches) for _ in range(cfg.gradient_acc)]
                inject = is_main() and (progress.global_step + 1) in cfg.debug_nan_steps
                epoch, lr = progress.epoch, optimizer.param_groups[0]["lr"]  # of this step, for the log
                losses, verdict = train_step(model, micro_batches, cfg, inject)
                progress.global_step += 1
                _check_nonfinite(verdict, progress, cfg)
                if verdict != LOSS_NONFINITE:  # a skipped fp16 overflow step still has a loss worth logging
                    speed(progress.global_step, losses[0], losses[1:], epoch, lr,
                          model.scaler.get_scale() if model.scaler.is_enabled() else None)
                with speed.paused():
                    accuracy = verification(progress.global_step, backbone)
                if accuracy is not None:
                    results, verified_at = accuracy, progress.global_step
                if save_due or (cfg.save_every_steps and progress.global_step % cfg.save_every_steps == 0):
                    save()
            batches.close()
            if progress.global_step % steps_per_epoch == 0 or progress.global_step == stop_at:
                save(final=progress.global_step == stop_at)
        if verified_at != progress.global_step:
            with speed.paused():
                results = verification.evaluate_now(backbone, progress.global_step)
    finally:
        if writer is not None:
            writer.close()  # flushes the last scalars, also when the run stops on an error
    log.info("training finished at global step %d: %s", progress.global_step,
             ", ".join(f"{name} Accuracy-Flip {acc:.5f}" for name, acc in results.items()) or "no val_targets")
    return results


def _summary_writer(output: str):
    if not is_main():
        return None
    from torch.utils.tensorboard import SummaryWriter  # imported late: tensorboard is slow to import
    return SummaryWriter(log_dir=f"{output}/tensorboard")


def _checkpoint_hint(cfg) -> str:
    for name, advice in ((CHECKPOINT_NAME, " (continue with --resume)"), (BACKBONE_NAME, "")):
        if os.path.exists(os.path.join(cfg.output, name)):
            return f"the last good {name} in {cfg.output} is untouched{advice}"
    return "no checkpoint had been written yet"


def _save(cfg, model: Model, loader, progress: Progress, info: dict) -> None:
    if cfg.save_all_states:
        path = save_checkpoint(cfg.output, backbone=model.backbone, pfc=model.pfc, optimizer=model.optimizer,
                               scheduler=model.scheduler, grad_scaler=model.scaler,
                               progress={"global_step": progress.global_step, "epoch": progress.epoch,
                                         "steps_per_epoch": progress.steps_per_epoch,
                                         "nonfinite_total": progress.nonfinite_total},
                               loader_state=loader.state_dict(), model_info=info, config=vars(cfg))
        log.info("saved %s at global step %d", path, progress.global_step)
    save_backbone(model.backbone, cfg.output)


if __name__ == "__main__":
    sys.exit(main())
