"""Noisy labels cleaned as sub-center ArcFace cleans them, on LFW: how much noise it finds and what retraining gains.

    python -m experiments.noisy_labels /path/to/lfw [--work data/noisy_bench] [--images 18944] [--seeds 2048 ...]

LFW's DevTrain people (prepared as experiments.real_faces prepares them: ``lfw_devtrain/`` under --work, reused
when there) get labels corrupted on purpose, seeded by each seed: ``--noise`` (20%) of the photos of the people
with several photos are moved to other people, each to one drawn uniformly from the rest (a class left without
photos is dropped and the others numbered again). The noisy records go to ``noisy-<noise>-seed<seed>/`` with
``noise.json`` (which of their keys hold a moved photo). Per seed, four runs of configs/lfw_r18_recipe.py (one
view, ArcFace at s = 32), each given ``--images`` worth of whole epochs of its own data:

- ``true``: on the true labels;
- ``noisy``: on the noisy labels;
- ``subcenter``: sub-center ArcFace (``margin_family = "subcenter"``, K = 3, the recipe's margin) on the noisy labels;
- ``cleaned``: plain ArcFace again on what tools.clean_rec keeps of the noisy records by the subcenter run
  (``--angle``, the paper's 75 degrees), ``cleaned-<noise>-seed<seed>-<angle>/`` beside the runs; it has fewer
  photos, so its epochs are shorter: it gets as many of them as come nearest --images (3 epochs of 43 steps
  against 2 of 74 at 5,622 photos).

The table gives the noise found: of the records dropped at the angle, the share holding a moved photo (precision),
of the moved photos, the share dropped (recall), and the share of moved photos among those kept (noise left), at
--angle and over a sweep of angles (from the same reports: an angle only moves the threshold), each the mean over
the seeds, and at --angle by the size of the record's (noisy) class; then each run's pairsDevTest Accuracy-Flip of
its last model (10 balanced folds), TAR at FAR 1e-2 and CPU minutes, and paired verdicts (eval.paired: a bootstrap
over the held-out pairs and the seeds; better, worse or can't tell, with the 95% interval). Runs go to
``runs-<images>/<arm>-seed<seed>`` under --work; a finished run is reused. One run at a time, ``--threads`` each
(the table's CPU minutes do not depend on what else the machine runs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataset import TRAINING_RECORDS, InsightfaceWriter, build_dataset, copy_record, read_record
from eval.paired import paired_verdict
from experiments.real_faces import ROOT, UNSAFE_IN_NAME, VAL_SET, evaluate, prepare, steps_per_epoch, train_run

CONFIG = "configs/lfw_r18_recipe.py"
BATCH = 128  # the recipe's photos a step
ARMS = ("true", "noisy", "subcenter", "cleaned")
SUBCENTER = ["margin_family='subcenter'", "subcenter_k=3"]
SWEEP = (50, 60, 65, 70, 75, 80, 85, 90, 95)
CLASS_SIZES = ((1, 1), (2, 2), (3, 5), (6, 20), (21, None))  # (smallest, largest; None: no bound)
# Paired verdicts: (arm, against)
VERDICTS = (("noisy", "true"), ("cleaned", "noisy"), ("cleaned", "true"), ("subcenter", "noisy"))


@dataclass
class Run:
    arm: str
    seed: int
    steps: int
    records: int
    accuracy: float
    spread: float
    tar: float
    right: np.ndarray
    cpu_minutes: float


@dataclass
class Found:
    """One seed's cleaning against the truth: each noisy record's angle, whether its photo was moved."""

    seed: int
    angle: np.ndarray
    moved: np.ndarray
    class_size: np.ndarray  # records of each record's (noisy) class

    def at(self, threshold: float) -> tuple[float, float, float, float]:
        """(precision, recall, noise left, share dropped) of dropping the records at `threshold` degrees or more."""
        dropped = self.angle >= threshold
        caught = np.count_nonzero(dropped & self.moved)
        kept = np.count_nonzero(~dropped)
        return (caught / max(1, np.count_nonzero(dropped)), caught / max(1, np.count_nonzero(self.moved)),
                np.count_nonzero(~dropped & self.moved) / max(1, kept), float(dropped.mean()))


# --- the data -------------------------------------------------------------------------------------------------

def corrupt(data: Path, out: Path, fraction: float, seed: int) -> Path:
    """The records of `data` with `fraction` of the photos of people with several photos moved to other people
    (seeded), written to `out` once, with noise.json: the keys of `out` that hold a moved photo. `out`."""
    truth = out / "noise.json"
    if truth.is_file():
        return out
    source = build_dataset(str(data), num_views=1, view_source="record", flip=False).source
    identities = source.identities
    labels = np.repeat(np.arange(len(identities.bounds) - 1), np.diff(identities.bounds))[
        np.argsort(identities.order)]
    num_classes = len(identities.bounds) - 1
    rng = np.random.default_rng(seed)
    several = np.flatnonzero(np.bincount(labels, minlength=num_classes)[labels] >= 2)
    moved = rng.choice(several, size=round(fraction * len(several)), replace=False)
    noisy = labels.copy()
    other = rng.integers(0, num_classes - 1, size=len(moved))
    noisy[moved] = other + (other >= labels[moved])  # any class but its own, uniformly
    is_moved = np.zeros(len(labels), dtype=bool)
    is_moved[moved] = True
    people = np.unique(noisy)  # a class every photo left is dropped; the others numbered 0, 1, ...
    order = np.lexsort((np.arange(len(noisy)), noisy))  # class by class, keys in order within each
    bounds = np.searchsorted(noisy[order], people)
    with InsightfaceWriter(str(out)) as writer:
        for first, end in zip(bounds, [*bounds[1:], len(order)]):
            writer.write_identity([source.read(int(i))[0] for i in order[first:end]])
    record = read_record(data / TRAINING_RECORDS)
    names = record.get("people")
    copy_record(data / TRAINING_RECORDS, out / TRAINING_RECORDS, {
        "written_by": "experiments.noisy_labels", **({"people": [names[c] for c in people]} if names else {})})
    bin_path = out / f"{VAL_SET}.bin"
    if not bin_path.exists():
        os.symlink((data / f"{VAL_SET}.bin").resolve(), bin_path)
    truth.write_text(json.dumps({"seed": seed, "fraction": fraction, "records": len(noisy),
                                 "classes": len(people), "moved_keys": (np.flatnonzero(is_moved[order]) + 1).tolist()}))
    return out


def clean(run: Path, noisy: Path, out: Path, angle: float, threads: int) -> None:
    """tools.clean_rec of `noisy` by the sub-center run `run` into `out`, once."""
    if (out / "clean_report.jsonl").is_file():
        return
    command = [sys.executable, "-m", "tools.clean_rec", str(run), str(noisy), str(out), "--angle", str(angle),
               "--workers", "0"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    print(result.stdout.strip().splitlines()[0], flush=True)


def found(noisy: Path, cleaned: Path, seed: int) -> Found:
    report = [json.loads(line) for line in (cleaned / "clean_report.jsonl").read_text().splitlines()]
    moved = set(json.loads((noisy / "noise.json").read_text())["moved_keys"])
    labels = np.array([line["label"] for line in report])
    return Found(seed, np.array([line["angle"] for line in report]),
                 np.array([line["key"] in moved for line in report]), np.bincount(labels)[labels])


# --- the runs -------------------------------------------------------------------------------------------------

def train(arm: str, seed: int, rec: Path, runs: Path, images: int, extra: Sequence[str], threads: int,
          held_out: Path) -> Run:
    """The recipe on `rec` for the whole epochs nearest `images` photos, and its last model judged on the held-out
    pairs."""
    per_epoch = steps_per_epoch(rec, BATCH)
    epochs = max(1, round(images / (per_epoch * BATCH)))
    steps = per_epoch * epochs
    # a rehearsal's --set max_steps=N stops every run there
    limit = next((int(setting.split("=", 1)[1]) for setting in extra if setting.startswith("max_steps=")), 0)
    steps = min(steps, limit) if limit else steps
    output = runs / f"{arm}-seed{seed}"
    settings = {"rec": repr(str(rec)), "output": repr(str(output)), "seed": str(seed), "num_epoch": str(epochs),
                "verbose": str(max(1, steps // 4)), "frequent": str(max(1, steps // 20))}
    arguments = [item for key, value in settings.items() for item in ("--set", f"{key}={value}")]
    arguments += [item for setting in extra for item in ("--set", setting)]
    cpu_seconds, _ = train_run(output, arguments, steps, threads, f"{arm} (seed {seed})", config=CONFIG)
    accuracy, spread, tar, right = evaluate(output, held_out)
    run = Run(arm, seed, steps, steps_per_epoch(rec, 1), accuracy, spread, tar, right, cpu_seconds / 60)
    print(f"{arm} seed {seed}: {steps} steps, last {accuracy:.4f}", flush=True)
    return run


# --- the report -----------------------------------------------------------------------------------------------

def found_lines(finds: Sequence[Found], angle: float) -> list[str]:
    """The noise found, at `angle` and over the sweep: means over the seeds."""
    lines = [f"noise found by the subcenter run (tools.clean_rec; mean over {len(finds)} seeds; moved photos "
             f"{np.mean([f.moved.mean() for f in finds]):.1%} of the records)",
             f"{'angle':>7}{'precision':>11}{'recall':>9}{'noise left':>12}{'dropped':>9}"]
    for threshold in sorted({*SWEEP, angle}):
        values = np.mean([f.at(threshold) for f in finds], axis=0)
        mark = "  <- --angle" if threshold == angle else ""
        lines.append(f"{threshold:>7g}{values[0]:>11.3f}{values[1]:>9.3f}{values[2]:>12.3f}{values[3]:>9.3f}{mark}")
    lines += ["", f"at {angle:g} degrees by the size of the record's class (records of the seeds pooled)",
              f"{'class size':>12}{'records':>9}{'moved':>8}{'dropped':>9}{'precision':>11}{'recall':>9}"]
    angles, moved, sizes = (np.concatenate([getattr(f, name) for f in finds]) for name in ("angle", "moved",
                                                                                          "class_size"))
    for low, high in CLASS_SIZES:
        chosen = (sizes >= low) & (sizes <= (high or sizes.max()))
        dropped = chosen & (angles >= angle)
        caught = np.count_nonzero(dropped & moved)
        name = str(low) if high == low else f"{low}-{high}" if high else f"{low}+"
        lines.append(f"{name:>12}{np.count_nonzero(chosen):>9}{moved[chosen].mean():>8.3f}"
                     f"{dropped.sum() / max(1, chosen.sum()):>9.3f}{caught / max(1, dropped.sum()):>11.3f}"
                     f"{caught / max(1, np.count_nonzero(chosen & moved)):>9.3f}")
    return [*lines, ""]


def table(runs: Sequence[Run], finds: Sequence[Found], angle: float, noise: float, images: int) -> str:
    seeds = sorted({run.seed for run in runs})
    lines = [f"LFW DevTrain with {noise:.0%} of the photos of people with several photos moved to other people "
             f"(seeded by each seed), configs/lfw_r18_recipe.py for the whole epochs nearest {images:,} images, "
             f"seeds {' '.join(map(str, seeds))}",
             "", *(found_lines(finds, angle) if finds else [])]
    by_arm = {arm: [run for run in runs if run.arm == arm] for arm in ARMS}
    lines += ["pairsDevTest Accuracy-Flip of the last model (10 balanced folds)",
              f"{'arm':<11}{'seeds':>6}{'acc':>9}{'sd':>7}{'TAR@1e-2':>10}{'steps':>7}{'photos':>8}{'CPU min':>9}"]
    for arm, arm_runs in by_arm.items():
        if not arm_runs:
            continue
        accuracy = np.array([run.accuracy for run in arm_runs])
        lines.append(f"{arm:<11}{len(arm_runs):>6}{accuracy.mean():>9.4f}{accuracy.std():>7.3f}"
                     f"{np.mean([run.tar for run in arm_runs]):>10.3f}{np.mean([run.steps for run in arm_runs]):>7.0f}"
                     f"{np.mean([run.records for run in arm_runs]):>8.0f}"
                     f"{np.mean([run.cpu_minutes for run in arm_runs]):>9.1f}")
    lines += ["", "paired verdicts (bootstrap over the held-out pairs and the seeds, 95%)"]
    for arm, against in VERDICTS:
        if by_arm[arm] and by_arm[against]:
            verdict = paired_verdict(np.stack([run.right for run in by_arm[arm]]),
                                     np.stack([run.right for run in by_arm[against]]))
            lines.append(f"{arm} vs {against}: {verdict}")
    lines += ["", f"{'run':<11}{'seed':>6}{'acc':>9}{'+-':>7}{'TAR@1e-2':>10}{'steps':>7}{'CPU min':>9}"]
    lines += [f"{run.arm:<11}{run.seed:>6}{run.accuracy:>9.4f}{run.spread:>7.3f}{run.tar:>10.3f}{run.steps:>7}"
              f"{run.cpu_minutes:>9.1f}" for run in runs]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lfw", type=Path, metavar="LFW_FOLDER", help="holds images_deepfunneled/ and LFW's protocol "
                                                                     "files")
    parser.add_argument("--work", type=Path, default=Path("data/noisy_bench"),
                        help="where the records, the runs and the table go")
    parser.add_argument("--seeds", nargs="+", type=int, default=[2048, 2049, 2050])
    parser.add_argument("--images", type=int, default=18_944, help="photos each run sees (in whole epochs)")
    parser.add_argument("--noise", type=float, default=0.2,
                        help="share of the photos of people with several photos moved to other people")
    parser.add_argument("--angle", type=float, default=75.0, help="tools.clean_rec's --angle")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS,
                        help="cleaned needs subcenter, which it trains if it is not listed")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a config value for every run (a rehearsal: a narrower network, max_steps=N)")
    parser.add_argument("--threads", type=int, default=1, help="threads of each run (one run at a time)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes preparing photos")
    args = parser.parse_args(argv)
    if not 0 < args.noise < 1:
        raise SystemExit(f"error: --noise {args.noise} is not a share; pass a number between 0 and 1, e.g. 0.2")
    work = args.work.resolve()
    data = prepare(args.lfw.resolve(), work, args.workers)
    settings = [UNSAFE_IN_NAME.sub("_", setting).strip("_") for setting in args.extra]
    runs_folder = work / "+".join([f"runs-{args.images}", *settings])
    runs, finds = [], []
    for seed in args.seeds:
        noisy = corrupt(data, work / f"noisy-{args.noise:g}-seed{seed}", args.noise, seed)
        arms = {"true": (data, []), "noisy": (noisy, []), "subcenter": (noisy, SUBCENTER)}
        for arm in ("true", "noisy", "subcenter"):
            if arm in args.arms or (arm == "subcenter" and "cleaned" in args.arms):
                rec, settings = arms[arm]
                runs.append(train(arm, seed, rec, runs_folder, args.images, [*args.extra, *settings], args.threads,
                                  data))
        if "cleaned" in args.arms:
            cleaned = runs_folder / f"cleaned-{args.noise:g}-seed{seed}-{args.angle:g}"
            clean(runs_folder / f"subcenter-seed{seed}", noisy, cleaned, args.angle, args.threads)
            finds.append(found(noisy, cleaned, seed))
            runs.append(train("cleaned", seed, cleaned, runs_folder, args.images, args.extra, args.threads, data))
    report = table(runs, finds, args.angle, args.noise, args.images)
    print(report)
    (runs_folder / "table.txt").write_text(report + "\n")
    print(f"table: {runs_folder / 'table.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
