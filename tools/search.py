"""Search face photos in a gallery of known people: who is this, or nobody we know?

    python -m tools.search --model output/my_faces --gallery photos/ query.jpg
    python -m tools.search --model output/my_faces --gallery photos/ a.jpg b.jpg --top 3 --crop

The gallery is a folder with one sub-folder of photos per person (named after them). The first search
embeds every photo and keeps each person's template (their photos' embeddings averaged) in a file beside
the folder, ``photos.gallery.npz``; later searches reuse it while the model and the photos are unchanged
(by each file's size and modification time) and the photos' preparation are unchanged, and build it
again, saying which of them changed, when one did (--rebuild forces it). Photos, gallery and queries
alike, are prepared as every tool prepares them (--resize, --crop, --pad or --landmarks): by default as
the training photos were (model.json records the option tools.pack_rec packed them with; --resize when
it records none), as tools.inference does; a landmarks file names gallery photos relative to the gallery
folder and queries as given here.

For each query: the --top most similar people with their cosine similarity, then a verdict per
threshold recorded in the model's model.json (by training or eval.verification, see tools.inference):
"known person NAME" when the best similarity is above it, else "not in the gallery".
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from backbones import flip_fused_embeddings, prepared_face
from backbones.trained import SavedBackbone, add_backbone_arguments, far_words, load_backbone_from_args
from dataset import Preparation, add_preparation_arguments, preparation_following, stretch_warning
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
from utils.cli import exit_on_user_error
from utils.errors import ConfigError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queries", nargs="+", type=Path, metavar="QUERY", help="face photos to search for")
    add_backbone_arguments(parser)
    parser.add_argument("--gallery", required=True, type=Path,
                        help="folder with one sub-folder of photos per person")
    parser.add_argument("--top", type=int, default=5, help="how many of the most similar people to list")
    parser.add_argument("--batch-size", type=int, default=64, help="gallery photos per forward pass")
    parser.add_argument("--rebuild", action="store_true", help="build the gallery file again even if it is current")
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
        if (gallery.model, gallery.photos, gallery.preparation) == (model_stamp, photos_stamp, prepared):
            print(f"gallery: {len(gallery.names)} people from {path}", file=sys.stderr)
            return gallery
        was = f", was {gallery.preparation}" if gallery.preparation else ""
        changed = " and ".join(what for what, same in [
            ("the model", gallery.model == model_stamp), ("the photos", gallery.photos == photos_stamp),
            (f"the photos' preparation (now {prepared}{was})", gallery.preparation == prepared)] if not same)
        print(f"gallery: {changed} changed since {path} was built; building it again", file=sys.stderr)
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"the gallery file {path} goes beside --gallery {args.gallery}, but folder {path.parent} is "
                          "not writable; copy the gallery to a folder you can write to")
    start = time.perf_counter()
    gallery, stretched = build_gallery(model, people, preparation, model_stamp, photos_stamp, args.batch_size,
                                       sys.stderr)
    save_gallery(gallery, path)
    if stretched:
        print(stretched, file=sys.stderr)
    photos = sum(len(photos) for _, photos in people)
    print(f"gallery: {len(people)} people ({photos} photos) embedded in {time.perf_counter() - start:.1f} s, "
          f"saved to {path}", file=sys.stderr)
    return gallery


def verdicts(name: str, similarity: float, saved: SavedBackbone) -> list[str]:
    """One line per threshold recorded with the model: the best match is that person, or nobody known."""
    if not saved.verification:
        return [f"no threshold is known for {saved.weights}: its model.json records no verification; run "
                f"python -m eval.verification --model {saved.weights.parent} --bins YOUR_SET.bin to record one"]
    lines = []
    for set_name, point in saved.verification.items():
        verdict = f"known person {name}" if similarity > point["threshold"] else "not in the gallery"
        lines.append(f"{verdict} at threshold {point['threshold']:.4f} ({far_words(point)} on {set_name}, "
                     f"{point['pairs']} pairs; {point['by']})")
    return lines


def report(queries: list[Path], embeddings: np.ndarray, gallery: PersonGallery, top: int,
           saved: SavedBackbone) -> None:
    indices, scores = top_matches(gallery.features, embeddings, top)
    for query, best, similarities in zip(queries, indices, scores):
        print(f"{query}:")
        width = max(len(gallery.names[i]) for i in best)
        for rank, (i, similarity) in enumerate(zip(best, similarities), 1):
            print(f"  {rank}. {gallery.names[i]:<{width}}  {similarity:.4f}")
        for line in verdicts(gallery.names[best[0]], float(similarities[0]), saved):
            print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    with exit_on_user_error():
        for value, option in [(args.top, "--top"), (args.batch_size, "--batch-size")]:
            if value < 1:
                raise ConfigError(f"{option} {value} is not a positive number; pass {option} 1 or more")
        model, saved = load_backbone_from_args(args)
        recorded, where = saved.photo_preparation, str(saved.info_path)
        # Queries are read before the gallery: a photo that cannot be read is reported before a long build.
        query_preparation, said = preparation_following(args, recorded, where)
        if said:
            print(said, file=sys.stderr)
        faces = [prepared_face(path, query_preparation) for path in args.queries]
        if warning := stretch_warning([(str(path), size) for path, (_, size) in zip(args.queries, faces) if size],
                                      len(faces)):
            print(warning, file=sys.stderr)
        images = torch.stack([image for image, _ in faces])
        gallery = current_gallery(args, model, saved, preparation_following(args, recorded, where, args.gallery)[0])
        report(args.queries, flip_fused_embeddings(model, images).numpy(), gallery, args.top, saved)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
