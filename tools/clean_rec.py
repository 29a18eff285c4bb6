"""Clean a .rec's noisy labels with a trained sub-center ArcFace run, as the paper does, and write what is left.

    python -m tools.clean_rec output/ms1mv0_r50_subcenter /data/ms1mv0 /data/ms1mv0_drop75 [--angle 75]
    torchrun --nproc_per_node=8 -m tools.clean_rec RUN REC OUT    # MS1M-sized sets: each process its classes

RUN is the output folder of a run trained with margin_family = "subcenter" on REC (the folder holding train.rec
and train.idx), on any number of processes: its published checkpoint (checkpoint.json) is verified and read
through the project's checkpoint code, each process reading the sub-centres of its share of the classes alone.
Every record of REC is embedded by that checkpoint's backbone.pth, every view the record holds as the run cut its
records (num_views side by side for view_source "record", one otherwise), with no flip and no augmentation. Each
class's dominant sub-centre is the one most of its records are nearest to, and a record is kept when it lies
within --angle degrees of it (eval/label_noise.py). A record of two views is judged as one sample, by the mean of
its views' unit embeddings, so it is kept or dropped whole; the report gives each view's own angle beside it.
Classes left without records are dropped and the others numbered 0, 1, ... in their old order.

OUT gets:
- train.rec / train.idx: the kept records in insightface's layout (as tools.pack_rec writes it), each record's
  image bytes as they were and its label the new class; the preparation record beside REC's train.rec copied
  (with the people kept, where it lists them) and REC's verification .bin files linked, so that training on the
  cleaned set is `--set rec=OUT`;
- clean_report.jsonl: one line per record of REC, in key order: key, label, new_label and new_key (null when
  dropped), angle and view_angles (degrees), nearest and dominant sub-centre of its class, kept;
- clean_angles.png: the histogram of the angles, kept and dropped, and the threshold.

A run that is not sub-center, or a REC it was not trained on (another class count, or another number of records
than the run's epochs took), is one error line. OUT must not hold these files already, unless --overwrite.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from backbones.trained import load_saved_backbone
from checkpoint.pointer import POINTER_NAME
from checkpoint.sharded import Verified, checkpoint_folder, read_rows, verify_folder, verify_shards
from dataset import (
    TRAINING_RECORDS,
    VIEW_SOURCES,
    InsightfaceWriter,
    build_dataset,
    check_output,
    copy_record,
    read_record,
)
from eval.embedding import embed_batches, eval_mode
from eval.label_noise import DEFAULT_ANGLE, Judged, judge, kept, subcentre_cosines
from partial_fc import class_range
from utils.atomic import atomic_save
from utils.cli import exit_on_user_error
from utils.device import choose_device
from utils.distributed import (
    cleanup,
    gather_objects,
    host_group,
    init_distributed,
    is_main,
    raise_first,
    rank,
    run_on_rank0,
    world,
)
from utils.errors import CheckpointError, ConfigError, DataError, UserError
from utils.launcher import adopt_srun_environment, local_process
from utils.progress import progress

Result = TypeVar("Result")
REPORT = "clean_report.jsonl"
HISTOGRAM = "clean_angles.png"
INDEX = "train.idx"


@dataclass(frozen=True)
class SubcenterRun:
    """A sub-center run's published checkpoint, checked, and what cleaning needs to know of it."""

    folder: Path
    verified: Verified
    num_classes: int
    k: int                # sub-centres per class
    views: int            # views one record's image holds, as the run cut its records
    world_size: int       # processes of the run when it saved
    steps_per_epoch: int  # its optimizer steps an epoch on that many processes
    config: dict


@dataclass(frozen=True)
class Part:
    """One process's records (sample indices of the data set, in its order) and how they were judged."""

    samples: np.ndarray
    labels: np.ndarray
    judged: Judged


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="output folder of a run trained with margin_family = \"subcenter\"")
    parser.add_argument("rec", type=Path, help="folder of the train.rec/train.idx the run was trained on")
    parser.add_argument("out", type=Path, help="folder to write the cleaned train.rec/train.idx, report and PNG to")
    parser.add_argument("--angle", type=float, default=DEFAULT_ANGLE,
                        help="degrees from its class's dominant sub-centre within which a record is kept "
                             "(default: the paper's 75)")
    parser.add_argument("--batch-size", type=int, default=256, help="records embedded at a time by each process")
    parser.add_argument("--workers", type=int, default=4, help="record-decoding processes beside each process")
    parser.add_argument("--overwrite", "--force", dest="overwrite", action="store_true",
                        help="replace the files of an earlier cleaning in OUT")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_on_user_error():
        if not 0 < args.angle <= 180:
            raise ConfigError(f"--angle {args.angle:g} is not an angle between two directions; pass degrees in "
                              "(0, 180], e.g. the paper's 75")
        if args.batch_size < 1 or args.workers < 0:
            raise ConfigError(f"--batch-size {args.batch_size} and --workers {args.workers} must be positive (workers "
                              "may be 0: decoding in this process); pass such numbers")
        adopt_srun_environment()
        device = choose_device("auto", *local_process())
        init_distributed(device, timeout_minutes=30)
        reports = is_main()
        try:
            lines = clean(args.run, args.rec, args.out, args.angle, args.batch_size, args.workers, args.overwrite,
                          device, sys.stderr if reports else None)
        finally:
            cleanup()
    if reports:
        print("\n".join(lines))
    return 0


def clean(run_folder: Path, rec: Path, out: Path, angle: float, batch_size: int, workers: int, overwrite: bool,
          device: torch.device, stream: TextIO | None = None) -> list[str]:
    """Judge every record of `rec` by the sub-center run in `run_folder` and write what is kept to `out` (see the
    module's doc); the lines that say what was done. Collective: every process judges the records of its share
    of the classes, the first one writes."""
    group = host_group()
    run = run_on_rank0(lambda: read_run(run_folder), group=group)
    verify_shards(run.verified)
    run_on_rank0(lambda: check_output_folder(rec, out, overwrite), group=group)
    dataset = on_every_process(lambda: open_records(rec, run))  # checked alike everywhere
    start, count = class_range(run.num_classes, rank(), world())
    centres = read_rows(run.verified, "centres", start * run.k, count * run.k, group)
    part = on_every_process(lambda: judge_classes(dataset, run, centres.reshape(count, run.k, -1).double().numpy(),
                                                  start, batch_size, workers, device, stream))
    parts = gather_objects(part, group)
    return run_on_rank0(lambda: write_cleaned(dataset, parts, run, angle, rec, out), group=group)


def on_every_process(work: Callable[[], Result]) -> Result:
    """work() on every process; the first process's UserError raised on all of them, so that none waits for one
    that stopped."""
    error, result = None, None
    try:
        result = work()
    except UserError as raised:
        error = raised
    raise_first(error)
    return result


# --- the run and the records ----------------------------------------------------------------------------------

def read_run(folder: Path) -> SubcenterRun:
    """The published checkpoint of the run folder `folder`, checked; CheckpointError unless it is sub-center's."""
    pointer = folder / POINTER_NAME
    if not pointer.is_file():
        raise CheckpointError(f"{folder} holds no {POINTER_NAME}; pass the output folder of a sub-center run "
                              "(margin_family = \"subcenter\") that saved a checkpoint")
    verified = verify_folder(checkpoint_folder(pointer))
    run = verified.content["run"]
    config = run["config"]
    family = config.get("margin_family", "combined")
    if family != "subcenter":
        raise CheckpointError(f"{folder} was trained with margin_family={family!r}, which keeps no sub-centres to "
                              "find noisy labels by; pass a run trained with margin_family = \"subcenter\" on these "
                              "records (configs/ms1mv3_r50_pair_subcenter.py)")
    k = int(config["subcenter_k"])
    rows = verified.tensors["centres"][0][0]
    views = VIEW_SOURCES[config["view_source"]].views_per_image(int(config["num_views"]))
    return SubcenterRun(folder=folder, verified=verified, num_classes=rows // k, k=k, views=views,
                        world_size=int(run["world_size"]), steps_per_epoch=int(run["progress"]["steps_per_epoch"]),
                        config=config)


def open_records(rec: Path, run: SubcenterRun):
    """The records of `rec` as the run's data set, each sample its record's views uncut by any augmentation;
    DataError unless they are the records the run was trained on (as far as its checkpoint can tell)."""
    if not (rec / TRAINING_RECORDS).is_file() or not (rec / INDEX).is_file():
        raise DataError(f"{rec} holds no {TRAINING_RECORDS} and {INDEX}; pass the folder of the records "
                        f"{run.folder} was trained on")
    if world() > run.num_classes:
        raise ConfigError(f"{world()} processes for {run.num_classes} classes leave a process without any; run at "
                          f"most {run.num_classes} processes")
    dataset = build_dataset(str(rec), num_views=run.views, view_source="record", flip=False)
    samples = len(dataset)
    trained_on = f"pass the records {run.folder} was trained on"
    if dataset.num_classes != run.num_classes:
        raise DataError(f"{rec} holds {dataset.num_classes} classes, but {run.folder} was trained on "
                        f"{run.num_classes} (its sub-centres); {trained_on}")
    stated = run.config.get("num_image")
    if stated is not None and samples != stated:
        raise DataError(f"{rec} holds {samples} records, but {run.folder} was trained on num_image={stated}; "
                        f"{trained_on}")
    # training's loader drops the last incomplete batch: an epoch is this many steps of this many records
    per_step = int(run.config["batch_size"]) * int(run.config["gradient_acc"])
    if samples // run.world_size // per_step != run.steps_per_epoch:
        low = run.steps_per_epoch * per_step * run.world_size
        raise DataError(f"{rec} holds {samples} records, but {run.folder} took {run.steps_per_epoch} steps an epoch "
                        f"of {per_step} records on each of {run.world_size} processes, so it was trained on "
                        f"{low}..{low + per_step * run.world_size - 1} records; {trained_on}")
    return dataset


def check_output_folder(rec: Path, out: Path, overwrite: bool) -> None:
    if out.resolve() == rec.resolve():
        raise ConfigError(f"{out} is the folder of the records being cleaned; pass another output folder")
    check_output(str(out), [TRAINING_RECORDS, INDEX, REPORT, HISTOGRAM], overwrite)


# --- judging --------------------------------------------------------------------------------------------------

def judge_classes(dataset, run: SubcenterRun, centres: np.ndarray, start: int, batch_size: int, workers: int,
                  device: torch.device, stream: TextIO | None) -> Part:
    """The records of classes start..start+len(centres)-1 embedded and judged against `centres` (C, K, D)."""
    identities = dataset.source.identities
    samples = identities.order[identities.bounds[start]:identities.bounds[start + len(centres)]]
    backbone, _ = load_saved_backbone(run.verified.folder, device=device)
    loader = DataLoader(Subset(dataset, samples.tolist()), batch_size=batch_size, num_workers=workers)
    labels, record_cos, view_cos = [], [], []
    with eval_mode(backbone) as model:
        for views, batch_labels in progress(loader, len(loader), "embedding records", stream):
            classes = batch_labels.numpy() - start
            if (outside := np.flatnonzero((classes < 0) | (classes >= len(centres)))).size:
                where = dataset.source.describe(samples[sum(map(len, labels)) + outside[0]])
                raise DataError(f"{where} has label {batch_labels[outside[0]]} but lies among the records of another "
                                "identity; re-pack the records with tools.pack_rec")
            batch, count = views.shape[:2]
            embeddings = embed_batches(model, [views.flatten(0, 1)]).reshape(batch, count, -1)
            records_cos, views_cos = subcentre_cosines(embeddings, classes, centres)
            labels.append(batch_labels.numpy())
            record_cos.append(records_cos)
            view_cos.append(views_cos)
    labels = np.concatenate(labels)
    return Part(samples, labels, judge(np.concatenate(record_cos), np.concatenate(view_cos), labels - start,
                                       len(centres)))


# --- writing --------------------------------------------------------------------------------------------------

def write_cleaned(dataset, parts: list[Part], run: SubcenterRun, angle: float, rec: Path, out: Path) -> list[str]:
    """The kept records as OUT's train.rec, the report and the histogram (on the first process); what was done."""
    samples = np.concatenate([part.samples for part in parts])
    labels = np.concatenate([part.labels for part in parts])
    angles = np.concatenate([part.judged.angle for part in parts])
    view_angles = np.concatenate([part.judged.view_angles for part in parts])
    nearest = np.concatenate([part.judged.nearest for part in parts])
    dominant = np.concatenate([part.judged.dominant for part in parts])
    keep = kept(angles, angle)
    if not keep.any():
        raise ConfigError(f"no record of {rec} lies within {angle:g} degrees of its class's dominant sub-centre (the "
                          f"nearest is at {angles.min():.1f}); pass a larger --angle, or train the run longer")
    kept_classes = np.unique(labels[keep])
    new_class = np.full(run.num_classes, -1)
    new_class[kept_classes] = np.arange(len(kept_classes))
    new_labels = np.where(keep, new_class[labels], -1)
    # written class by class, in key order within each: the new keys follow
    written = np.lexsort((samples, new_labels))[np.count_nonzero(~keep):]
    new_keys = np.full(len(samples), -1)
    new_keys[written] = np.arange(1, len(written) + 1)
    source = dataset.source
    with InsightfaceWriter(str(out)) as writer:
        bounds = np.searchsorted(new_labels[written], np.arange(len(kept_classes) + 1))
        for first, end in progress(zip(bounds[:-1], bounds[1:]), len(kept_classes), "writing classes", sys.stderr):
            writer.write_identity([source.read(int(samples[i]))[0] for i in written[first:end]])
    record = read_record(rec / TRAINING_RECORDS)
    changes: dict[str, object] = {"written_by": "tools.clean_rec", "cleaned": {
        "records": str(rec), "run": str(run.folder), "angle": angle, "kept": len(written), "of": len(samples)}}
    if isinstance(record.get("people"), list) and len(record["people"]) == run.num_classes:
        changes["people"] = [record["people"][c] for c in kept_classes]
    copy_record(rec / TRAINING_RECORDS, out / TRAINING_RECORDS, changes)
    linked = link_verification_sets(rec, out)
    order = np.argsort(samples)
    atomic_save((source.keys[samples[order]], labels[order], new_labels[order], new_keys[order], angles[order],
                 view_angles[order], nearest[order], dominant[labels[order]], keep[order]), out / REPORT,
                write=write_report)
    plot_angles(angles, keep, angle, out / HISTOGRAM)
    dropped = len(samples) - len(written)
    lines = [f"{out}: kept {len(written):,} of {len(samples):,} records ({dropped:,} dropped, "
             f"{100 * dropped / len(samples):.2f}%) within {angle:g} degrees of their class's dominant sub-centre; "
             f"{len(kept_classes):,} of {run.num_classes:,} classes ({run.num_classes - len(kept_classes):,} left "
             f"empty and dropped), numbered 0..{len(kept_classes) - 1} in their old order",
             f"report: {out / REPORT}; angles: {out / HISTOGRAM}"]
    if linked:
        lines.append(f"verification sets linked from {rec}: {', '.join(linked)}")
    lines.append(f"retrain on it (the paper retrains plain ArcFace: margin_family = \"combined\"): train.py CONFIG "
                 f"--set rec={out} --set num_classes={len(kept_classes)} --set num_image={len(written)}")
    return lines


def write_report(columns: tuple, handle: IO[bytes]) -> None:
    """One JSON object a line per record (atomic_save's `write`)."""
    for key, label, new_label, new_key, angle, view_angles, nearest, dominant, is_kept in zip(*columns):
        line = {"key": int(key), "label": int(label), "new_label": int(new_label) if is_kept else None,
                "new_key": int(new_key) if is_kept else None, "angle": round(float(angle), 4),
                "view_angles": [round(float(value), 4) for value in view_angles], "nearest": int(nearest),
                "dominant": int(dominant), "kept": bool(is_kept)}
        handle.write((json.dumps(line) + "\n").encode())


def link_verification_sets(rec: Path, out: Path) -> list[str]:
    """REC's verification .bin files (and their preparation records) linked into OUT, where training's
    val_targets look for them; those OUT already has are left alone. The names linked."""
    linked = []
    for path in sorted(rec.glob("*.bin")):
        for item in (path, path.with_name(path.name + ".preparation.json")):
            target = out / item.name
            if item.is_file() and not target.exists():
                os.symlink(item.resolve(), target)
        linked.append(path.name)
    return linked


def plot_angles(angles: np.ndarray, keep: np.ndarray, threshold: float, path: Path) -> None:
    """The histogram of the records' angles to their dominant sub-centre, kept and dropped stacked."""
    import matplotlib  # noqa: PLC0415 (~1 s, only where a plot is written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(figsize=(7, 4))
    bins = np.linspace(0, max(90.0, float(angles.max(initial=0)) + 1), 91)
    axes.hist([angles[keep], angles[~keep]], bins=bins, stacked=True, color=["tab:blue", "tab:red"],
              label=[f"kept ({np.count_nonzero(keep):,})", f"dropped ({np.count_nonzero(~keep):,})"])
    axes.axvline(threshold, color="black", linestyle="--", linewidth=1)
    axes.set_xlabel("angle to the class's dominant sub-centre (degrees)")
    axes.set_ylabel("records")
    axes.set_title(f"sub-center ArcFace cleaning at {threshold:g} degrees")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
