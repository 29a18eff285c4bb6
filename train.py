"""Train a face-recognition backbone with a multi-view margin softmax over sharded class centres.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair.py
    python train.py configs/synthetic_pair.py --set num_epoch=2 --set lr=0.05
    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair.py --resume

This file is the command line and the loop: config -> data -> training state -> resume -> steps (each
one `training.step.train_step`), with their log lines, verification and saves. Run folder:
training.log, tensorboard/, checkpoint.json + checkpoint-<step>/ (the full state, sharded, resumable
on any world size), backbone.pth (arcface_torch-compatible) and model.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import torch

from backbones.trained import BACKBONE_NAME, MODEL_INFO_NAME, find_saved_backbone
from checkpoint.backbone_network import NETWORK_KEYS, backbone_network_sets, network_words
from checkpoint.checkpointer import Checkpointer, Renumbering, last_good
from checkpoint.last_start import KilledStart, killed_start
from checkpoint.restored import Restored
from checkpoint.run_dir import (
    AUTO,
    RUN_CONFIG_NAME,
    ResumeCommand,
    continues_torchrun_run,
    lock_run_dir,
    remove_started_folder,
    resolve_resume,
    resumed_overrides,
)
from checkpoint.sources import BareBackbone
from dataset import (
    TRAINING_RECORDS,
    FaceLoader,
    build_dataset,
    build_loader,
    classes_in_header,
    preparation_note,
    recorded_preparation,
)
from eval.callback import VerificationCallback, check_keep_best, check_val_targets
from training.best_model import BestModel
from training.components import exported_backbone
from training.config import load_config
from training.memory_plan import check_world_size, describe, describe_fit, device_bytes, fit, memory_plan
from training.speedups import layout_advice
from training.state import (
    CENTRES_GROUP,
    StepCounter,
    TrainingState,
    architecture,
    backbone_frozen,
    build_training_state,
    describe_margin,
    wrap_for_the_step,
)
from training.step import StepOutcome, train_step
from utils.cli import report
from utils.compat import require_supported_torch
from utils.config import check_data_path, planned_world_size, set_item
from utils.device import choose_device, configure_numerics, describe_device
from utils.distributed import backend, cleanup, init_distributed, is_main, lost_peer, nodes, rank, run_on_rank0, world
from utils.errors import ConfigError, TrainingError, UserError
from utils.launcher import adopt_srun_environment, launched_rank, local_process, torchrun_run_id
from utils.log import FILE_ONLY, SpeedLogger, log_to_file_only, setup_logging
from utils.metrics import Metrics, open_metrics
from utils.network import describe_host
from utils.rank0_verdict import CONFIG_ERROR, NO_CONFIG_ERROR, announce_verdict, rank0_had_config_error
from utils.sizes import parse_size
from utils.source_watch import SourceWatch
from utils.stop import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_SAVE_FAILED, RunStopped, StopRequest, StopSignals
from utils.watchdog import EXIT_STATUS, exit_within

log = logging.getLogger("train")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pairface training (arcface_torch-style, multi-view)",
                                     epilog="Every config key, its default and what it does: configs/base.py.")
    parser.add_argument("config", help="experiment file, e.g. configs/ms1mv3_r50_pair.py (it overrides keys of "
                                       "configs/base.py)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override a config key, any of configs/base.py's (value parsed as a Python literal); "
                             "repeatable")
    parser.add_argument("--resume", action="store_true", help="continue the run in the config's output folder")
    parser.add_argument("--start-over", action="store_true",
                        help="start a run again in an output folder whose run was killed before its first whole "
                             "checkpoint (nothing in it is deleted)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config and each process's memory plan; read no data, start no "
                             "process group, write nothing")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --dry-run: plan for N processes (default: WORLD_SIZE, else 1)")
    parser.add_argument("--json", action="store_true", help="with --dry-run: one JSON object {config, memory}")
    parser.add_argument("--device-memory", metavar="SIZE",
                        help="with --dry-run: memory per process, e.g. 80GiB (default: this machine's GPU, if any); "
                             "says whether the run fits, the largest batch_size and the fewest processes that fit")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sources = SourceWatch()  # the code this process runs, before any of it can change under it
    cfg, phase = None, "startup"
    try:
        require_supported_torch()
        adopt_srun_environment()  # before anything reads RANK: `srun python train.py` tells only Slurm's variables
        overrides = args.set + (["resume=True"] if args.resume else [])
        cfg = load_config(args.config, overrides)
        kept = resumed_overrides(cfg.output, cfg.resume, overrides) if cfg.resume else []
        if kept:  # what the run was started with, unless said otherwise now
            overrides = kept + overrides
            cfg = load_config(args.config, overrides)
        config_said = {key: getattr(cfg, key) for key in NETWORK_KEYS}
        if adopted := backbone_network_sets(cfg, overrides):  # the backbone's network keys, where the config's differ
            overrides = overrides + [set_item(key, value) for key, value in adopted.items()]
            cfg = load_config(args.config, overrides)
        if args.dry_run:
            print(dry_run_report(cfg, planned_world_size(args.world_size, os.environ), args.json, _device_memory(args)))
            return 0
        _refuse_report_options(args)
        check_data_path(cfg)
        check_val_targets(cfg.val_targets, cfg.rec)  # before any model is built (minutes for a large one)
        check_keep_best(cfg.keep_best, cfg.val_targets, cfg.rec)
        device = choose_device(cfg.device, *local_process())
        configure_numerics(device, cfg.tf32, cfg.deterministic)
        if launched_rank() == 0:
            announce_verdict(phase, NO_CONFIG_ERROR)
        phase = "training"
        settings = RunSettings(args.config, overrides, kept, config_said if adopted else None, args.start_over)
        _train_in_process_group(cfg, device, settings, sources)
    except UserError as error:
        _report_user_error(error, phase)
        return 1
    except RunStopped as stopped:  # its line is in the log already
        return stopped.exit_code
    except KeyboardInterrupt:  # a Ctrl-C before the steps began or after they ended
        _report_interrupt(cfg.output if cfg else None,  # cfg set: so are the overrides it was loaded with
                          str(RunSettings(args.config, overrides).resume_command) if cfg else "")
        return EXIT_INTERRUPTED
    return 0


def _train_in_process_group(cfg: SimpleNamespace, device: torch.device, settings: RunSettings,
                            sources: SourceWatch | None = None) -> None:
    """train() among the processes of the job, with stop signals caught (and `sources` watched) until the process
    group is gone."""
    init_distributed(device, cfg.timeout_minutes, cfg.network_check_seconds)
    if device.type == "cpu":
        _share_cpu(cfg.num_workers)
    try:
        with StopSignals(sources) as signals:
            train(cfg, device, settings, signals)
    except RunStopped:  # its line is written (a lost peer's too, whose words would match it again)
        raise
    except Exception as error:
        if (stopped := _stop_on_lost_peer(error, cfg, settings)) is None:
            raise
        raise stopped from error
    finally:
        cleanup()


def _stop_on_lost_peer(error: BaseException, cfg: SimpleNamespace, settings: RunSettings) -> RunStopped | None:
    """When `error` is a collective failing because another process went away: its line, written now, and the
    RunStopped to raise; None for any other error. What is left to do on the way out (a save in flight, the process
    group's end) may wait on the lost process for timeout_minutes, which would keep torchrun from restarting this
    one: the process ends within network_check_seconds of the line, whatever still waits."""
    if (failure := lost_peer(error)) is None:
        return None
    lost = TrainingError(f"lost contact with another process ({failure}), which stopped or became unreachable: its "
                         "own error line, if it printed one, says why; fix that, then continue from the last "
                         f"checkpoint with: {settings.resume_command}")
    exit_within(cfg.network_check_seconds)
    _report_user_error(lost, "training")
    return RunStopped(str(lost), EXIT_STATUS)


def _report_user_error(error: UserError, phase: str) -> None:
    """The one line of a user error. A config error happens identically on every process: rank 0 prints it and
    then says so; the others wait for that before they exit, since torchrun ends every worker as soon as one
    exits and could cut rank 0 off before its line. A rank whose config error rank 0 did not have prints its own."""
    config_error = isinstance(error, ConfigError)
    if launched_rank() != 0 and config_error and rank0_had_config_error(phase):
        return
    report(error)
    log_to_file_only(f"error: {error}")
    if launched_rank() == 0:
        announce_verdict(phase, CONFIG_ERROR if config_error else NO_CONFIG_ERROR)


def _report_interrupt(output: str | None, continue_with: str) -> None:
    """One line on stderr and in training.log for a Ctrl-C that stopped the run at once."""
    if launched_rank() != 0:
        return
    line = "stopped by Ctrl-C" + (f"; {last_good(output, continue_with)}" if output else "")
    sys.stderr.write(line + "\n")
    log_to_file_only(line)


def dry_run_report(cfg: SimpleNamespace, world_size: int, as_json: bool, available: int | None) -> str:
    """The resolved configuration and the memory plan of one process of `world_size`; with `available`
    bytes per process, whether it fits and the largest batch_size and fewest processes that would."""
    check_world_size(cfg, world_size)
    from_header = classes_in_header(cfg.rec) if cfg.num_classes is None and cfg.rec != "synthetic" else None
    num_classes = cfg.num_classes if from_header is None else from_header
    plan = memory_plan(cfg, num_classes, world_size)
    result = None if available is None or num_classes is None else fit(cfg, num_classes, world_size, available)
    launched = "WORLD_SIZE" in os.environ  # by torchrun or srun: what this rank sees of the network
    network = describe_host("nccl" if cfg.device != "cpu" and torch.cuda.is_available() else "gloo")
    if as_json:
        verdict = {} if result is None else {
            "device_memory": available, "fits": result.fits, "largest_batch_size": result.largest_batch_size,
            "fewest_processes": result.fewest_processes}
        read = {} if from_header is None else {"num_classes": from_header}  # beside the config, which says None
        return json.dumps({"config": vars(cfg), "memory": {"world_size": world_size, **read, **plan, **verdict},
                           **({"network": network} if launched else {})})
    keys = "\n".join(f"{key} = {value!r}" + (f"  # {from_header}, read from {cfg.rec}/train.rec's header"
                                              if key == "num_classes" and from_header is not None else "")
                     for key, value in vars(cfg).items())
    if result is not None:
        verdict = describe_fit(result, cfg, world_size, plan)
    elif available is None:
        verdict = "pass --device-memory SIZE (e.g. 80GiB) to see whether it fits"
    else:
        verdict = "set num_classes to see whether it fits"
    return (f"{keys}\n\nmargin: {describe_margin(cfg)}\n\n"
            f"memory per process, {world_size} process(es) (rank 0's: it holds the most centres), "
            f"batch_size {cfg.batch_size} x {cfg.num_views} view(s):\n{describe(plan, cfg)}\n{verdict}"
            + (f"\n\nnetwork, as this process sees it: {network}" if launched else ""))


def _device_memory(args: argparse.Namespace) -> int | None:
    """Bytes per process to plan for: --device-memory, else this machine's GPU, else unknown."""
    if args.device_memory is None:
        return device_bytes(torch.device("cuda", 0)) if torch.cuda.is_available() else None
    return parse_size(args.device_memory, "--device-memory")


def _refuse_report_options(args: argparse.Namespace) -> None:
    """--world-size, --json and --device-memory shape the --dry-run report alone: without it, one would
    be silently ignored."""
    for name in ("world_size", "json", "device_memory"):
        if getattr(args, name) not in (None, False):
            option = "--" + name.replace("_", "-")
            raise ConfigError(f"{option} only shapes the --dry-run report; add --dry-run, or drop {option} to train")


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


def _count_nonfinite(outcome: StepOutcome, counter: StepCounter, cfg, continue_with: str,
                     grad_scale: float | None) -> None:
    """Count skipped steps. fp16 gradient overflow alone is routine (the scale backs off) and not counted, unless
    it has pushed the grad scale (`grad_scale`, after the step; None without fp16, or where the step cannot have
    left it below min_grad_scale: _scale_to_check) below min_grad_scale: then every step counts, taken or not,
    until the scale has grown back."""
    collapsed = grad_scale is not None and grad_scale < cfg.min_grad_scale
    if not collapsed and (outcome == StepOutcome.TAKEN or (outcome == StepOutcome.GRAD_NONFINITE and cfg.fp16)):
        counter.nonfinite_in_a_row = 0
        return
    counter.nonfinite_in_a_row += 1
    counter.nonfinite_total += 1
    last_good_line = last_good(cfg.output, continue_with)
    if outcome != StepOutcome.LOSS_NONFINITE and collapsed:
        log.warning("Global Step %d: fp16 grad scale %g, below min_grad_scale=%g (%d in a row, %d in this run)",
                    counter.shown_step, grad_scale, cfg.min_grad_scale, counter.nonfinite_in_a_row,
                    counter.nonfinite_total)
        if counter.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
            raise TrainingError(f"stopped at global step {counter.shown_step}: the fp16 grad scale fell to "
                                f"{grad_scale:g}, below min_grad_scale={cfg.min_grad_scale:g}, for "
                                f"{counter.nonfinite_in_a_row} steps in a row (max_nonfinite_steps="
                                f"{cfg.max_nonfinite_steps}): float16 gradients overflow at every step and the loss "
                                f"no longer moves; {last_good_line}; set bf16=True instead of fp16, lower lr, or "
                                "lower max_grad_norm")
        return
    what = "loss" if outcome == StepOutcome.LOSS_NONFINITE else "gradient"
    log.warning("Global Step %d: non-finite %s, step skipped (%d in a row, %d in this run)", counter.shown_step,
                what, counter.nonfinite_in_a_row, counter.nonfinite_total)
    if counter.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
        raise TrainingError(f"stopped at global step {counter.shown_step}: {counter.nonfinite_in_a_row} "
                            f"non-finite losses in a row (max_nonfinite_steps={cfg.max_nonfinite_steps}); "
                            f"{last_good_line}; lower lr, try bf16 instead of fp16, or check "
                            "the data")


def _scale_to_check(outcome: StepOutcome, counter: StepCounter, first: bool) -> bool:
    """Whether the fp16 grad scale after this step may be below min_grad_scale, so that _count_nonfinite must read
    it (a read waits for the device). A step taken means every rank's every gradient was finite, so the scaler kept
    or grew the scale: below the bound after it only if it was before, which a streak being counted says (a
    collapsed scale counts every step) or which is unknown at the first step of a start (a resumed scale)."""
    return first or outcome != StepOutcome.TAKEN or counter.nonfinite_in_a_row > 0


@dataclass(frozen=True)
class RunSettings:
    """Where `cfg` came from: the config file and every --set override applied (those `kept` from the run's
    earlier start first); a resume of this run keeps them."""

    config_file: str
    overrides: Sequence[str] = ()
    kept: Sequence[str] = ()
    # The config's network keys, when the backbone it starts from replaced them (its model.json's, now --set values)
    replaced_network: Mapping[str, object] | None = None
    start_over: bool = False  # --start-over: a run killed before its first whole checkpoint starts again in its folder

    @property
    def resume_command(self) -> ResumeCommand:
        """The command line that continues this run (config file, every --set given, --resume)."""
        script = os.path.relpath(__file__)
        return ResumeCommand(os.path.abspath(__file__) if script.startswith("..") else script, self.config_file,
                             tuple(self.overrides))


def train(cfg: SimpleNamespace, device: torch.device, settings: RunSettings,
          signals: StopSignals) -> dict[str, float]:
    """Run training as configured; returns the final verification accuracies (rank 0; {} elsewhere).

    A start that torchrun makes again for the same run (after a lost process or node, or when a node
    joins) continues the run in its folder, as resume="auto" does, whatever `resume` says."""
    restarted = run_on_rank0(lambda: continues_torchrun_run(cfg.output, torchrun_run_id()))
    source = run_on_rank0(lambda: resolve_resume(cfg.output, AUTO if restarted else cfg.resume,
                                           settings.resume_command.with_sets, settings.start_over))
    if source is None and (cfg.freeze_backbone or cfg.freeze_backbone_steps):
        frozen = "freeze_backbone=True" if cfg.freeze_backbone else f"freeze_backbone_steps={cfg.freeze_backbone_steps}"
        raise ConfigError(f"{frozen} keeps the backbone as it starts, but this run starts it from nothing (resume "
                          "names no trained backbone), so the class centres would learn random features; set "
                          "resume=path/to/backbone.pth to fine-tune a trained one, or freeze_backbone=False and "
                          "freeze_backbone_steps=0 to train from nothing")
    killed = run_on_rank0(lambda: killed_start(cfg.output), share=False)  # read before this start writes its log
    made = not os.path.isdir(cfg.output)
    lock = run_on_rank0(lambda: lock_run_dir(cfg.output, torchrun_run_id()), share=False)
    try:
        return _train_in_folder(cfg, device, source, restarted, settings, signals, killed)
    except UserError:
        # One process alone: another one's error line may still be on its way into training.log.
        if lock is not None and made and world() == 1:
            lock.close()
            lock = None
            remove_started_folder(cfg.output)
        raise
    finally:
        if lock is not None:
            lock.close()


def _train_in_folder(cfg: SimpleNamespace, device: torch.device, source, restarted: bool, settings: RunSettings,
                     signals: StopSignals, killed: KilledStart | None = None) -> dict[str, float]:
    """Config -> data -> training state -> resume -> loop (with its saves) in the locked run folder. `killed`: how
    the run's last start in this folder ended, when it was killed (checkpoint.last_start), said once logging is up."""
    setup_logging(cfg.output)
    # For whoever reads the log, as arcface_torch's does; what tools read back is the run's record of its config,
    # config.json (checkpoint/run_dir.write_run_config).
    log.info("config: %s", ", ".join(f"{k}={v!r}" for k, v in sorted(vars(cfg).items())))
    log.info("margin %s", describe_margin(cfg))
    if settings.kept:
        log.info("kept from the run's earlier start (%s): --set %s; give --set again to change one",
                 RUN_CONFIG_NAME, " --set ".join(settings.kept))
    if settings.replaced_network:
        log.info("network %s: from %s beside the backbone it starts from (resume), in place of the config's %s",
                 network_words(vars(cfg)), Path(cfg.resume).parent / MODEL_INFO_NAME,
                 network_words(settings.replaced_network))
    log.info("device %s, backend %s, %d process(es) on %d node(s)", describe_device(device), backend(), world(),
             nodes())
    if cfg.fp16 and device.type == "cpu":
        log.warning("fp16 on a CPU: float16 convolutions have no fast CPU kernel (measured 25x slower than "
                    "bfloat16); set bf16=True instead of fp16 for CPU runs")
    if advice := layout_advice(cfg, world()):
        log.warning(advice)
    dataset = build_dataset(cfg.rec, num_views=cfg.num_views, view_source=cfg.view_source,
                            num_classes=cfg.num_classes, flip=cfg.flip, skip_bad_records=cfg.skip_bad_records,
                            seed=cfg.seed, dali_aug=cfg.dali_aug, num_samples=cfg.num_image,
                            crop_scale=cfg.crop_scale, erase_p=cfg.erase_p)
    loader = build_loader(dataset, cfg.batch_size, rank=rank(), world_size=world(), seed=cfg.seed,
                          num_workers=cfg.num_workers, device=device, gpu_decode=cfg.dali)
    counter = StepCounter(steps_per_epoch=_steps_per_epoch(loader, cfg.gradient_acc))
    _check_memory(cfg, dataset.num_classes, device)
    state = build_training_state(cfg, dataset.num_classes, device, counter.steps_per_epoch)
    trained_as = architecture(cfg, dataset.num_classes, recorded_preparation(cfg.rec))
    checkpointer = Checkpointer(cfg.output, state, loader, trained_as, vars(cfg),
                                save_every_steps=cfg.save_every_steps, save_all_states=cfg.save_all_states,
                                async_save=cfg.async_save, config_file=settings.config_file,
                                overrides=settings.overrides, continue_with=str(settings.resume_command))
    torch.manual_seed(cfg.seed + 1 + rank())  # per-rank streams for centre sampling and dropout
    restored = checkpointer.resume(source, counter) if source else None  # replaces those streams with the saved ones
    if restarted:
        _log_restart(restored, counter, cfg.save_every_steps)
    if killed is not None:
        log.warning("the run in %s: %s; %s", cfg.output, killed.describe(),
                    "resuming from its last whole checkpoint (the steps after it are trained again)" if restored
                    else "starting it over (nothing was deleted; training.log and TensorBoard go on)")
    wrap_for_the_step(state, cfg, device)
    _log_fine_tuning(cfg, state, counter.steps_per_epoch)
    if source is not None and isinstance(source.importer, BareBackbone):
        _log_backbone_preparation(source.path, cfg.rec)
    total_steps = counter.steps_per_epoch * cfg.num_epoch
    stop = min(total_steps, cfg.max_steps) if cfg.max_steps else total_steps
    log.info("%d records, %d classes, %d process(es), %d steps per epoch, %d steps in all, starting at step %d",
             len(dataset), dataset.num_classes, world(), counter.steps_per_epoch, total_steps, counter.global_step)
    if not _steps_left(cfg, counter, stop, checkpointer.renumbering):
        return {}
    best = run_on_rank0(
        lambda: cfg.keep_best and BestModel(cfg.output, cfg.keep_best, trained_as, counter.best_accuracy), share=False)
    metrics = open_metrics(cfg, counter.shown_step if source else None)
    try:
        results = _loop(cfg, state, loader, counter, checkpointer, stop, metrics, signals, best)
    except BaseException as error:
        stopped = _stop_on_lost_peer(error, cfg, settings)  # before the save in flight, which may wait on the peer
        checkpointer.finish_save_before_stop()
        if stopped is not None:
            raise stopped from error
        if signals.requested.saves and isinstance(error, Exception) and not isinstance(error, RunStopped):
            raise _save_failed(error, counter, checkpointer, signals) from error
        raise
    finally:
        loader.close()  # its workers end here, on every way out of the loop (they would outlive the process)
        metrics.close()  # flushes the last scalars, also when the run stops on an error or a signal
    log.info("training finished at global step %d: %s", counter.shown_step,
             ", ".join(f"{name} Accuracy-Flip {acc:.5f}" for name, acc in results.items()) or "no val_targets")
    if device.type == "cuda":
        log.info("peak GPU memory %.2f GiB", torch.cuda.max_memory_allocated(device) / 2 ** 30)
    return results


def _log_fine_tuning(cfg: SimpleNamespace, state: TrainingState, steps_per_epoch: int) -> None:
    if cfg.backbone_lr_mult != 1.0:
        log.info("the backbone's lr is backbone_lr_mult=%g times the scheduled lr (the class centres')",
                 cfg.backbone_lr_mult)
    if cfg.freeze_backbone:
        log.info("every step trains the class centres alone (freeze_backbone): the backbone's weights and BatchNorm "
                 "statistics stay as they are")
    elif backbone_frozen(state, cfg):  # not after a resume past those steps: they are behind it
        log.info("steps %d to %d of the LR schedule train the class centres alone (freeze_backbone_steps; %.3g "
                 "epochs of this data): the backbone's weights and BatchNorm statistics stay as they are",
                 state.scheduler.last_epoch + 1, cfg.freeze_backbone_steps, cfg.freeze_backbone_steps / steps_per_epoch)


def _log_backbone_preparation(weights: Path, rec: str) -> None:
    """Fine-tuning a backbone whose model.json records how its training photos were prepared: whether the
    training records give it the same faces, said as eval.verification says it of a .bin."""
    info = weights.parent / MODEL_INFO_NAME
    if not is_main() or not info.is_file():
        return
    note = preparation_note(Path(rec) / TRAINING_RECORDS, find_saved_backbone(weights).photo_preparation, info,
                            ("fine-tuning shows the backbone faces unlike those it learned from", "tools.pack_rec"))
    if note and note.startswith("warning: "):
        log.warning("%s", note.removeprefix("warning: "))
    elif note:
        log.info("%s", note)


def _log_restart(restored: Restored | None, counter: StepCounter, save_every_steps: int) -> None:
    """What a torchrun restart changed: the processes, where the run continues, what is trained again."""
    before = f"{restored.world_size} process(es)" if restored else "a backbone.pth alone (save_all_states=False)"
    lost = f"save_every_steps={save_every_steps}" if save_every_steps else "an epoch, as save_every_steps=0"
    log.info("torchrun restarted this run (a process or node was lost, or one joined): %s -> %d process(es); it "
             "continues from its last checkpoint, at global step %d; steps taken after that checkpoint before the "
             "restart are trained again (at most %s)", before, world(), counter.shown_step, lost)


def _steps_left(cfg: SimpleNamespace, counter: StepCounter, stop: int, renumbering: Renumbering | None) -> bool:
    """Whether a resumed run has steps left before `stop`; says what max_steps means when the shown steps are
    not the schedule's, and why nothing is trained when none are left."""
    if counter.shown_offset and cfg.max_steps:
        log.info("max_steps=%d counts steps of the LR schedule (%d per epoch now): this run stops at its step %d, "
                 "shown in the log and TensorBoard as step %d", cfg.max_steps, counter.steps_per_epoch, stop,
                 counter.shown(stop))
    if counter.global_step < stop:
        return True
    end = f"step {stop}" if not counter.shown_offset else \
        f"step {stop} of the LR schedule, shown as step {counter.shown(stop)}"
    log.warning("nothing was trained: the run resumed at global step %d%s, already at or past the end of training "
                "(%s: max_steps=%d, num_epoch=%d); raise max_steps or num_epoch to train on", counter.shown_step,
                f" ({renumbering.describe()})" if renumbering else "", end, cfg.max_steps, cfg.num_epoch)
    return False


def _check_memory(cfg: SimpleNamespace, num_classes: int, device: torch.device) -> None:
    """Log the memory plan; warn, with what would fit, when it exceeds what this process may use. Rank 0
    alone: it holds the most centres, and its log is the run's."""
    if not is_main():
        return
    plan, available = memory_plan(cfg, num_classes, world()), device_bytes(device)
    log.info("memory plan per process: %.2f GiB (activations %.2f GiB, class centres %.2f GiB), %.2f GiB available "
             "on %s", plan["total"] / 2 ** 30, plan["activations"] / 2 ** 30, plan["class_centres"] / 2 ** 30,
             available / 2 ** 30, device)
    if plan["total"] > available:
        log.warning("the memory plan %s", describe_fit(fit(cfg, num_classes, world(), available), cfg, world(), plan))


def _steps_per_epoch(loader: FaceLoader, gradient_acc: int) -> int:
    if len(loader) < gradient_acc:
        raise ConfigError(f"an epoch has {len(loader)} batches per process, fewer than gradient_acc={gradient_acc}; "
                          "lower gradient_acc or batch_size")
    return len(loader) // gradient_acc


def _loop(cfg, state: TrainingState, loader: FaceLoader, counter: StepCounter, checkpointer: Checkpointer,
          stop: int, metrics: Metrics, signals: StopSignals, best: BestModel | None) -> dict[str, float]:
    """Steps counter.global_step .. stop - 1: train, log, verify (offering each verification to `best`, the
    keep_best model, on the main rank), save; stop between two steps when a signal asks (RunStopped). The final
    verification accuracies. Log lines, verification and TensorBoard count shown steps (StepCounter.shown_step)."""
    verification = VerificationCallback(cfg.verbose, cfg.val_targets, cfg.rec, metrics=metrics,
                                        highest=counter.best_accuracy)
    speed = SpeedLogger(cfg.frequent, counter.shown(stop), cfg.batch_size * world() * cfg.gradient_acc,
                        cfg.num_views, metrics=metrics, start_step=counter.shown_step)
    grad_scale = state.scaler.get_scale if state.scaler.is_enabled() else None  # a host sync: read when needed
    results = {}
    state.backbone.train()  # verification leaves it in train mode again
    start = counter.global_step
    signals.stepping = True
    try:
        for step, micro_batches in enumerate(loader.steps(start, stop, cfg.gradient_acc), start=start):
            epoch, lr = counter.epoch, state.optimizer.param_groups[CENTRES_GROUP]["lr"]  # the schedule's, for the log
            losses, outcome = train_step(state, micro_batches, cfg)
            counter.global_step = step + 1
            checked = grad_scale() if grad_scale and _scale_to_check(outcome, counter, step == start) else None
            _count_nonfinite(outcome, counter, cfg, checkpointer.continue_with, checked)
            if outcome != StepOutcome.LOSS_NONFINITE:  # a skipped fp16 overflow step still has a loss worth logging
                speed(counter.shown_step, losses, epoch, lr, grad_scale)
            final = counter.global_step == stop
            if (request := signals.strongest_request()) and not final:  # at the last step, finishing stops sooner
                _stop(request, counter, checkpointer, loader, signals)
            with speed.paused():
                # The last step is always verified, before the last save: model.json records its thresholds.
                exported = exported_backbone(state)  # the trained backbone, or what a component makes of it (EMA)
                accuracy = (verification.evaluate_now(exported, counter.shown_step) if final
                            else verification(counter.shown_step, exported))
                if accuracy is not None:
                    results = accuracy
                    counter.verification = verification.operating_points  # its best accuracy is counter's already
                    if best:
                        best.offer(counter.shown_step, accuracy, verification.improved, exported,
                                   verification.operating_points)
                if checkpointer.after_step(counter, final) and cfg.save_artifacts and cfg.using_wandb:
                    checkpointer.wait_for_save()  # the artifact is the published backbone.pth
                    if is_main():
                        name = "Final" if final else f"step{counter.shown_step}"
                        metrics.log_artifact(Path(cfg.output) / BACKBONE_NAME, name)
    except KeyboardInterrupt:  # a second Ctrl-C
        raise _stopped(f"stopped at once by a second Ctrl-C after global step {counter.shown_step}, without "
                       f"saving; {last_good(cfg.output, checkpointer.continue_with)}", EXIT_INTERRUPTED) from None
    finally:
        signals.stepping = False
    return results


def _stop(request: StopRequest, counter: StepCounter, checkpointer: Checkpointer, loader: FaceLoader,
          signals: StopSignals) -> NoReturn:
    """Stop between two steps, at the strongest request of any rank: preempted or the code changed (save first), or
    interrupted by Ctrl-C."""
    step = counter.shown_step
    if request.saves:
        # The data workers are ended first: one that died during the save (the OOM killer's pick) would have
        # DataLoader's SIGCHLD handler raise into it; and their memory is the save's.
        loader.close()
        checkpointer.save_for_exit(counter)
        saved = (f"checkpoint saved; continue with: {checkpointer.continue_with}" if checkpointer.save_all_states
                 else "backbone.pth saved (save_all_states=False: --resume starts from it with new class centres)")
        if request == StopRequest.CODE_CHANGED:
            raise _stopped(f"stopped at global step {step}: the code of this run changed on disk ("
                           f"{_changed_sources(signals)}) since it started; {saved} (it runs the new code)",
                           EXIT_PREEMPTED)
        raise _stopped(f"preempted at global step {step}: {saved}", EXIT_PREEMPTED)
    checkpointer.finish_save_before_stop()  # a save in flight is published first, so that the line says what is on disk
    last_save = (f" (last saved at global step {counter.shown(checkpointer.saved_at)})" if checkpointer.saved_at >= 0
                 else "")
    raise _stopped(f"stopped by Ctrl-C at global step {step}, without saving{last_save}; "
                   f"{last_good(checkpointer.output, checkpointer.continue_with)}; to save before stopping, send "
                   "SIGTERM or SIGUSR1 instead of Ctrl-C", EXIT_INTERRUPTED)


def _changed_sources(signals: StopSignals) -> str:
    return signals.describe_changes() if signals.changed_sources else "seen by another process"


def _save_failed(error: Exception, counter: StepCounter, checkpointer: Checkpointer,
                 signals: StopSignals) -> RunStopped:
    """The stop of a run whose promised checkpoint could not be saved: one line saying why, the last good
    checkpoint left as it was; the error's traceback, when it is not a user error's, in training.log."""
    if not isinstance(error, UserError):
        log.error("the error that kept the checkpoint from being saved:", exc_info=error, extra=FILE_ONLY)
    why = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}".strip()
    asked = signals.signal_name or "a signal"
    if signals.requested == StopRequest.CODE_CHANGED:
        asked = f"a change of the code on disk ({_changed_sources(signals)})"
    return _stopped(f"stopped at global step {counter.shown_step} without the checkpoint {asked} asked for: {why}; "
                    f"{last_good(checkpointer.output, checkpointer.continue_with)}", EXIT_SAVE_FAILED)


def _stopped(line: str, exit_code: int) -> RunStopped:
    """The stop, its line logged (rank 0) while the signals are still caught."""
    log.info("%s", line)
    return RunStopped(line, exit_code)


if __name__ == "__main__":
    sys.exit(main())
