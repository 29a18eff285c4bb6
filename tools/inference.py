"""Embed one aligned face image, or compare two.

    python -m tools.inference --network r50 --weights output/backbone.pth face.jpg
    python -m tools.inference --network r50 --weights output/backbone.pth face.jpg --save face.npy
    python -m tools.inference --network r50 --weights output/backbone.pth a.jpg b.jpg

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

from backbones import NETWORKS, embed, load_backbone, read_face_image


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", type=Path, help="one or two aligned face images")
    parser.add_argument("--network", required=True, choices=NETWORKS, help="backbone the weights belong to")
    parser.add_argument("--weights", required=True, type=Path, help="backbone.pth written by training")
    parser.add_argument("--width-mult", type=float, default=1.0, help="width the weights were trained with")
    parser.add_argument("--num-features", type=int, default=512, help="embedding size (config embedding_size)")
    parser.add_argument("--save", type=Path, help="write the embedding(s) to this .npy file")
    args = parser.parse_args(argv)
    if len(args.images) > 2:
        parser.error(f"give one image (embedding) or two (similarity), not {len(args.images)}")
    if args.save and not args.save.parent.is_dir():
        parser.error(f"--save {args.save}: folder {args.save.parent} does not exist")
    return args


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
    try:
        images = torch.stack([read_face_image(path) for path in args.images])
        model = load_backbone(args.network, args.weights, width_mult=args.width_mult,
                              num_features=args.num_features)
        report(embed(model, images).numpy(), args.save)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
