"""Does pairface learn real faces? LFW under its own protocol: train on DevTrain's people, verify on pairsDevTest.

    python -m experiments.real_faces /path/to/lfw [--work data/lfw_bench] [--quick] [--rows two_view one_view ...]
    python -m experiments.real_faces /path/to/lfw --prepare detect --against mean_points --rows one_view_s32 ...

LFW_FOLDER is Labeled Faces in the Wild as its project distributes it: ``images_deepfunneled/<Name>/<Name>_NNNN.jpg``
(deep-funneled, aligned: 250x250 colour JPEGs) beside its protocol files ``peopleDevTrain.txt`` and
``pairsDevTest.txt``. The photos are news pictures under their owners' copyright, shared for research: nothing
made from them belongs in this repository, and everything this command writes goes under --work.

Preparation (once per work folder, reused after): every photo becomes a 112x112 face as tools.pack_rec prepares
any photos, here aligned by five landmarks (``--landmarks``) onto the ArcFace template. Deep funneling has
already aligned LFW's faces to one pose, so every photo gets the same five points: those of the mean
deep-funneled face (``MEAN_LANDMARKS``, read off the mean of 1,500 photos). That warp is a fixed crop, the
130-pixel square at (60, 51) scaled to 112: faces framed as insightface frames MS1MV3's and its lfw.bin's,
tighter than the central 150 pixels LFW's site points to, so the background and hair take little of the picture.
The DevTrain people (4,038, 9,525 photos) are packed one photo per record (``lfw_devtrain/train.rec``), and
pairsDevTest (500 same-person, 500 different-person pairs of 1,711 people none of whom is trained on) becomes
``lfw_devtrain/lfw_devtest.bin``.

``--prepare detect`` prepares LFW's raw photos (``images/``, not deep-funneled) as a user's ordinary photos are
prepared: the face detector's five points on each photo (``--detect``: the largest face where it finds several),
warped onto the same template, into ``lfw_devtrain_detect/``. A DevTrain photo in which it finds no face is left
out of training (``--skip-bad``, named); pairsDevTest keeps all its pairs (a photo that a copy of LFW lacks in
``images/`` is taken from ``images_deepfunneled/``, said). Its runs go to folders of their own
(``...+prepare=detect``), so one --work folder holds both preparations, and ``--against mean_points`` (or
``--against detect``) adds each row's verdict against the same row, seeds and images trained on the other
preparation (its runs trained first by the same command with that ``--prepare``), over the same pairsDevTest pairs.

Each row is train.py runs of configs/lfw_r18_pair.py (the recipe) with the row's ``--set`` values and nothing
else different, one run per seed (``--seeds``, three by default). Every run sees the same images (``--images``) in
the same steps under one LR schedule: a row of V views takes batch / V records a step, and each row's schedule spans
whole epochs of its own, so the schedule is the shortest that is a whole number of epochs for every row (on
DevTrain at 128 images a step: a multiple of 148 steps). Rows:
- ``one_view``: one photo per sample; ``two_view``: two photos of the person per sample (``view_source =
  "identity"``; a person with one photo gets it twice, flipped independently); ``two_view_augment``: two
  augmented copies of one photo; ``power_1``: the recipe with the LR decaying at power 1 (train_v2's);
- ``arcface_sgd``: arcface_torch's one-GPU recipe (ArcFace at s = 64, SGD lr 0.02), one view;
- ``one_view_s32``, ``one_view_adamw``, ``one_view_crop_erase``, ``one_view_wide``: the recipe search, one view
  with one lever moved (s = 32; AdamW; random resized crop (0.7-1) with random erasing at 0.5; 1/4 width);
- ``sst``: two views, semi-siamese training's prototype queue in place of the centres (a queue of 4,096 gallery
  features, momentum 0.99: configs/lfw_r18_sst.py's values); ``sst_queue_1024``: its queue at a quarter;
- one row per margin family on two views (``cosface``, ``arcface``, ``subcenter``, ``adaface``, ``curricular``,
  ``elastic_arc``, ``elastic_cos``) at s = 32 under AdamW, with each family's own keys as configs/base.py has them.
Runs go to ``runs-<images>`` under --work, one folder per set of --set values (``runs-<images>+key=value``).
Accuracy is Accuracy-Flip on 10 folds that each hold 50 same and 50 different pairs (eval.folds). The table gives
each row's mean over its seeds of the last model's accuracy (and the seeds' spread), TAR at FAR 1e-2, the best
verification's accuracy (kept by ``keep_best``: chosen on the held-out set itself, so optimistic), the CPU minutes
of a run (over every process: the figure does not depend on what else the machine runs), and the verdict against
the first row: a paired bootstrap over the held-out pairs and the seeds of the last models' difference
(eval.paired: better, worse or can't tell, with its 95% interval). One line per run follows. A PNG beside the
table draws each row's held-out accuracy against images seen: the mean over its seeds, shaded from the lowest
seed to the highest.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from eval.paired import paired_verdict

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/lfw_r18_pair.py"
VAL_SET = "lfw_devtest"
IMAGES = "images_deepfunneled"
RAW_IMAGES = "images"
# How the photos become faces (--prepare): the fixed crop of the deep-funneled photos, or the detector on raw ones.
PREPARATIONS = {"mean_points": IMAGES, "detect": RAW_IMAGES}
# The mean deep-funneled face's eyes, nose tip and mouth corners (x, y in the 250x250 photo): the darkest points
# of the mean image's eyes and mouth, and the nose tip between them.
MEAN_LANDMARKS = (104, 111, 146, 111, 125, 135, 109, 157, 141, 157)
FAR_TARGET = 1e-2
# Each row is configs/lfw_r18_pair.py (the recipe: two views of arcface_torch's one-GPU recipe) with these values,
# nothing else: rows differ in what their names say.
ARCFACE_SGD = {"optimizer": "'sgd'", "lr": "0.02", "momentum": "0.9", "weight_decay": "5e-4",
               "margin_list": "(1.0, 0.5, 0.0)", "margin_scale": "64.0"}
# The margin families' rows: CosFace's scale and AdamW (the demo's optimizer), which learn from few classes at once.
ADAMW = {"optimizer": "'adamw'", "lr": "0.002", "weight_decay": "0.05", "margin_scale": "32.0", "num_views": "2"}
ROWS: dict[str, dict[str, str]] = {
    "one_view": {"num_views": "1"},
    "two_view": {"num_views": "2", "view_source": "'identity'"},
    "two_view_augment": {"num_views": "2", "view_source": "'augment'"},
    "power_1": {"num_views": "2", "lr_power": "1.0"},
    # the recipe search (issue 50): one view with one lever moved
    "one_view_s32": {"num_views": "1", "margin_scale": "32.0"},
    "one_view_adamw": {"num_views": "1", "optimizer": "'adamw'", "lr": "0.002", "weight_decay": "0.05"},
    "one_view_crop_erase": {"num_views": "1", "crop_scale": "(0.7, 1.0)", "erase_p": "0.5"},
    "one_view_wide": {"num_views": "1", "network_kwargs": "{'width_mult': 0.25}"},
    "arcface_sgd": {**ARCFACE_SGD, "num_views": "1"},
    # two views with semi-siamese training's queue in place of the centres (configs/lfw_r18_sst.py's values)
    "sst": {"num_views": "2", "sst": "True", "sst_queue_size": "4096", "sst_momentum": "0.99"},
    # a quarter of the queue: a quarter of a probe's own people scored as strangers (experiments.sst_false_negatives)
    "sst_queue_1024": {"num_views": "2", "sst": "True", "sst_queue_size": "1024", "sst_momentum": "0.99"},
    "cosface": {**ADAMW, "margin_family": "'combined'", "margin_list": "(1.0, 0.0, 0.35)"},
    "arcface": {**ADAMW, "margin_family": "'combined'", "margin_list": "(1.0, 0.5, 0.0)"},
    "subcenter": {**ADAMW, "margin_family": "'subcenter'", "margin_list": "(1.0, 0.0, 0.35)"},
    "adaface": {**ADAMW, "margin_family": "'adaface'"},
    "curricular": {**ADAMW, "margin_family": "'curricular'"},
    "elastic_arc": {**ADAMW, "margin_family": "'elastic_arc'"},
    "elastic_cos": {**ADAMW, "margin_family": "'elastic_cos'"},
}
LOG_TIME = re.compile(r"^Training: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)-", re.MULTILINE)
UNSAFE_IN_NAME = re.compile(r"[^\w.=-]+")  # what a --set value cannot bring into its runs folder's name
TIMING = "bench_timing.json"  # beside a run this command trained: its CPU and wall seconds
ACCURACY = re.compile(rf"\[{VAL_SET}\]\[(\d+)\]Accuracy-Flip: ([\d.]+)\+-([\d.]+)")


@dataclass(frozen=True)
class Size:
    """How much each row trains: images seen, the batch of images a step, verifications along the way."""

    images: int
    batch_images: int
    verifications: int

    @property
    def steps(self) -> int:
        return max(1, self.images // self.batch_images)


FULL = Size(images=38_400, batch_images=128, verifications=6)
QUICK = Size(images=10_240, batch_images=128, verifications=4)


# --- preparation ---------------------------------------------------------------------------------


def people(protocol_file: Path) -> list[str]:
    """The names of a peopleDev*.txt file (a count, then ``name photos`` lines)."""
    lines = protocol_file.read_text().split("\n")[1:]
    return [line.split()[0] for line in lines if line.strip()]


def pair_people(pairs_file: Path) -> set[str]:
    """Everyone a pairs*.txt file names (``name n1 n2`` or ``name1 n1 name2 n2`` lines after the header)."""
    names = set()
    for line in pairs_file.read_text().split("\n")[1:]:
        fields = line.split()
        names.update(fields[0::2] if len(fields) == 4 else fields[:1])
    return names


def pair_photos(pairs_file: Path) -> set[tuple[str, int]]:
    """Every (name, photo number) a pairs*.txt file names."""
    photos = set()
    for line in pairs_file.read_text().split("\n")[1:]:
        fields = line.split()
        if len(fields) == 3:
            photos |= {(fields[0], int(fields[1])), (fields[0], int(fields[2]))}
        elif len(fields) == 4:
            photos |= {(fields[0], int(fields[1])), (fields[2], int(fields[3]))}
    return photos


def raw_pair_photos(lfw: Path, work: Path) -> Path:
    """A folder of links to the raw photos pairsDevTest names (``work/devtest_images``), for tools.make_bin; a
    photo missing from the raw folder (some copies of LFW lack one) is linked from the deep-funneled one, and said,
    so that the set keeps every pair and stays paired with the fixed crop's."""
    folder = work / f"devtest_{RAW_IMAGES}"
    substituted = []
    for name, number in sorted(pair_photos(lfw / "pairsDevTest.txt")):
        photo = f"{name}/{name}_{number:04d}.jpg"
        link = folder / photo
        link.parent.mkdir(parents=True, exist_ok=True)
        source = lfw / RAW_IMAGES / photo
        if not source.is_file():
            source = lfw / IMAGES / photo
            substituted.append(photo)
        if not link.is_symlink():
            link.symlink_to(source.resolve())
    if substituted:
        print(f"note: {len(substituted)} photo(s) of pairsDevTest missing from {lfw / RAW_IMAGES} (e.g. "
              f"{substituted[0]}): their deep-funneled copies are used in their place")
    return folder


def check_lfw(lfw: Path, images: str = IMAGES) -> None:
    needed = [lfw / images, lfw / "peopleDevTrain.txt", lfw / "pairsDevTest.txt"]
    missing = [str(path) for path in needed if not path.exists()]
    if missing:
        kind = "the deep-funneled photos" if images == IMAGES else "the raw photos"
        raise SystemExit(f"error: {lfw} is not an LFW folder: missing {', '.join(missing)}; pass the folder holding "
                         f"{images}/ ({kind}) and LFW's peopleDevTrain.txt and pairsDevTest.txt")


def run_tool(module: str, args: Sequence[str]) -> None:
    """Run a tool; print its summary (its last line) and what it noted or warned about (photos left out)."""
    command = [sys.executable, "-m", module, *map(str, args)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith(("note:", "warning:"))]
    print("\n".join([*said, result.stdout.strip().splitlines()[-1]]))


def data_folder(work: Path, how: str) -> Path:
    """Where ``prepare`` puts the records and the .bin of preparation ``how``."""
    return work / ("lfw_devtrain" if how == "mean_points" else f"lfw_devtrain_{how}")


def prepare(lfw: Path, work: Path, workers: int, how: str = "mean_points") -> Path:
    """The records of DevTrain's people and the pairsDevTest .bin under ``work``, prepared as ``how`` says (made
    once); their folder."""
    from dataset import read_preparation  # noqa: PLC0415 (torch: seconds to import, not needed for --help)

    data = data_folder(work, how)
    bin_path = data / f"{VAL_SET}.bin"
    if bin_path.is_file():
        print(f"using the prepared data in {data}")
        return data
    images = PREPARATIONS[how]
    check_lfw(lfw, images)
    trained, held_out = people(lfw / "peopleDevTrain.txt"), pair_people(lfw / "pairsDevTest.txt")
    if overlap := set(trained) & held_out:
        raise SystemExit(f"error: {len(overlap)} people are in both peopleDevTrain.txt and pairsDevTest.txt (e.g. "
                         f"{sorted(overlap)[0]}); these are not LFW's protocol files")
    # tools.pack_rec packs a folder of people: DevTrain's, linked from LFW's folder (nothing copied).
    people_folder = work / ("devtrain_people" if images == IMAGES else f"devtrain_people_{images}")
    people_folder.mkdir(parents=True, exist_ok=True)
    for name in trained:
        link = people_folder / name
        if not link.exists():
            link.symlink_to((lfw / images / name).resolve(), target_is_directory=True)
    if how == "detect":
        option, pair_folder = ["--detect"], raw_pair_photos(lfw, work)
    else:
        landmarks = work / "landmarks.txt"
        points = " ".join(map(str, MEAN_LANDMARKS))
        photos = sorted((lfw / IMAGES).glob("*/*.jpg"))
        landmarks.write_text("".join(f"{photo.parent.name}/{photo.name} {points}\n" for photo in photos))
        option, pair_folder = ["--landmarks", landmarks], lfw / IMAGES
    # Records whose preparation is recorded are whole (tools.pack_rec writes the record last): a preparation
    # stopped at the .bin keeps them.
    if read_preparation(data / "train.rec") != ("detect" if how == "detect" else "landmarks"):
        # --skip-bad: a DevTrain photo the detector finds no face in is left out of training, named.
        run_tool("tools.pack_rec", [people_folder, data, "--views", "1", *option, "--overwrite", "--workers", workers,
                                    *(["--skip-bad"] if how == "detect" else [])])
    run_tool("tools.make_bin", [pair_folder, bin_path, "--pairs", lfw / "pairsDevTest.txt", *option, "--force"])
    return data


# --- training ------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    seed: int
    curve: list[tuple[int, float, float]]  # (images seen, Accuracy-Flip, fold spread) per verification
    best: tuple[float, float, float]       # Accuracy-Flip, spread, TAR at FAR_TARGET of the kept best model
    last: tuple[float, float, float]       # the same of the last model
    right: np.ndarray                      # whether the last model judged each held-out pair right (Accuracy-Flip)
    cpu_minutes: float
    wall_minutes: float


def views_of(name: str) -> int:
    return int(ROWS[name]["num_views"])


def row_settings(name: str, schedule: Schedule, data: Path, output: Path, seed: int,
                 extra: Sequence[str]) -> list[str]:
    views = views_of(name)
    settings = {"rec": repr(str(data)), "output": repr(str(output)), "seed": str(seed),
                "batch_size": str(schedule.batch_images // views), "max_steps": str(schedule.steps),
                "num_epoch": str(schedule.epochs[name]),
                "verbose": str(max(1, schedule.steps // schedule.verifications)),
                "frequent": str(max(1, schedule.steps // 20)), **ROWS[name]}
    return [item for key, value in settings.items() for item in ("--set", f"{key}={value}")] + \
        [item for setting in extra for item in ("--set", setting)]


def steps_per_epoch(data: Path, records_per_step: int) -> int:
    """Steps of an epoch: the header record (insightface's layout, as tools.pack_rec writes it) gives image keys
    1..a-1."""
    from dataset import RecordReader, unpack  # noqa: PLC0415

    header = unpack(RecordReader(str(data / "train.idx"), str(data / "train.rec")).read(0))[0]
    return (int(header.label[0]) - 1) // records_per_step


@dataclass(frozen=True)
class Schedule:
    """One LR schedule for every row: ``steps`` optimizer steps of ``batch_images`` images, each row's whole
    ``epochs[row]`` epochs long, so that rows of one and of two views decay their learning rate alike."""

    steps: int
    batch_images: int
    verifications: int
    epochs: dict[str, int]

    @property
    def images(self) -> int:
        return self.steps * self.batch_images


def common_schedule(size: Size, data: Path, rows: Sequence[str]) -> Schedule:
    """The shortest schedule of at least ``size.steps`` steps that is a whole number of epochs for every row: a
    multiple of each row's steps per epoch (DevTrain at 128 images: 74 steps an epoch of one view, 148 of two)."""
    per_epoch = {name: steps_per_epoch(data, size.batch_images // views_of(name)) for name in rows}
    if min(per_epoch.values()) < 1:
        raise SystemExit(f"error: --batch {size.batch_images} is more images than {data} holds for one step; pass a "
                         "smaller --batch")
    period = math.lcm(*per_epoch.values())
    steps = period * -(-size.steps // period)
    if steps > 2 * size.steps:
        raise SystemExit(f"error: the rows' epochs are {', '.join(map(str, sorted(set(per_epoch.values()))))} steps "
                         f"long, so one schedule for all of them takes {steps} steps, more than twice the "
                         f"{size.steps} asked for; pass --images {period * size.batch_images} or a multiple of it")
    return Schedule(steps, size.batch_images, size.verifications,
                    {name: steps // count for name, count in per_epoch.items()})


def train_row(name: str, schedule: Schedule, data: Path, runs: Path, seed: int, extra: Sequence[str],
              threads: int, train: bool = True) -> Result:
    """The row's run of this seed, trained unless it is finished already (``train`` False: it must be)."""
    output = runs / f"{name}-seed{seed}"
    if not train and not finished(output, schedule.steps):
        raise SystemExit(f"error: {output} holds no finished run of {name} (seed {seed}, {schedule.steps} steps) to "
                         "compare with; train it first: this command with that --prepare, the same rows, seeds, "
                         "--images and --set values")
    cpu_seconds, wall_seconds = train_run(output, row_settings(name, schedule, data, output, seed, extra),
                                          schedule.steps, threads, f"{name} (seed {seed})")
    log = (output / "training.log").read_text()
    curve = [(int(step) * schedule.batch_images, float(accuracy), float(spread))
             for step, accuracy, spread in ACCURACY.findall(log)]
    *last, right = evaluate(output, data)
    return Result(name, seed, curve, evaluate(output / "best", data)[:3], tuple(last), right,
                  cpu_seconds / 60, wall_seconds / 60)


def finished(output: Path, steps: int) -> bool:
    """Whether `output` holds a run that finished its schedule at step `steps`."""
    log_path = output / "training.log"
    return log_path.is_file() and f"training finished at global step {steps}:" in log_path.read_text()


def train_run(output: Path, settings: Sequence[str], steps: int, threads: int, what: str,
              config: str = CONFIG) -> tuple[float, float]:
    """train.py `config` with `settings` (its --set arguments, output among them) into `output`, unless a run
    that finished at step `steps` is there already; its CPU and wall seconds."""
    timing = output / TIMING
    log_path = output / "training.log"
    if finished(output, steps):
        print(f"{what}: using the finished run in {output}", flush=True)
        # Its wall time from its own log; its CPU time as this command measured it, when it trained the run.
        stamps = [datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f") for stamp in LOG_TIME.findall(log_path.read_text())]
        wall_seconds = (stamps[-1] - stamps[0]).total_seconds()
        cpu_seconds = json.loads(timing.read_text())["cpu_seconds"] if timing.is_file() else float("nan")
        return cpu_seconds, wall_seconds
    # A run stopped before its end (Ctrl-C, a kill: its last checkpoint and backbone.pth are there) goes on.
    resume = ["--resume"] if (output / "checkpoint.json").is_file() else []
    command = [sys.executable, "train.py", config, *settings, *resume]
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(output.parent / f"{output.name}.stderr", "w+") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        _, status, usage = os.wait4(process.pid, 0)  # this run's own CPU time, whatever runs beside it
        process.returncode = os.waitstatus_to_exitcode(status)
        wall_seconds, cpu_seconds = time.perf_counter() - start, usage.ru_utime + usage.ru_stime
        if process.returncode:
            stderr.seek(0)
            raise SystemExit(f"error: {what} failed ({' '.join(command)}):\n{stderr.read()[-3000:]}")
    if resume:  # the CPU time of the part before, when this command measured it
        cpu_seconds += json.loads(timing.read_text())["cpu_seconds"] if timing.is_file() else float("nan")
    timing.write_text(json.dumps({"cpu_seconds": cpu_seconds, "wall_seconds": wall_seconds}))
    return cpu_seconds, wall_seconds


def evaluate(model_folder: Path, data: Path) -> tuple[float, float, float, np.ndarray]:
    """Accuracy-Flip, its fold spread, TAR at FAR_TARGET of the backbone.pth in ``model_folder``, and whether it
    judged each pair right."""
    from backbones.trained import load_saved_backbone  # noqa: PLC0415
    from eval.verification import flip_fused, load_bin, pairs_right, test  # noqa: PLC0415

    backbone, _ = load_saved_backbone(model_folder)
    data_set = load_bin(str(data / f"{VAL_SET}.bin"))
    _, _, accuracy, spread, _, embeddings = test(data_set, backbone, 64)
    fused = flip_fused(embeddings)
    return accuracy, spread, tar_at_far(fused, data_set[1], FAR_TARGET), pairs_right(fused, data_set[1])


def tar_at_far(fused: np.ndarray, issame: Sequence[bool], far: float) -> float:
    """The share of same-person pairs accepted at the lowest cosine threshold that accepts at most ``far`` of the
    different-person pairs (all pairs of the set: a verification set's one operating point)."""
    issame = np.asarray(issame, dtype=bool)
    similarity = np.sum(fused[0::2] * fused[1::2], axis=1)
    different = np.sort(similarity[~issame])[::-1]
    allowed = int(np.floor(far * different.size))  # false accepts allowed
    threshold = different[allowed] if allowed < different.size else -np.inf
    return float(np.mean(similarity[issame] > threshold))


# --- report --------------------------------------------------------------------------------------


def by_row(results: Sequence[Result]) -> dict[str, list[Result]]:
    rows: dict[str, list[Result]] = {}
    for result in results:
        rows.setdefault(result.name, []).append(result)
    return rows


def table(results: Sequence[Result], schedule: Schedule) -> str:
    """One line per row (means over its seeds, the last model's verdict against the first row's), then one per
    run."""
    rows = by_row(results)
    reference, *_ = rows
    width = max(18, *(len(name) + 2 for name in rows))
    seeds = sorted({result.seed for result in results})
    lines = [f"LFW DevTrain -> pairsDevTest, {schedule.images:,} images per run ({schedule.steps} steps of "
             f"{schedule.batch_images}, one LR schedule for every row), seeds {' '.join(map(str, seeds))}, load "
             f"average {os.getloadavg()[0]:.1f} at the end",
             f"{'row':<{width}}{'seeds':>6}{'last acc':>10}{'sd':>7}{'TAR@1e-2':>10}{'best acc':>10}{'CPU min':>9}"
             f"  vs {reference} (last models; paired bootstrap over pairs and seeds)"]
    for name, runs in rows.items():
        last = np.array([run.last for run in runs])
        verdict = "" if name == reference else str(paired_verdict(np.stack([run.right for run in runs]),
                                                                  np.stack([run.right for run in rows[reference]])))
        lines.append(f"{name:<{width}}{len(runs):>6}{last[:, 0].mean():>10.4f}{last[:, 0].std():>7.3f}"
                     f"{last[:, 2].mean():>10.3f}{np.mean([run.best[0] for run in runs]):>10.4f}"
                     f"{np.mean([run.cpu_minutes for run in runs]):>9.1f}  {verdict}")
    lines += ["", f"{'run':<{width}}{'seed':>6}{'last acc':>10}{'+-':>7}{'TAR@1e-2':>10}{'best acc':>10}{'CPU min':>9}"
                  f"{'wall min':>10}  (+-: the spread of the 10 folds)"]
    lines += [f"{run.name:<{width}}{run.seed:>6}{run.last[0]:>10.4f}{run.last[1]:>7.3f}{run.last[2]:>10.3f}"
              f"{run.best[0]:>10.4f}{run.cpu_minutes:>9.1f}{run.wall_minutes:>10.1f}" for run in results]
    return "\n".join(lines)


def plot(results: Sequence[Result], path: Path) -> None:
    """Held-out accuracy against images seen: each row's mean over its seeds, shaded from its lowest to its
    highest seed."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, runs in by_row(results).items():
        length = min(len(run.curve) for run in runs)
        images = np.array([point[0] for point in runs[0].curve[:length]])
        accuracy = np.array([[point[1] for point in run.curve[:length]] for run in runs])
        axes.plot(images, accuracy.mean(axis=0), marker="o", label=f"{name} ({len(runs)} seeds)")
        axes.fill_between(images, accuracy.min(axis=0), accuracy.max(axis=0), alpha=0.15)
    axes.set_xlabel("images seen by the backbone")
    axes.set_ylabel(f"{VAL_SET} Accuracy-Flip (10 balanced folds)")
    axes.set_title("LFW: trained on DevTrain people, verified on pairsDevTest")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def runs_folder(work: Path, schedule: Schedule, extra: Sequence[str], how: str = "mean_points") -> Path:
    """Where this schedule's runs go: one folder per preparation and set of --set values, so that a finished run
    is reused only by the command that asks for what it trained."""
    settings = [UNSAFE_IN_NAME.sub("_", setting).strip("_") for setting in extra]
    prepared = [] if how == "mean_points" else [f"prepare={how}"]
    return work / "+".join([f"runs-{schedule.images}", *prepared, *settings])


def against_table(results: Sequence[Result], others: Sequence[Result], how: str, other: str) -> str:
    """Each row's verdict against the same row trained on the other preparation (last models, the same pairs)."""
    lines = [f"--prepare {how} against --prepare {other}, row by row (last models; paired bootstrap over the same "
             "pairsDevTest pairs and the seeds)",
             f"{'row':<22}{how:>12}{other:>12}  verdict"]
    theirs = by_row(others)
    for name, runs in by_row(results).items():
        verdict = paired_verdict(np.stack([run.right for run in runs]), np.stack([run.right for run in theirs[name]]))
        lines.append(f"{name:<22}{np.mean([run.last[0] for run in runs]):>12.4f}"
                     f"{np.mean([run.last[0] for run in theirs[name]]):>12.4f}  {verdict}")
    return "\n".join(lines)


def same_pairs(data: Path, other: Path) -> None:
    """Refuse a comparison of two preparations whose .bin files do not hold the same pairs."""
    from eval.verification import load_bin  # noqa: PLC0415

    mine, theirs = (load_bin(str(folder / f"{VAL_SET}.bin"))[1] for folder in (data, other))
    if mine != theirs:
        raise SystemExit(f"error: {data} and {other} hold different pairs ({len(mine)} and {len(theirs)}); a paired "
                         "verdict needs the same ones: prepare both from the same pairsDevTest.txt")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lfw", type=Path, metavar="LFW_FOLDER", help=f"holds {IMAGES}/ and LFW's protocol files")
    parser.add_argument("--work", type=Path, default=Path("data/lfw_bench"),
                        help="where the records, the .bin, the runs, the table and the PNG go")
    parser.add_argument("--rows", nargs="+", default=["one_view", "two_view", "two_view_augment"], choices=list(ROWS),
                        help="the first row is the one the others are compared with")
    parser.add_argument("--seeds", nargs="+", type=int, default=[2048, 2049, 2050])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.images:,} images a row instead of {FULL.images:,}")
    parser.add_argument("--images", type=int, help="images seen per row (overrides --quick)")
    parser.add_argument("--batch", type=int, default=FULL.batch_images, help="images a step, in every row")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a config value for every row, after the row's own (e.g. a narrower network)")
    parser.add_argument("--prepare", choices=list(PREPARATIONS), default="mean_points",
                        help="how photos become faces: the mean deep-funneled face's five points on "
                             f"{IMAGES}/ (a fixed crop), or the face detector's on the raw {RAW_IMAGES}/ (--detect)")
    parser.add_argument("--against", choices=list(PREPARATIONS),
                        help="also give each row's verdict against the same row trained on photos prepared this "
                             "other way (its runs finished first by this command with that --prepare)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes preparing photos")
    parser.add_argument("--parallel", type=int, default=1,
                        help="rows trained side by side, the cores split between them (one thread each on 2 cores "
                             "with --parallel 2 holds up better than two threads when other work shares the CPU)")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    size = Size(args.images or size.images, args.batch, size.verifications)
    work = args.work.resolve()
    if args.against == args.prepare:
        raise SystemExit(f"error: --against {args.against} is the preparation this command trains; pass the other one")
    other_data = None if args.against is None else data_folder(work, args.against)
    if other_data is not None and not (other_data / f"{VAL_SET}.bin").is_file():
        raise SystemExit(f"error: {other_data} holds no prepared data to compare with; run this command with "
                         f"--prepare {args.against} first")
    data = prepare(args.lfw.resolve(), work, args.workers, args.prepare)
    schedule = common_schedule(size, data, args.rows)
    runs = runs_folder(work, schedule, args.extra, args.prepare)
    if other_data is not None:  # before any training
        same_pairs(data, other_data)
    threads = max(1, (os.cpu_count() or 1) // args.parallel)

    def run(row: tuple[str, int]) -> Result:
        result = train_row(row[0], schedule, data, runs, row[1], args.extra, threads)
        print(f"{result.name} seed {result.seed}: best {result.best[0]:.4f}, last {result.last[0]:.4f}", flush=True)
        return result

    with ThreadPoolExecutor(args.parallel) as pool:  # each run its own process: side by side, threads split
        results = list(pool.map(run, [(name, seed) for name in args.rows for seed in args.seeds]))
    report = table(results, schedule)
    if other_data is not None:
        other_schedule = common_schedule(size, other_data, args.rows)
        other_runs = runs_folder(work, other_schedule, args.extra, args.against)
        others = [train_row(name, other_schedule, other_data, other_runs, seed, args.extra, threads, train=False)
                  for name in args.rows for seed in args.seeds]
        report += "\n\n" + against_table(results, others, args.prepare, args.against)
    print(report)
    (runs / "table.txt").write_text(report + "\n")
    plot(results, runs / "accuracy.png")
    print(f"table: {runs / 'table.txt'}; accuracy against images seen: {runs / 'accuracy.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
