"""Export a trained backbone to ONNX and check the export with onnxruntime.

    python -m tools.export_onnx --model output/run                      # -> output/run/model.onnx
    python -m tools.export_onnx --model backbone.pth --network r18 --network-kw width_mult=0.25 --output r18.onnx

The model takes ``data``: float32 (batch, 3, 112, 112) RGB in [-1, 1] (any batch size) and returns
``embedding``: float32 (batch, num_features), not yet L2-normalised (as arcface_torch's export).
After writing the file, it runs onnxruntime and PyTorch on the same random batch and prints the
largest absolute difference.
"""
from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from backbones.trained import add_backbone_arguments, load_backbone_from_args
from utils.cli import exit_on_user_error
from utils.compat import export_onnx_file
from utils.errors import ConfigError

INPUT_NAME = "data"
OUTPUT_NAME = "embedding"
OPSET = 18


def export_onnx(model: nn.Module, path: Path) -> None:
    """Write ``model`` (eval mode, float32, CPU) to ``path`` with a dynamic batch dimension."""
    example = torch.zeros(2, 3, 112, 112)
    # Written next to the target and renamed, so an interrupted export never leaves a truncated file.
    partial = path.with_name(path.name + ".partial")
    with warnings.catch_warnings():
        # The exporter warns about its own internals (e.g. opset conversions), nothing a user can act on.
        warnings.simplefilter("ignore")
        export_onnx_file(model, example, str(partial), INPUT_NAME, OUTPUT_NAME, OPSET)
    os.replace(partial, path)


def onnxruntime_difference(model: nn.Module, path: Path, batch: int, seed: int = 0) -> tuple[float, float, int]:
    """(largest |onnxruntime - PyTorch|, largest |PyTorch|, embedding size) over one random batch in [-1, 1]."""
    import onnxruntime  # noqa: PLC0415 (a second to import; only the check after the export needs it)

    images = torch.rand(batch, 3, 112, 112, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    exported = session.run([OUTPUT_NAME], {INPUT_NAME: images.numpy()})[0]
    with torch.no_grad():
        reference = model(images).numpy()
    return float(np.abs(exported - reference).max()), float(np.abs(reference).max()), exported.shape[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_backbone_arguments(parser)
    parser.add_argument("--output", type=Path, help="ONNX file to write (default: model.onnx next to the weights)")
    parser.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    parser.add_argument("--check-batch", type=int, default=3,
                        help="random images for the onnxruntime check (not the export's batch: shows it is dynamic)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_on_user_error():
        if args.check_batch < 1:
            raise ConfigError(f"--check-batch {args.check_batch} is not a positive number; pass 1 or more")
        if args.output and not args.output.parent.is_dir():
            raise ConfigError(f"--output {args.output} is in a folder that does not exist; create "
                              f"{args.output.parent} first or choose another path")
        model, trained = load_backbone_from_args(args)
        output = args.output or trained.weights.parent / "model.onnx"
        if output.exists() and not args.force:
            raise ConfigError(f"{output} already exists; pass --force to overwrite it or --output another path")
        export_onnx(model, output)
        difference, scale, embedding_size = onnxruntime_difference(model, output, args.check_batch)
    print(f"wrote {output} from {trained.describe()}: input '{INPUT_NAME}' (batch, 3, 112, 112) float32 in [-1, 1], "
          f"output '{OUTPUT_NAME}' (batch, {embedding_size})")
    print(f"onnxruntime vs PyTorch on {args.check_batch} random images: max abs difference "
          f"{difference:.3g} (largest output magnitude {scale:.3g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
