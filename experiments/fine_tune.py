"""Fine-tuning a trained backbone on new people against training from scratch on them, measured on LFW.

    python -m experiments.fine_tune /path/to/lfw --backbone output/lfw_r18_pair/backbone.pth [--work data/lfw_finetune]

--backbone is a backbone trained on LFW's DevTrain people (configs/lfw_r18_pair.py; its architecture must be
configs/finetune_my_faces.py's). The new people are peopleDevTest's, none of whom that backbone saw: those with
two photos or more (at most MAX_PHOTOS each, the first by name, so that a few people with a hundred photos do not
make up the set) are split by a seeded draw into TRAIN_SHARE to fine-tune on (tools.pack_rec --views 2) and the
rest held out (tools.make_bin --random PAIRS: same-person and different-person pairs of people never trained on).
Photos are aligned as experiments.real_faces aligns them (the mean deep-funneled face's five landmarks). Everything it
writes goes under --work: the photos are their owners', nothing made from them belongs in this repository.

Rows, each a train.py run of configs/finetune_my_faces.py for the same steps:
- ``scratch``: no backbone loaded (every weight from the seed), backbone_lr_mult=1, no warm-up;
- ``as trained``: the loaded backbone verified as it is (no step: what it knows of faces it never saw);
- ``fine-tune``: the loaded backbone, backbone_lr_mult as the config says, no warm-up;
- ``fine-tune + warm-up``: the same with the config's freeze_backbone_steps (centres alone at first).
Columns: held-out Accuracy-Flip at the end (10 folds, with their spread: differences smaller than that are
noise), the run's CPU minutes (every process, so the figure does not depend on what
else the machine runs) and its wall minutes.
"""
from __future__ import annotations

import argparse
import random
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from dataset import RecordReader, unpack
from training.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/finetune_my_faces.py"
IMAGES = "images_deepfunneled"
VAL_SET = "finetune_val"
MEAN_LANDMARKS = (104, 111, 146, 111, 125, 135, 109, 157, 141, 157)  # eyes, nose tip, mouth corners (250x250)
MAX_PHOTOS, TRAIN_SHARE, PAIRS, SPLIT_SEED = 10, 0.6, 200, 46
ACCURACY = re.compile(rf"\[{VAL_SET}\]\[(\d+)\]Accuracy-Flip: ([\d.]+)\+-([\d.]+)")


def run_tool(module: str, args: list) -> None:
    command = [sys.executable, "-m", module, *map(str, args)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")


def prepare(lfw: Path, work: Path) -> Path:
    """Records of the fine-tune people and the held-out .bin under `work` (made once); their folder."""
    data = work / "records"
    if (data / f"{VAL_SET}.bin").is_file():
        print(f"using the prepared data in {data}")
        return data
    if not (lfw / "peopleDevTest.txt").is_file() or not (lfw / IMAGES).is_dir():
        raise SystemExit(f"error: {lfw} is not an LFW folder: it needs {IMAGES}/ and peopleDevTest.txt")
    counts = [line.split() for line in (lfw / "peopleDevTest.txt").read_text().splitlines()[1:] if line.strip()]
    people = sorted(name for name, count in counts if int(count) >= 2)
    random.Random(SPLIT_SEED).shuffle(people)
    cut = round(len(people) * TRAIN_SHARE)
    points = " ".join(map(str, MEAN_LANDMARKS))
    landmarks = work / "landmarks.txt"
    lines = []
    for part, names in (("train_people", people[:cut]), ("held_out_people", people[cut:])):
        for name in names:  # links to LFW's photos: nothing copied
            folder = work / part / name
            folder.mkdir(parents=True, exist_ok=True)
            for photo in sorted((lfw / IMAGES / name).glob("*.jpg"))[:MAX_PHOTOS]:
                if not (folder / photo.name).exists():
                    (folder / photo.name).symlink_to(photo.resolve())
                lines.append(f"{name}/{photo.name} {points}\n")
    landmarks.write_text("".join(lines))
    run_tool("tools.pack_rec", [work / "train_people", data, "--views", "2", "--landmarks", landmarks, "--overwrite"])
    run_tool("tools.make_bin", [work / "held_out_people", data / f"{VAL_SET}.bin", "--random", PAIRS, "--seed",
                                SPLIT_SEED, "--landmarks", landmarks, "--force"])
    print(f"{cut} people to fine-tune on, {len(people) - cut} held out ({PAIRS} + {PAIRS} pairs), in {data}")
    return data


def steps_per_epoch(data: Path, batch_size: int) -> int:
    """The header record (insightface's layout, as tools.pack_rec writes it) says image keys are 1..a-1."""
    header = unpack(RecordReader(str(data / "train.idx"), str(data / "train.rec")).read(0))[0]
    return (int(header.label[0]) - 1) // batch_size


def train_row(sets: list[str], output: Path) -> tuple[list[tuple[int, float, float]], float, float]:
    """One train.py run: (step, Accuracy-Flip, spread) of each verification, CPU minutes, wall minutes."""
    command = [sys.executable, "train.py", CONFIG, *(item for setting in [*sets, f"output={output}"]
                                                      for item in ("--set", setting))]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    curve = [(int(step), float(acc), float(std))
             for step, acc, std in ACCURACY.findall((output / "training.log").read_text())]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return curve, cpu / 60, wall / 60


def verify_as_trained(backbone: Path, data: Path) -> tuple[float, float]:
    """Accuracy-Flip and spread of the loaded backbone on the held-out set, no step taken."""
    cfg = load_config(ROOT / CONFIG)
    options = [f"{key}={value}" for key, value in {**cfg.network_kwargs, "num_features": cfg.embedding_size}.items()]
    command = [sys.executable, "-m", "eval.verification", "--model", str(backbone), "--network", cfg.network,
               "--network-kw", *options, "--bins", str(data / f"{VAL_SET}.bin")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    found = re.search(r"Accuracy-Flip: ([\d.]+)\+-([\d.]+)", result.stdout + result.stderr)
    return float(found.group(1)), float(found.group(2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("lfw", type=Path, help=f"LFW folder: {IMAGES}/ and peopleDevTest.txt")
    parser.add_argument("--backbone", type=Path, required=True, help="a DevTrain-trained backbone.pth")
    parser.add_argument("--work", type=Path, default=ROOT / "data" / "lfw_finetune", help="where data and runs go")
    parser.add_argument("--steps", type=int, default=54, help="optimizer steps of every trained row (54: 3 epochs)")
    args = parser.parse_args(argv)
    data = prepare(args.lfw, args.work)
    cfg = load_config(ROOT / CONFIG)
    epochs = -(-args.steps // steps_per_epoch(data, cfg.batch_size))  # the LR schedule ends with the last step
    common = [f"rec={str(data)!r}", f"val_targets=({VAL_SET!r},)", f"max_steps={args.steps}", f"num_epoch={epochs}",
              f"verbose={args.steps}"]
    rows = {"scratch": ["resume=False", "backbone_lr_mult=1.0", "freeze_backbone_steps=0"],
            "fine-tune": [f"resume={str(args.backbone)!r}", "freeze_backbone_steps=0"],
            "fine-tune + warm-up": [f"resume={str(args.backbone)!r}"]}
    lines = ["| start | held-out Accuracy-Flip | CPU minutes | wall minutes |", "|---|---|---|---|"]
    accuracy, spread = verify_as_trained(args.backbone, data)
    lines.append(f"| as trained (no step) | {accuracy:.3f} ± {spread:.3f} | 0 | 0 |")
    print(lines[-1], flush=True)
    for name, sets in rows.items():
        output = args.work / "runs" / name.replace(" + ", "_").replace(" ", "_")
        curve, cpu, wall = train_row([*common, *sets], output)
        _, last, last_spread = curve[-1]
        lines.append(f"| {name} | {last:.3f} ± {last_spread:.3f} | {cpu:.1f} | {wall:.1f} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
