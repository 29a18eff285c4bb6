"""Does tools.search name its members and not strangers, on galleries of a few to a hundred people? Open-set search
on LFW people the model never saw: some enrolled, some not.

    python -m experiments.stranger_search /path/to/lfw --model output/lfw_run [--work data/stranger_search]
        [--sizes 8 30 100] [--strangers 100] [--enrol 4] [--queries 4] [--fpirs 0.01 0.05 0.2] [--seed 0]

LFW_FOLDER as experiments.real_faces takes it (``images_deepfunneled/`` and ``peopleDevTest.txt``); --model a run
folder trained on DevTrain's people (experiments.real_faces, or train.py configs/lfw_r18_recipe.py), so that every
DevTest person is new to it. The DevTest people with more than --enrol photos are put in a seeded order: a gallery
of each of --sizes people enrols the first that many of them, each with their first --enrol photos (a gallery
folder of links under --work), and searches up to --queries of each member's other photos (mated queries).
--strangers other DevTest people (drawn with the seed from those no gallery enrols: the same strangers for every
size) are never enrolled, and up to --queries of their photos are searched (non-mated queries). Photos are
prepared as experiments.real_faces prepared the model's training photos (the mean deep-funneled face's five
points, ``--landmarks``). Everything written goes under --work: the photos are their owners', and nothing made from
them belongs in the repository.

One tools.search run per gallery gives each query's most similar member and its similarity; the table then
reads, for each gallery, at each rule a known person must pass: the members' queries named as the right person
(identified), named as another member (wrong), and the strangers' queries named as somebody (false alarms). The
rules: tools.search's deciding threshold at each of --fpirs (its search threshold, set on the gallery's own
stranger scores, or at the lowest rate the gallery can place when --fpir is below it, and the pair threshold
recorded in model.json: the higher), the rule before a gallery too small for the rate was said (its highest
stranger score, which none of its photos passes), the pair threshold alone, and no threshold (rank 1).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path

import numpy as np

from backbones.trained import find_saved_backbone
from eval.gallery import gallery_file, load_gallery
from eval.table import boxed_table
from experiments.real_faces import IMAGES, MEAN_LANDMARKS
from tools import search

TOP = re.compile(r"^  1\. (\S+) +(-?[\d.]+)$")


def devtest_people(lfw: Path) -> list[tuple[str, int]]:
    """``(name, photos)`` of every peopleDevTest.txt person."""
    lines = (lfw / "peopleDevTest.txt").read_text().split("\n")[1:]
    return [(fields[0], int(fields[1])) for fields in map(str.split, lines) if len(fields) == 2]


def photo(lfw: Path, name: str, number: int) -> Path:
    return lfw / IMAGES / name / f"{name}_{number:04d}.jpg"


def draw_people(lfw: Path, args: argparse.Namespace) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The members in their seeded order (as many as the largest gallery enrols) and the strangers."""
    people = devtest_people(lfw)
    enrollable = [person for person in people if person[1] > args.enrol]
    largest = max(args.sizes)
    if len(enrollable) < largest:
        raise SystemExit(f"error: {lfw / 'peopleDevTest.txt'} lists {len(enrollable)} people with more than "
                         f"{args.enrol} photos, fewer than the largest of --sizes, {largest}; ask for fewer")
    rng = np.random.default_rng(args.seed)
    members = [enrollable[i] for i in rng.permutation(len(enrollable))[:largest]]
    others = [person for person in people if person not in members]
    if len(others) < args.strangers:
        raise SystemExit(f"error: {len(others)} DevTest people are left beside the members, fewer than --strangers "
                         f"{args.strangers}; ask for fewer")
    return members, [others[i] for i in rng.permutation(len(others))[:args.strangers]]


def lay_out(lfw: Path, work: Path, members: list[tuple[str, int]], strangers: list[tuple[str, int]],
            args: argparse.Namespace) -> tuple[Path, Path, list[tuple[Path, str | None]]]:
    """The gallery folder (links), the landmarks file, and each query with the member it shows (None: a stranger)."""
    gallery = work / f"gallery-{len(members)}-seed{args.seed}"
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
    landmarks_file = work / f"landmarks-{len(members)}-seed{args.seed}.txt"
    landmarks_file.write_text("\n".join(landmarks) + "\n")
    return gallery, landmarks_file, queries


def best_matches(model: Path, gallery: Path, landmarks: Path, queries: list[Path]) -> list[tuple[str, float]]:
    """Each query's most similar member and its similarity, by tools.search (its progress goes to stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = search.main(["--model", str(model), "--gallery", str(gallery), *map(str, queries),
                              "--landmarks", str(landmarks), "--top", "1"])
    if status:
        raise SystemExit(f"error: tools.search failed ({status})")
    best = [(m.group(1), float(m.group(2))) for m in map(TOP.match, out.getvalue().splitlines()) if m]
    assert len(best) == len(queries), "tools.search printed one best match per query"
    return best


def rules(gallery: Path, model: Path, fpirs: list[float]) -> list[tuple[str, float | None]]:
    """``(rule, threshold)`` of each rule the table reads (None: no threshold, rank 1)."""
    built, saved = load_gallery(gallery_file(gallery)), find_saved_backbone(model)
    found = []
    for fpir in fpirs:
        options = argparse.Namespace(fpir=fpir, threshold_set=None, threshold=None)
        threshold, lines = search.deciding_threshold(built, saved, options)
        placed = "" if "the lowest rate" not in lines[0] else f", placed at {2 / built.nonmated.size:.3g}"
        found.append((f"tools.search --fpir {fpir:g}{placed}", threshold))
    if int(built.nonmated.size * min(fpirs)) < 2:
        found.append((f"highest stranger score (before; --fpir {min(fpirs):g})", float(built.nonmated.max())))
    pair, _ = search.pair_threshold(saved, None)
    if pair is not None:
        found.append(("the pair threshold alone", pair))
    return [*found, ("no threshold (rank 1)", None)]


def table_rows(size: int, photos: int, best: list[tuple[str, float]], queries: list[tuple[Path, str | None]],
               thresholds: list[tuple[str, float | None]]) -> list[list[str]]:
    members = [(name, score, who) for (name, score), (_, who) in zip(best, queries) if who is not None]
    strangers = [score for (_, score), (_, who) in zip(best, queries) if who is None]
    rows = []
    for rule, threshold in thresholds:
        floor = -np.inf if threshold is None else threshold
        right = sum(score > floor and name == who for name, score, who in members)
        wrong = sum(score > floor and name != who for name, score, who in members)
        named = sum(score > floor for score in strangers)
        rows.append([f"{size} ({photos})", rule, "-" if threshold is None else f"{threshold:.3f}",
                     f"{right}/{len(members)} = {right / len(members):.2f}", f"{wrong}",
                     "-" if threshold is None else f"{named}/{len(strangers)} = {named / len(strangers):.2f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lfw", type=Path, metavar="LFW_FOLDER")
    parser.add_argument("--model", type=Path, required=True, help="a run folder trained on LFW's DevTrain people")
    parser.add_argument("--work", type=Path, default=Path("data/stranger_search"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 30, 100], help="people each gallery enrols")
    parser.add_argument("--strangers", type=int, default=100, help="DevTest people searched but never enrolled")
    parser.add_argument("--enrol", type=int, default=4, help="photos of each member in the gallery")
    parser.add_argument("--queries", type=int, default=4, help="photos searched per person, at most")
    parser.add_argument("--fpirs", type=float, nargs="+", default=[0.01, 0.05, 0.2], help="tools.search --fpir values")
    parser.add_argument("--seed", type=int, default=0, help="which people are members and which strangers")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    members, strangers = draw_people(args.lfw, args)
    rows = []
    for size in sorted(args.sizes):
        gallery, landmarks, queries = lay_out(args.lfw, args.work, members[:size], strangers, args)
        best = best_matches(args.model, gallery, landmarks, [query for query, _ in queries])
        rows += table_rows(size, size * args.enrol, best, queries, rules(gallery, args.model, args.fpirs))
    stranger_queries = sum(min(count, args.queries) for _, count in strangers)
    print(f"{args.strangers} strangers ({stranger_queries} queries), members enrolled with {args.enrol} photos and "
          f"searched with up to {args.queries} others; seed {args.seed}")
    print(boxed_table(["gallery people (photos)", "a known person passes", "threshold", "members named rightly",
                       "named wrongly", "strangers named"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
