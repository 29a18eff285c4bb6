"""The README's "Your own photos" path on ordinary photos, measured: configs/my_faces.py trained on a group of LFW
people's raw photos prepared by the face detector (--detect) against the same photos centre-cropped (--crop).

    python -m experiments.own_photos /path/to/lfw [--work data/lfw_own_photos] [--seeds 1 2 3]

People: peopleDevTest's with 4 to 12 photos (as a newcomer's folder might hold), ``--people`` of them drawn by
``--draw-seed``; the last ``--held-out`` are kept out of training. Their raw photos (LFW's ``images/``, as the
photographer's crop around the person left them) are linked under --work as ``photos/`` and ``photos_val/``, the
README's two folders, and each preparation runs the README's commands on them into a folder of its own: tools.pack_rec
--views 2 (with --detect, ``--skip-bad``: a photo with no face is left out, named), tools.make_bin --random PAIRS
(the same pairs for both: they are drawn from the folder before any photo is prepared), then train.py
configs/my_faces.py once per seed. The table gives each preparation's held-out Accuracy-Flip of the last model (mean
of the seeds) and the verdict of --detect against --crop: a paired bootstrap over the same pairs and the seeds
(eval.paired). The photos are their owners': everything this command writes goes under --work.
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eval.paired import paired_verdict

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/my_faces.py"
RAW_IMAGES = "images"
VAL_SET = "my_faces_val"
FEWEST, MOST = 4, 12  # photos per person drawn
PREPARATIONS = {"detect": ["--detect"], "crop": ["--crop"]}  # the first is judged against the second


def run(command: Sequence[object]) -> list[str]:
    """A command of this checkout run to its end (or one error line with its last words); what it noted or warned
    about (photos left out, several faces), then its last line."""
    command = [str(part) for part in command]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith(("note:", "warning:"))]
    return [*said, *result.stdout.strip().splitlines()[-1:]]


def draw_people(lfw: Path, count: int, held_out: int, seed: int) -> tuple[list[str], list[str]]:
    """``count`` peopleDevTest people with FEWEST..MOST photos, drawn by ``seed``: (trained, held out)."""
    listed = [line.split() for line in (lfw / "peopleDevTest.txt").read_text().splitlines()[1:] if line.strip()]
    fitting = sorted(name for name, photos in listed if FEWEST <= int(photos) <= MOST
                     and len(list((lfw / RAW_IMAGES / name).glob("*.jpg"))) >= FEWEST)
    if len(fitting) < count or not 2 <= held_out <= count - 2:
        raise SystemExit(f"error: --people {count} --held-out {held_out} asks for more than the {len(fitting)} "
                         f"peopleDevTest people with {FEWEST}-{MOST} photos in {lfw / RAW_IMAGES}, or keeps out fewer "
                         "than 2 or trains fewer than 2; pass smaller numbers")
    drawn = random.Random(seed).sample(fitting, count)
    return drawn[:count - held_out], drawn[count - held_out:]


def link_photos(lfw: Path, names: Sequence[str], folder: Path) -> None:
    for name in names:  # links to LFW's photos: nothing copied
        (folder / name).mkdir(parents=True, exist_ok=True)
        for photo in sorted((lfw / RAW_IMAGES / name).glob("*.jpg")):
            if not (folder / name / photo.name).is_symlink():
                (folder / name / photo.name).symlink_to(photo.resolve())


def right_pairs(run_folder: Path, data: Path) -> np.ndarray:
    """Whether the run's last model judges each held-out pair right (Accuracy-Flip)."""
    from backbones.trained import load_saved_backbone  # noqa: PLC0415 (torch: not needed for --help)
    from eval.verification import flip_fused, load_bin, pairs_right, test  # noqa: PLC0415

    backbone, _ = load_saved_backbone(run_folder)
    data_set = load_bin(str(data / f"{VAL_SET}.bin"))
    return pairs_right(flip_fused(test(data_set, backbone, 64)[-1]), data_set[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lfw", type=Path, metavar="LFW_FOLDER", help=f"holds {RAW_IMAGES}/ and peopleDevTest.txt")
    parser.add_argument("--work", type=Path, default=ROOT / "data" / "lfw_own_photos",
                        help="where the photo links, records, sets and runs go")
    parser.add_argument("--people", type=int, default=40, help="people drawn (the issue's newcomer: 40)")
    parser.add_argument("--held-out", type=int, default=8, help="of them, kept out of training")
    parser.add_argument("--pairs", type=int, default=50, help="same-person and different-person pairs, each")
    parser.add_argument("--draw-seed", type=int, default=58, help="seed of the people drawn and of the pairs")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="training seeds, one run each")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a config value for every run (e.g. num_epoch=2 for a rehearsal)")
    args = parser.parse_args(argv)
    if not (args.lfw / "peopleDevTest.txt").is_file() or not (args.lfw / RAW_IMAGES).is_dir():
        raise SystemExit(f"error: {args.lfw} is not an LFW folder: it needs {RAW_IMAGES}/ (the raw photos) and "
                         "peopleDevTest.txt")
    work = args.work.resolve()
    trained, held_out = draw_people(args.lfw, args.people, args.held_out, args.draw_seed)
    link_photos(args.lfw, trained, work / "photos")
    link_photos(args.lfw, held_out, work / "photos_val")
    right: dict[str, list[np.ndarray]] = {}
    for how, option in PREPARATIONS.items():
        data = work / how / "data"
        if not (data / f"{VAL_SET}.bin").is_file():
            skip_bad = ["--skip-bad"] if how == "detect" else []
            for line in [*run([sys.executable, "-m", "tools.pack_rec", work / "photos", data, "--views", "2", *option,
                               "--overwrite", "--workers", "1", *skip_bad]),
                         *run([sys.executable, "-m", "tools.make_bin", work / "photos_val", data / f"{VAL_SET}.bin",
                               "--random", args.pairs, "--seed", args.draw_seed, *option, "--force"])]:
                print(f"{how}: {line}", flush=True)
        for seed in args.seeds:
            output = work / how / f"run-seed{seed}"
            log = output / "training.log"
            if not (log.is_file() and "training finished at global step" in log.read_text()):
                settings = [f"rec={str(data)!r}", f"output={str(output)!r}", f"seed={seed}", *args.extra]
                resume = ["--resume"] if (output / "checkpoint.json").is_file() else []  # a run stopped goes on
                run([sys.executable, "train.py", CONFIG, *(part for setting in settings for part in ("--set", setting)),
                     *resume])
            right.setdefault(how, []).append(right_pairs(output, data))
            print(f"{how} seed {seed}: held-out Accuracy-Flip {right[how][-1].mean():.4f}", flush=True)
    first, second = PREPARATIONS
    print(f"{len(trained)} people trained, {len(held_out)} kept out ({args.pairs} + {args.pairs} pairs), "
          f"seeds {' '.join(map(str, args.seeds))}, {CONFIG}")
    for how in PREPARATIONS:
        print(f"--{how}: held-out Accuracy-Flip {np.mean([r.mean() for r in right[how]]):.4f} (last models)")
    verdict = paired_verdict(np.stack(right[first]), np.stack(right[second]))
    print(f"--{first} against --{second} (paired bootstrap over the same pairs and the seeds): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
