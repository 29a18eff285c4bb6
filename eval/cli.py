"""What the evaluation command lines share: which model to run (trained weights or an ONNX file),
the option checks, and where results go."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backbones.trained import SavedBackbone, add_backbone_arguments, load_backbone_from_args
from utils.errors import ConfigError


@dataclass(frozen=True)
class EvaluatedNetwork:
    """The network to run, the file its results are written next to, and its name in tables and plots."""

    module: nn.Module
    path: Path
    name: str
    saved: SavedBackbone | None = None  # PyTorch weights: the file and what model.json says of it


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model PATH`` (``--weights``) with ``--network``/``--network-kw``, or ``--onnx FILE``."""
    source = parser.add_mutually_exclusive_group(required=True)
    # --onnx first: argparse shows a group as (--onnx | --model) only when its options are adjacent.
    source.add_argument("--onnx", type=Path, metavar="FILE",
                        help="an ONNX face model instead of --model, e.g. insightface's released ones (input: "
                             "batch x 3 x 112 x 112 RGB in [-1, 1]); run by onnxruntime on the CPU")
    add_backbone_arguments(parser, source)


def open_network(args: argparse.Namespace, device: torch.device | None = None) -> EvaluatedNetwork:
    """The model the arguments name; PyTorch weights go to `device` (default: the GPU when there is one)."""
    if args.onnx is not None:
        if args.network is not None or args.network_kw:
            raise ConfigError("--network and --network-kw describe PyTorch weights, not an --onnx model; drop them")
        from eval.onnx_model import OnnxBackbone  # noqa: PLC0415 (onnx and onnxruntime: a second to import)

        return EvaluatedNetwork(OnnxBackbone(args.onnx), args.onnx, args.onnx.stem)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    module, trained = load_backbone_from_args(args, device)
    return EvaluatedNetwork(module, trained.weights, trained.network, trained)


def check_positive(value: int, option: str) -> None:
    if value < 1:
        raise ConfigError(f"{option} {value} is not a positive number; pass {option} 1 or more")


def output_prefix(path: Path) -> str:
    """Results of ``output/backbone.pth`` are written as ``output/backbone_<what>``.

    Checked before any work: a released model often sits in a folder the user cannot write to.
    """
    folder = path.parent
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"results go next to {path}, but folder {folder} is not writable; copy the model "
                          "to a folder you can write to")
    return os.path.splitext(path)[0]
