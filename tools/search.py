"""Search face photos in a gallery of known people: who is this, or nobody we know?

    python -m tools.search --model output/my_faces --gallery photos/ query.jpg
    python -m tools.search --model output/my_faces --gallery photos/ a.jpg b.jpg --top 3 --crop

The gallery is a folder with one sub-folder of photos per person (named after them). The first search
embeds every photo and keeps each person's template (their photos' embeddings averaged) in a file beside
the folder, ``photos.gallery.npz``; later searches reuse it while the model and the photos are unchanged
(by each file's size and modification time) and the photos' preparation are unchanged, and build it
again, saying which of them changed, when one did (--rebuild forces it). Photos, gallery and queries
alike, are prepared as every tool prepares them (--resize, --crop, --pad, --landmarks or --detect): by default as
the training photos were (model.json records the option tools.pack_rec packed them with; --resize when
it records none), as tools.inference does; a landmarks file names gallery photos relative to the gallery
folder and queries as given here.

Open-set search, as identification systems decide it: every query meets every person in the gallery, so a
threshold chosen for one pair (verification's, at its false-accept rate) lets far too many strangers through.
The search threshold is set on the gallery itself: each gallery photo searched among the *other* people is a
face the gallery does not hold, and the threshold is the similarity that --fpir (default 0.01) of those best
scores pass (eval.identification's placement, as the IJB 1:N evaluation places it). n photos place no rate
below 2/n (the threshold is their k-th highest score, k = int(n * FPIR), which k - 1 of them pass: a rate
needs k >= 2): a gallery too small for --fpir (32 photos for 0.01 or 0.05) says so and sets the threshold
at 2/n, the lowest rate it can place, instead. A known person must also pass the pair threshold of the set
--threshold-set names (by default the set model.json names, else the largest recorded set of people kept out of
training, as tools.inference and eval.verification choose it): the higher of the two decides. The first lines
say both and which decides; --threshold SIMILARITY decides by that similarity alone.

For each query: the --top most similar people with their cosine similarity, then "known person NAME" when the
best similarity is above the deciding threshold, else "unknown".
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from backbones import face_tensor, flip_fused_embeddings
from backbones.trained import (
    SavedBackbone,
    add_backbone_arguments,
    add_threshold_set_argument,
    deciding_set,
    far_words,
    load_backbone_from_args,
    weak_threshold_caution,
)
from dataset import (
    Preparation,
    add_preparation_arguments,
    add_skip_bad_argument,
    preparation_following,
    prepare_or_skip,
    several_faces_line,
    skipped_line,
    stretch_warning,
)
from eval.gallery import (
    PersonGallery,
    build_gallery,
    gallery_file,
    gallery_people,
    load_gallery,
    model_digest,
    photos_digest,
    preparation_stamp,
    save_gallery,
    top_matches,
)
from eval.identification import threshold_at_fpir
from utils.cli import exit_on_user_error
from utils.errors import ConfigError, DataError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queries", nargs="+", type=Path, metavar="QUERY", help="face photos to search for")
    add_backbone_arguments(parser)
    parser.add_argument("--gallery", required=True, type=Path,
                        help="folder with one sub-folder of photos per person")
    parser.add_argument("--top", type=int, default=5, help="how many of the most similar people to list")
    parser.add_argument("--batch-size", type=int, default=64, help="gallery photos per forward pass")
    parser.add_argument("--rebuild", action="store_true", help="build the gallery file again even if it is current")
    parser.add_argument("--fpir", type=float, default=0.01,
                        help="the false-identification rate the search threshold is set for: the fraction of the "
                             "gallery's own photos, each searched among the other people, whose best similarity "
                             "passes it (default 0.01)")
    parser.add_argument("--threshold", type=float, metavar="SIMILARITY",
                        help="decide by this cosine similarity alone (a known person's best similarity is above it), "
                             "in place of the search and pair thresholds, which are still said")
    add_threshold_set_argument(parser)
    add_skip_bad_argument(parser, "a gallery person left without photos is left out of the gallery; a query, of "
                                  "the search")
    add_preparation_arguments(parser, "a gallery photo's path relative to --gallery, or a query's path as given",
                              "the model's model.json")
    return parser.parse_args(argv)


def current_gallery(args: argparse.Namespace, model: torch.nn.Module, saved: SavedBackbone,
                    preparation: Preparation) -> PersonGallery:
    """The gallery file when it was built from this model and these photos prepared this way; else built now
    and saved."""
    people = gallery_people(args.gallery)
    model_stamp, photos_stamp, prepared = model_digest(saved), photos_digest(people), preparation_stamp(preparation)
    path = gallery_file(args.gallery)
    if path.exists() and not args.rebuild:
        gallery = load_gallery(path)
        if (gallery.model, gallery.photos, gallery.preparation) == (model_stamp, photos_stamp, prepared) \
                and gallery.nonmated is not None:
            print(f"gallery: {len(gallery.names)} people from {path}", file=sys.stderr)
            return gallery
        was = f", was {gallery.preparation}" if gallery.preparation else ""
        changed = " and ".join(what for what, same in [
            ("the model", gallery.model == model_stamp), ("the photos", gallery.photos == photos_stamp),
            (f"the photos' preparation (now {prepared}{was})", gallery.preparation == prepared)] if not same)
        why = (f"{changed} changed since {path} was built" if changed else
               f"{path} predates the gallery's own stranger scores, which set the search threshold")
        print(f"gallery: {why}; building it again", file=sys.stderr)
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"the gallery file {path} goes beside --gallery {args.gallery}, but folder {path.parent} is "
                          "not writable; copy the gallery to a folder you can write to")
    start = time.perf_counter()
    gallery, said = build_gallery(model, people, preparation, model_stamp, photos_stamp, args.batch_size,
                                  sys.stderr, args.skip_bad)
    save_gallery(gallery, path)
    for line in said:
        print(line, file=sys.stderr)
    photos = sum(len(photos) for _, photos in people) - len(gallery.skipped)
    left_out = f", {len(gallery.skipped)} left out by --skip-bad" if gallery.skipped else ""
    print(f"gallery: {len(gallery.names)} people ({photos} photos{left_out}) embedded in "
          f"{time.perf_counter() - start:.1f} s, saved to {path}", file=sys.stderr)
    return gallery


def search_threshold(gallery: PersonGallery, fpir: float) -> tuple[float | None, str]:
    """The threshold set on the gallery's own stranger scores at ``fpir``, or at the lowest rate the gallery can
    place when ``fpir`` is below it (None when the gallery cannot set one), and the line that says what it means,
    or why there is none."""
    scores = gallery.nonmated
    if scores is None or scores.size == 0:
        return None, "search threshold: none: a gallery of one person has no other people to set it on"
    placeable = int(scores.size * fpir) >= 2  # threshold_at_fpir's placement: the rate's k-th score, k >= 2
    # Unplaceable: the second highest score, where the lowest rate that can be placed, 2/n, puts it.
    threshold = threshold_at_fpir(scores, fpir) if placeable else float(np.sort(scores)[-2])
    passed = int((scores > threshold).sum())
    counted = (f"of the gallery's {scores.size} photos, each searched among the other people only, {passed} passed "
               "it")
    if not placeable:
        return threshold, (f"search threshold {threshold:.4f}: set at {2 / scores.size:.3g} of the faces not in the "
                           f"gallery, the lowest rate its {scores.size} photos can place: --fpir {fpir:g} needs "
                           f"{math.ceil(2 / fpir)} photos or more (add photos, or decide by --threshold SIMILARITY); "
                           f"{counted}")
    return threshold, (f"search threshold {threshold:.4f}: set so that about {fpir:g} of the faces not in the gallery "
                       f"pass it (--fpir): {counted}")


def pair_threshold(saved: SavedBackbone, threshold_set: str | None) -> tuple[float | None, str]:
    """The pair threshold of the deciding recorded set (None when none is recorded) and the line that says it,
    or that there is none."""
    if not saved.verification:
        return None, (f"pair threshold: none: {saved.info_path} records no verification (python -m eval.verification "
                      f"--model {saved.weights.parent} --bins YOUR_SET.bin records one)")
    name, why = deciding_set(saved.verification, threshold_set, saved.info_path, saved.threshold_set)
    point = saved.verification[name]
    caution = "".join(f"\n{line}" for line in [weak_threshold_caution(name, point)] if line)
    return point["threshold"], (f"pair threshold {point['threshold']:.4f} of {name} ({far_words(point)} on "
                                f"{point['pairs']} pairs; {point['by']}): {why}{caution}")


def deciding_threshold(gallery: PersonGallery, saved: SavedBackbone, args: argparse.Namespace
                       ) -> tuple[float | None, list[str]]:
    """The similarity a known person's best match must pass (--threshold, else the higher of the search and the
    pair threshold; None when there is none), and the lines that say so."""
    found = [search_threshold(gallery, args.fpir), pair_threshold(saved, args.threshold_set)]
    lines = [line for _, line in found]
    if args.threshold is not None:
        return args.threshold, [*lines, f"known person: a best similarity above {args.threshold:.4f} (--threshold, in "
                                        "place of those); below it, unknown"]
    thresholds = [threshold for threshold, _ in found if threshold is not None]
    if not thresholds:
        return None, [*lines, "known person: no threshold to decide by; the list above says who is most similar "
                              "(pass --threshold SIMILARITY to decide by one)"]
    threshold = max(thresholds)
    which = "the one threshold there is" if len(thresholds) == 1 else "the higher of the two"
    return threshold, [*lines, f"known person: a best similarity above {threshold:.4f} ({which}); below it, unknown"]


def verdict(name: str, similarity: float, threshold: float | None) -> str | None:
    if threshold is None:
        return None
    if similarity > threshold:
        return f"known person {name} ({similarity:.4f} > {threshold:.4f})"
    return f"unknown: not in the gallery (the most similar, {name}, scores {similarity:.4f}, not above {threshold:.4f})"


def report(queries: list[Path], embeddings: np.ndarray, gallery: PersonGallery, top: int,
           threshold: float | None) -> None:
    indices, scores = top_matches(gallery.features, embeddings, top)
    for query, best, similarities in zip(queries, indices, scores):
        print(f"{query}:")
        width = max(len(gallery.names[i]) for i in best)
        for rank, (i, similarity) in enumerate(zip(best, similarities), 1):
            print(f"  {rank}. {gallery.names[i]:<{width}}  {similarity:.4f}")
        if said := verdict(gallery.names[best[0]], float(similarities[0]), threshold):
            print(f"  {said}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    with exit_on_user_error():
        for value, option in [(args.top, "--top"), (args.batch_size, "--batch-size")]:
            if value < 1:
                raise ConfigError(f"{option} {value} is not a positive number; pass {option} 1 or more")
        if not 0 < args.fpir < 1:
            raise ConfigError(f"--fpir {args.fpir} is not a rate between 0 and 1; pass e.g. --fpir 0.01")
        if args.threshold is not None and not -1 <= args.threshold <= 1:
            raise ConfigError(f"--threshold {args.threshold} is not a cosine similarity (-1 to 1); pass e.g. "
                              "--threshold 0.4")
        model, saved = load_backbone_from_args(args)
        if args.threshold_set is not None:  # a misspelt name is said before any work
            deciding_set(saved.verification, args.threshold_set, saved.info_path)
        recorded, where = saved.photo_preparation, str(saved.info_path)
        # Queries are read before the gallery: a photo that cannot be read is reported before a long build.
        query_preparation, said = preparation_following(args, recorded, where)
        if said:
            print(said, file=sys.stderr)
        skipped: list[str] | None = [] if args.skip_bad else None
        prepared = [(path, prepare_or_skip(query_preparation, path, skipped)) for path in args.queries]
        queries = [path for path, face in prepared if face is not None]
        if not queries:
            print(skipped_line(skipped or []), file=sys.stderr)
            raise DataError(f"--skip-bad left out every one of the {len(args.queries)} queries (named above); give "
                            "photos that can be read")
        faces = [face_tensor(face) for _, face in prepared if face is not None]
        if warning := stretch_warning([(str(path), size) for path, (_, size) in zip(queries, faces) if size],
                                      len(faces)):
            print(warning, file=sys.stderr)
        if note := several_faces_line([(str(path), face.faces_found) for path, face in prepared
                                       if face and face.crowded], len(faces)):
            print(note, file=sys.stderr)
        images = torch.stack([image for image, _ in faces])
        gallery = current_gallery(args, model, saved, preparation_following(args, recorded, where, args.gallery)[0])
        threshold, said = deciding_threshold(gallery, saved, args)
        print("\n".join(said))
        report(queries, flip_fused_embeddings(model, images).numpy(), gallery, args.top, threshold)
    if said := skipped_line([*gallery.skipped, *(skipped or [])]):  # last: every photo left out, named once
        print(said, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
