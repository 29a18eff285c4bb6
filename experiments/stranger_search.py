"""Does tools.search name strangers? Open-set search on LFW people the model never saw: some enrolled, some not.

    python -m experiments.stranger_search /path/to/lfw --model output/lfw_run [--work data/stranger_search]
        [--members 40] [--strangers 40] [--enrol 3] [--queries 4] [--fpir 0.01] [--seed 0]

LFW_FOLDER as experiments.real_faces takes it (``images_deepfunneled/`` and ``peopleDevTest.txt``); --model a run
folder trained on DevTrain's people (experiments.real_faces, or train.py configs/lfw_r18_pair.py), so that every
DevTest person is new to it. From the DevTest people with more than --enrol photos (drawn with --seed): --members of
them are enrolled with their first --enrol photos (a gallery folder of links under --work), and up to --queries of
their other photos are searched (mated queries); --strangers others are never enrolled, and up to --queries of their
photos are searched (non-mated queries). Photos are aligned as experiments.real_faces aligns them (the mean
deep-funneled face's five points). Everything written goes under --work: the photos are their owners', and nothing
made from them belongs in the repository.

The table: of the strangers' queries, the fraction tools.search names as a known person (its false-identification
rate) at its deciding threshold, and at the pair threshold alone (what it decided by before it set a threshold of
its own); of the members' queries, the fraction named as the right person (its identification rate) at each, and
the fraction whose most similar person is the right one (rank 1, no threshold).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path

import numpy as np

from eval.table import boxed_table
from experiments.real_faces import IMAGES, MEAN_LANDMARKS
from tools import search

TOP = re.compile(r"^  1\. (\S+) +(-?[\d.]+)$")
PAIR = re.compile(r"^pair threshold ([\d.]+) of (\S+)")
DECIDING = re.compile(r"^known person: a best similarity above ([\d.]+)")


def devtest_people(lfw: Path, enrol: int) -> list[tuple[str, int]]:
    """``(name, photos)`` of the peopleDevTest.txt people with more than ``enrol`` photos."""
    lines = (lfw / "peopleDevTest.txt").read_text().split("\n")[1:]
    listed = [(fields[0], int(fields[1])) for fields in map(str.split, lines) if len(fields) == 2]
    return [(name, count) for name, count in listed if count > enrol]


def photo(lfw: Path, name: str, number: int) -> Path:
    return lfw / IMAGES / name / f"{name}_{number:04d}.jpg"


def lay_out(lfw: Path, work: Path, args: argparse.Namespace) -> tuple[Path, Path, list[tuple[Path, str | None]]]:
    """The gallery folder (links), the landmarks file, and each query with the member it shows (None: a stranger)."""
    people = devtest_people(lfw, args.enrol)
    if len(people) < args.members + args.strangers:
        raise SystemExit(f"error: {lfw / 'peopleDevTest.txt'} lists {len(people)} people with more than {args.enrol} "
                         f"photos, fewer than --members {args.members} + --strangers {args.strangers}; ask for fewer")
    order = np.random.default_rng(args.seed).permutation(len(people))
    members = [people[i] for i in order[:args.members]]
    strangers = [people[i] for i in order[args.members:args.members + args.strangers]]
    gallery = work / f"gallery-seed{args.seed}"
    points = " ".join(map(str, MEAN_LANDMARKS))
    landmarks, queries = [], []
    for name, count in members:
        (gallery / name).mkdir(parents=True, exist_ok=True)
        for number in range(1, args.enrol + 1):
            link = gallery / name / photo(lfw, name, number).name
            if not link.exists():
                link.symlink_to(photo(lfw, name, number).resolve())
            landmarks.append(f"{name}/{link.name} {points}")
        queries += [(photo(lfw, name, number), name) for number in range(args.enrol + 1, count + 1)][:args.queries]
    for name, count in strangers:
        queries += [(photo(lfw, name, number), None) for number in range(1, count + 1)][:args.queries]
    landmarks += [f"{query} {points}" for query, _ in queries]
    landmarks_file = work / f"landmarks-seed{args.seed}.txt"
    landmarks_file.write_text("\n".join(landmarks) + "\n")
    return gallery, landmarks_file, queries


def searched(args: argparse.Namespace, gallery: Path, landmarks: Path, queries: list[Path]) -> str:
    """tools.search's output for the queries (its own progress and notes go to stderr, shown as they come)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = search.main(["--model", str(args.model), "--gallery", str(gallery), *map(str, queries),
                              "--landmarks", str(landmarks), "--fpir", str(args.fpir), "--top", "1"])
    if status:
        raise SystemExit(f"error: tools.search failed ({status})")
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lfw", type=Path, metavar="LFW_FOLDER")
    parser.add_argument("--model", type=Path, required=True, help="a run folder trained on LFW's DevTrain people")
    parser.add_argument("--work", type=Path, default=Path("data/stranger_search"))
    parser.add_argument("--members", type=int, default=40, help="DevTest people enrolled in the gallery")
    parser.add_argument("--strangers", type=int, default=40, help="DevTest people searched but never enrolled")
    parser.add_argument("--enrol", type=int, default=3, help="photos of each member in the gallery")
    parser.add_argument("--queries", type=int, default=4, help="photos searched per person, at most")
    parser.add_argument("--fpir", type=float, default=0.01, help="tools.search --fpir")
    parser.add_argument("--seed", type=int, default=0, help="which people are members and which strangers")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    gallery, landmarks, queries = lay_out(args.lfw, args.work, args)
    out = searched(args, gallery, landmarks, [query for query, _ in queries])
    lines = out.splitlines()
    deciding = float(next(m for m in map(DECIDING.match, lines) if m).group(1))
    pairs = [m for m in map(PAIR.match, lines) if m]
    best = [(m.group(1), float(m.group(2))) for m in map(TOP.match, lines) if m]  # one per query, in query order
    members = [(name, score, who) for (name, score), (_, who) in zip(best, queries) if who is not None]
    strangers = [score for (_, score), (_, who) in zip(best, queries) if who is None]
    print("\n".join(line for line in lines if line.startswith(("search threshold", "pair threshold", "known person:"))))
    thresholds = [(f"deciding threshold {deciding:.4f}", deciding)]
    thresholds += [(f"pair threshold {float(m.group(1)):.4f} of {m.group(2)} alone", float(m.group(1))) for m in pairs]
    rows = []
    for label, threshold in thresholds:
        named = sum(score > threshold for score in strangers)
        found = sum(score > threshold and name == who for name, score, who in members)
        rows.append([label, f"{named}/{len(strangers)} = {named / len(strangers):.3f}",
                     f"{found}/{len(members)} = {found / len(members):.3f}"])
    rank1 = sum(name == who for name, _, who in members)
    rows.append(["no threshold (rank 1)", "-", f"{rank1}/{len(members)} = {rank1 / len(members):.3f}"])
    print(f"{args.members} members ({args.enrol} photos each enrolled), {args.strangers} strangers, up to "
          f"{args.queries} queries each; seed {args.seed}")
    print(boxed_table(["known person when the best similarity passes", "strangers named (FPIR)",
                       "members named rightly (TPIR)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
