"""Embed one aligned face image, or compare two.

    python -m tools.inference --model output/run face.jpg
    python -m tools.inference --model output/run face.jpg --save face.npy
    python -m tools.inference --model backbone.pth --network r50 a.jpg b.jpg
    python -m tools.inference a.jpg --model backbone.pth --network r18 --network-kw width_mult=0.25

(--network-kw takes every value up to the next option, so images go before it.)

Images are aligned face crops (square; resized to 112x112 if another size), read as RGB. One image:
its L2-normalised embedding is printed, or saved as a float32 .npy of shape (num_features,). Two
images: their cosine similarity is printed (and --save writes both embeddings, shape (2, num_features)).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from backbones import read_face_image, unit_embeddings
from backbones.trained import add_backbone_arguments, load_backbone_from_args
from utils.cli import exit_on_user_error
from utils.errors import ConfigError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", type=Path, help="one or two aligned face images")
    add_backbone_arguments(parser)
    parser.add_argument("--save", type=Path, help="write the embedding(s) to this .npy file")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if len(args.images) > 2:
        raise ConfigError(f"{len(args.images)} images given; give one image (embedding) or two (similarity)")
    if args.save and not args.save.parent.is_dir():
        raise ConfigError(f"--save {args.save} is in a folder that does not exist; create {args.save.parent} "
                          "first or choose another path")


def report(embeddings: np.ndarray, save: Path | None) -> None:
    """Save and/or print what the user asked for: the embedding, or the pair's similarity."""
    if save:
        saved = embeddings[0] if len(embeddings) == 1 else embeddings
        np.save(save, saved)
        print(f"saved {'embedding' if len(embeddings) == 1 else 'embeddings'} {saved.shape} to {save}")
    if len(embeddings) == 2:
        print(f"cosine similarity: {float(embeddings[0] @ embeddings[1]):.6f}")
    elif not save:
        np.set_printoptions(threshold=sys.maxsize, precision=6, suppress=True)
        print(embeddings[0])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    with exit_on_user_error():
        check_args(args)
        images = torch.stack([read_face_image(path) for path in args.images])
        model, _ = load_backbone_from_args(args)
        report(unit_embeddings(model, images).numpy(), args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
