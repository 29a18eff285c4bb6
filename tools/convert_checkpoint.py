"""Convert a training checkpoint between pairface and arcface_torch, either way.

    python -m tools.convert_checkpoint output/my_run arcface_out --to arcface_torch --world-size 8
    python -m tools.convert_checkpoint arcface_out output/my_run --to pairface --config configs/ms1mv3_r50.py

--to arcface_torch: SRC is a pairface run folder (its checkpoint.json); DST gets what arcface_torch's
train_v2.py writes on N GPUs: `checkpoint_gpu_{rank}.pt` for each of the N ranks and `model.pt`.
train_v2.py with `config.output = DST` and `config.resume = True` on N GPUs continues the run. Step,
epoch and schedule are counted in arcface_torch's batches on N GPUs (the run's steps per epoch scaled
from its processes to N, or --steps-per-epoch), at an epoch start, since arcface_torch resumes only
there; the schedule keeps pairface's power-2 decay. arcface_torch's files have no place for the grad
scaler, data position, random streams or config: those start afresh there. A run with ema_decay
writes its trained weights into the rank files (the optimizer state is theirs, and arcface_torch keeps
no average) and its average, the run's backbone.pth, as `model.pt`; a note says so.

--to pairface: SRC is an arcface_torch output folder (train_v2's checkpoint_gpu_*.pt, or the 2021
layout's rank_*_softmax_weight*.pt beside backbone.pth); DST becomes a pairface run folder
(checkpoint.json, checkpoint-<step>/, backbone.pth, model.json) that `train.py CONFIG --resume
--set output=DST` continues on any number of processes. --config (and --set) name the network and
training settings, as for train.py: arcface_torch's files do not say them. (train.py --resume also
reads arcface_torch's folders directly; this writes them as a pairface run once and for all.)

Either way the conversion runs in one process, holding the class-centre matrix and its optimizer
state once. A pairface SRC is verified as train.py verifies it (every checksum, nothing unpickled).
DST must be new or empty, unless --force; a run folder in use by a training process is refused
even then, and a conversion that fails leaves no new DST behind.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch

from checkpoint.arcface import MARKERS, MODEL_FILE, V2_FILE, marker_for, rank_files, read_layout, restore_arcface
from checkpoint.pointer import POINTER_NAME
from checkpoint.run_dir import LOCK_NAME, lock_run_dir
from checkpoint.sharded import checkpoint_folder, read_whole, save_state
from partial_fc import class_range
from training.components import SavedPosition, is_centre_rows
from training.config import load_config
from training.ema import trained_state_dict
from training.state import StepCounter, architecture, build_training_state
from utils.atomic import atomic_save
from utils.cli import exit_on_user_error
from utils.errors import CheckpointError, ConfigError, RunDirError
from utils.lr_scheduler import POLY_POWER, jump_to_step, poly_factor
from utils.progress import progress

LAYOUTS = ("arcface_torch", "pairface")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="pairface run folder (--to arcface_torch) or arcface_torch output "
                                                "folder (--to pairface)")
    parser.add_argument("dst", type=Path, help="folder to write (new or empty, unless --force)")
    parser.add_argument("--to", required=True, help="the layout to write: arcface_torch or pairface")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="--to arcface_torch: the number of GPUs arcface_torch will continue on (required)")
    parser.add_argument("--steps-per-epoch", type=int, metavar="S",
                        help="--to arcface_torch: arcface_torch's batches per epoch on N GPUs (default: the run's "
                             "steps per epoch scaled from its processes to N)")
    parser.add_argument("--config", help="--to pairface: the experiment file to continue with (required)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="--to pairface: override a config key, as for train.py; repeatable")
    parser.add_argument("--force", action="store_true", help="write into DST even if it holds files")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # the import's log line
    with exit_on_user_error():
        if args.to not in LAYOUTS:
            raise ConfigError(f"--to {args.to} is not a layout this converts to; pass --to arcface_torch or --to "
                              "pairface")
        if args.to == "arcface_torch":
            if args.world_size is None or args.world_size < 1:
                raise ConfigError("--to arcface_torch needs --world-size N, the number of GPUs arcface_torch will "
                                  "continue on; pass a positive N")
            if args.steps_per_epoch is not None and args.steps_per_epoch < 1:
                raise ConfigError(f"--steps-per-epoch {args.steps_per_epoch} is not a positive number; pass "
                                  "arcface_torch's batches per epoch, or leave it out")
            with _destination(args.dst, args.force):
                lines = to_arcface_torch(args.src, args.dst, args.world_size, args.steps_per_epoch, sys.stderr)
            lines.insert(1, f"continue it with arcface_torch's train_v2.py on {args.world_size} GPUs: config.output = "
                            f"\"{args.dst}\", config.resume = True, config.save_all_states = True")
        else:
            if args.config is None:
                raise ConfigError("--to pairface needs --config CONFIG, the experiment file (network, embedding "
                                  "size, optimizer, schedule) to continue with; pass the one train.py will use")
            cfg = load_config(args.config, args.set)
            with _destination(args.dst, args.force):
                lines = to_pairface(args.src, args.dst, cfg, sys.stderr)
            overrides = "".join(f" --set {item}" for item in args.set)
            lines.append(f"continue it with: torchrun --nproc_per_node=N train.py {args.config}{overrides} --set "
                         f"output={args.dst} --resume (any N)")
    print("\n".join(lines))
    return 0


@contextlib.contextmanager
def _destination(dst: Path, force: bool) -> Iterator[None]:
    """`dst` ready to write into and locked as a run folder is (a live training run there is refused,
    --force or not); a folder this conversion created is removed again if the conversion fails."""
    if dst.exists() and not dst.is_dir():
        raise RunDirError(f"{dst} is a file; choose a folder to write the converted checkpoint into")
    if dst.is_dir() and any(entry.name != LOCK_NAME for entry in dst.iterdir()) and not force:
        raise RunDirError(f"{dst} already holds files; choose a new folder, or pass --force to write the "
                          "converted checkpoint over what is there")
    created = not dst.exists()
    try:
        lock = lock_run_dir(str(dst))
    except RunDirError:
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        raise
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        raise
    finally:
        lock.close()
    if created:
        (dst / LOCK_NAME).unlink(missing_ok=True)


# --- pairface -> arcface_torch --------------------------------------------------------------------

def to_arcface_torch(src: Path, dst: Path, world_size: int, steps_per_epoch: int | None,
                     stream: TextIO | None = None) -> list[str]:
    """Write the pairface run in `src` as arcface_torch's train_v2 files for `world_size` ranks; what was done."""
    whole, content = _read_whole(src)
    run = content["run"]
    _refuse_other_margins(src, run["config"])
    centres, groups = whole["centres"], run["param_groups"]
    # An EMA run: arcface_torch continues the trained weights, whose momentum the optimizer state is; model.pt,
    # the backbone to use, is the run's backbone.pth (the average).
    exported = whole["backbone"]
    backbone = trained_state_dict(exported, whole["ema"]) if "ema" in whole else exported
    num_classes = centres.shape[0]
    if world_size > num_classes:
        raise ConfigError(f"--world-size {world_size} exceeds the run's {num_classes} classes; every rank needs a "
                          "class centre: pass a smaller N")
    optimizer_state = {int(index): state for index, state in whole.get("optimizer", {}).items()}
    centre_index = groups[1]["params"][0]  # pairface's and arcface_torch's groups: backbone, then the centres
    saved, config = run["progress"], run["config"]
    # arcface_torch counts batches, pairface optimizer steps; both keep the fraction of training done.
    steps = steps_per_epoch or max(1, round(saved["steps_per_epoch"] * config["gradient_acc"] * run["world_size"]
                                            / world_size))
    renumbered = round(saved["global_step"] * steps / saved["steps_per_epoch"])
    epoch = renumbered // steps
    step = epoch * steps
    warmup, total = steps * config["warmup_epoch"], steps * config["num_epoch"]
    base_lrs = [group["initial_lr"] for group in groups]
    power = config.get("lr_power", POLY_POWER)  # a run from before the key decayed with POLY_POWER
    lrs = [base * poly_factor(step, warmup, total, power) for base in base_lrs]
    # train_v2 loads this into its PolynomialLRWarmup (__dict__.update): the keys its torch.optim scheduler
    # keeps, then the class's own three. The power is the run's, so the LR goes on along the same curve.
    scheduler = {"base_lrs": base_lrs, "last_epoch": step, "verbose": False, "_step_count": step + 1,
                 "_is_initial": False, "_get_lr_called_within_step": False, "_last_lr": lrs,
                 "total_iters": total, "power": power, "warmup_iters": warmup}
    param_groups = [{**group, "lr": lr} for group, lr in zip(groups, lrs)]
    for rank, stale in rank_files(dst, V2_FILE).items():
        if rank >= world_size:
            stale.unlink()  # a set for more ranks written here before (--force) would mix with this one
    for rank in progress(range(world_size), world_size, f"writing {V2_FILE.format('*')}", stream):
        start, count = class_range(num_classes, rank, world_size)
        state = dict(optimizer_state)
        if centre_index in optimizer_state:
            state[centre_index] = {name: value[start:start + count].clone()
                                   if is_centre_rows(value, *centres.shape) else value
                                   for name, value in optimizer_state[centre_index].items()}
        atomic_save({"epoch": epoch, "global_step": step, "state_dict_backbone": backbone,
                     "state_dict_softmax_fc": {"weight": centres[start:start + count].clone()},
                     "state_optimizer": {"state": state, "param_groups": param_groups},
                     "state_lr_scheduler": scheduler}, dst / V2_FILE.format(rank))
    atomic_save(exported, dst / MODEL_FILE)
    lines = [f"wrote {dst}: arcface_torch train_v2 files for {world_size} ranks ({num_classes} class centres) and "
             f"{MODEL_FILE}, at global step {step} (epoch {epoch}, {steps} batches per epoch, lr {lrs[0]:.6g})"]
    if renumbered != step:
        lines.append(f"note: the run stopped inside epoch {epoch} (step {renumbered}, epochs of {steps} batches); "
                     f"arcface_torch resumes at epoch starts only, so the files say step {step}, the start of "
                     "that epoch (the weights are the run's last)")
    if "ema" in whole:
        lines.append(f"note: the run averages its backbone's weights (ema_decay={config['ema_decay']}): "
                     f"{V2_FILE.format('*')} hold the trained weights, which arcface_torch continues with their "
                     f"momentum; {MODEL_FILE} holds the average (the run's backbone.pth); arcface_torch keeps no "
                     f"average, so its next save's {MODEL_FILE} holds its trained weights")
    lines.append("not carried over (arcface_torch's files have no place for them): grad scaler, data position, "
                 "random streams, config")
    return lines


def _refuse_other_margins(src: Path, config: dict) -> None:
    """arcface_torch's classifier is one centre per class under the combined margin: a run with sub-centres
    or another margin family has no equivalent there."""
    family = config.get("margin_family", "combined")
    if family != "combined":
        raise CheckpointError(f"{src} was trained with margin_family={family!r}; arcface_torch has only the combined "
                              "margin with one centre per class, so this classifier has no arcface_torch layout: use "
                              f"{src / 'backbone.pth'}, which arcface_torch loads as it is")


def _read_whole(src: Path) -> tuple[dict, dict]:
    """The checkpoint in the run folder `src` (checkpoint.json's, or a checkpoint folder itself), verified
    and read whole: its tensors and its state.json."""
    pointer = src / POINTER_NAME
    if not pointer.is_file() and not (src / "manifest.json").is_file():
        raise CheckpointError(f"{src} holds no pairface {POINTER_NAME}; pass the output folder of a pairface run "
                              "that saved a checkpoint")
    return read_whole(checkpoint_folder(pointer if pointer.is_file() else src))


# --- arcface_torch -> pairface --------------------------------------------------------------------

def to_pairface(src: Path, dst: Path, cfg, stream: TextIO | None = None) -> list[str]:
    """Write the arcface_torch checkpoint in `src` as a pairface run folder `dst` for config `cfg`; what was done."""
    marker = marker_for(src) if src.is_file() else next((src / name for name in MARKERS if (src / name).is_file()),
                                                           None)
    if marker is None:
        raise CheckpointError(f"{src} holds no arcface_torch checkpoint ({' or '.join(MARKERS)}); pass the output "
                              "folder arcface_torch wrote with save_all_states = True")
    layout = read_layout(marker)
    num_classes = cfg.num_classes or layout.num_classes
    # The checkpoint is one process's (save_state records world size 1), so its steps are counted as
    # one process would count them: arcface_torch's W ranks' batches per epoch, W times as many, in
    # optimizer steps. A resume on any number of processes renumbers from there.
    steps = max(1, round(layout.steps_per_epoch * layout.world_size / cfg.gradient_acc))
    saved = StepCounter(global_step=round(layout.global_step * steps / layout.steps_per_epoch), steps_per_epoch=steps)
    state = build_training_state(cfg, num_classes, torch.device("cpu"), steps)
    shapes = architecture(cfg, num_classes)
    restored = restore_arcface(marker, shapes, state, stream)
    jump_to_step(state.scheduler, saved.global_step)
    save_state(dst, state, saved, SavedPosition(restored.first_rank_state["loader"]), shapes,
               {**vars(cfg), "output": str(dst)})  # backbone.pth and model.json with it
    return [f"wrote {dst}: a pairface run at global step {saved.global_step} (epoch {saved.epoch}, "
            f"{saved.steps_per_epoch} steps per epoch counted for one process) from arcface_torch's {layout.kind} "
            f"files of {layout.world_size} ranks at its global step {layout.global_step}"]


if __name__ == "__main__":
    raise SystemExit(main())
