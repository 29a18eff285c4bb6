"""What the evaluation command lines share: the model arguments, loading, output paths, error exits."""
from __future__ import annotations

import argparse
import ast
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence

import torch
from torch import nn


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--network", required=True, help="backbone name, e.g. r50 (as in the training config)")
    parser.add_argument("--weights", required=True, help="backbone.pth written by training; results go next to it")
    parser.add_argument("--network-kw", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra get_model options the weights were trained with, e.g. width_mult=0.25 "
                             "num_features=256")


def parse_network_kw(items: Sequence[str]) -> dict[str, object]:
    """``["width_mult=0.25", "fp16=False"]`` -> ``{"width_mult": 0.25, "fp16": False}``."""
    options: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--network-kw {item!r} is not KEY=VALUE; write e.g. --network-kw width_mult=0.25")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text  # a bare word such as a name
    return options


def build_backbone(args: argparse.Namespace) -> nn.Module:
    """The backbone named by ``--network`` with ``--weights`` loaded, on the GPU when there is one."""
    from backbones import load_backbone

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = parse_network_kw(args.network_kw)
    try:
        return load_backbone(args.network, args.weights, device, **options)
    except TypeError as error:  # get_model's unknown-option error: the user's --network-kw
        raise ValueError(f"--network-kw: {error}") from None


def output_prefix(weights: str) -> str:
    """Results of ``output/backbone.pth`` are written as ``output/backbone_<what>``."""
    return os.path.splitext(weights)[0]


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """A bad path, file or option ends the command with its one-sentence message and exit status 1."""
    try:
        yield
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
