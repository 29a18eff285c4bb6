"""Embed one face photo, or compare two and say whether they show the same person.

    python -m tools.inference --model output/run face.jpg
    python -m tools.inference --model output/run face.jpg --save face.npy
    python -m tools.inference a.jpg b.jpg --model output/run --crop
    python -m tools.inference a.jpg --model backbone.pth --network r18 --network-kw width_mult=0.25
    python -m tools.inference a.jpg b.jpg --onnx w600k_r50.onnx

(--network-kw takes every value up to the next option, so images go before it.)

Photos are prepared as every tool prepares them (--resize, --crop, --pad, --landmarks or --detect). By default, as
the training photos were (model.json records the option tools.pack_rec packed them with; --resize when it
records none); an option that differs from the recorded one is used, with a warning naming both. Each
embedding is the photo's and its mirror image's summed and L2-normalised, as verification scores them. One
photo: its embedding is printed, or saved as a float32 .npy of shape (num_features,). Two photos: their
cosine similarity, the verdict at the threshold of every verification set recorded in model.json (by training
or eval.verification: the similarity above which a pair is the same person, and the false-accept rate it gave
on that set), and the one verdict that decides: by the set --threshold-set names, by default the set model.json
names (threshold_set: the first set eval.verification recorded, unless its --threshold-set named another; a set
evaluated later does not change it), else the largest (by pairs) of the recorded sets whose people were kept
out of training, else the largest not known to hold training people, else the largest recorded
(eval.verification and tools.search choose it the same way); a caution line when that threshold lets more than
a tenth of its set's different-person pairs pass; --save writes both embeddings, shape (2, num_features).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from backbones import flip_fused_embeddings, read_face_image
from backbones.trained import add_threshold_set_argument, deciding_set, far_words, weak_threshold_caution
from dataset import add_preparation_arguments, preparation_following
from eval.cli import EvaluatedNetwork, add_network_arguments, open_network
from utils.cli import exit_on_user_error
from utils.errors import ConfigError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="+", type=Path, help="one or two face photos")
    add_network_arguments(parser)
    parser.add_argument("--save", type=Path, help="write the embedding(s) to this .npy file")
    add_threshold_set_argument(parser)
    add_preparation_arguments(parser, "the photo's path as given here", "the model's model.json")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if len(args.images) > 2:
        raise ConfigError(f"{len(args.images)} images given; give one image (embedding) or two (similarity)")
    if args.save and not args.save.parent.is_dir():
        raise ConfigError(f"--save {args.save} is in a folder that does not exist; create {args.save.parent} "
                          "first or choose another path")


def verdicts(similarity: float, network: EvaluatedNetwork, threshold_set: str | None) -> list[str]:
    """One line per verification set recorded with the model: same person or not at its threshold; with more
    than one set (or one named by --threshold-set), a last line naming the set the verdict goes by, and why."""
    saved = network.saved
    if saved is None:
        return [f"no threshold is known for {network.path}: an ONNX model records no verification; judge the "
                "similarity by a threshold of your own, or pass the run folder with --model"]
    if not saved.verification:
        return [f"no threshold is known for {saved.weights}: its model.json records no verification; run "
                f"python -m eval.verification --model {saved.weights.parent} --bins YOUR_SET.bin to record one"]
    lines, said = [], {}
    for name, point in saved.verification.items():
        said[name] = "same person" if similarity > point["threshold"] else "different people"
        lines.append(f"{said[name]} at threshold {point['threshold']:.4f} ({far_words(point)} on {name}, "
                     f"{point['pairs']} pairs; {point['by']})")
    name, why = deciding_set(saved.verification, threshold_set, saved.info_path, saved.threshold_set)
    if len(lines) > 1 or threshold_set is not None:
        lines.append(f"verdict: {said[name]}, by the threshold of {name} ({why})")
    caution = weak_threshold_caution(name, saved.verification[name])
    return lines + ([caution] if caution else [])


def report(embeddings: np.ndarray, save: Path | None, network: EvaluatedNetwork, threshold_set: str | None) -> None:
    """Save and/or print what the user asked for: the embedding, or the pair's similarity and verdict."""
    if save:
        saved_array = embeddings[0] if len(embeddings) == 1 else embeddings
        np.save(save, saved_array)
        print(f"saved {'embedding' if len(embeddings) == 1 else 'embeddings'} {saved_array.shape} to {save}")
    if len(embeddings) == 2:
        similarity = float(embeddings[0] @ embeddings[1])
        print(f"cosine similarity: {similarity:.6f}")
        print("\n".join(verdicts(similarity, network, threshold_set)))
    elif not save:
        np.set_printoptions(threshold=sys.maxsize, precision=6, suppress=True)
        print(embeddings[0])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    with exit_on_user_error():
        check_args(args)
        network = open_network(args, torch.device("cpu"))
        saved = network.saved
        if args.threshold_set is not None and saved is not None:  # a misspelt name is said before any work
            deciding_set(saved.verification, args.threshold_set, saved.info_path)
        recorded = None if saved is None else saved.photo_preparation
        preparation, said = preparation_following(args, recorded, None if saved is None else str(saved.info_path))
        if said:
            print(said, file=sys.stderr if said.startswith("warning") else sys.stdout)
        images = torch.stack([read_face_image(path, preparation) for path in args.images])
        report(flip_fused_embeddings(network.module, images).numpy(), args.save, network, args.threshold_set)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
