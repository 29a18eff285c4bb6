"""Run a backbone over uint8 face crops in batches (the one embedding loop evaluation uses)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TextIO

import numpy as np
import torch
from torch import nn

from utils.errors import ConfigError
from utils.image import normalize
from utils.progress import progress


def unwrap(backbone: nn.Module) -> nn.Module:
    """The plain backbone inside a DistributedDataParallel / DataParallel wrapper (or itself).

    Evaluation runs on one rank only, so it must not go through the wrapper's collectives.
    """
    while isinstance(backbone, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        backbone = backbone.module
    return backbone


def model_device(backbone: nn.Module) -> torch.device:
    parameter = next(backbone.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


@contextlib.contextmanager
def eval_mode(backbone: nn.Module) -> Iterator[nn.Module]:
    """Eval mode and no autograd inside; afterwards every submodule's own train/eval flag is back.

    Restoring per submodule (rather than ``train()``) keeps deliberately frozen layers frozen.
    """
    modes = [(module, module.training) for module in backbone.modules()]
    backbone.eval()
    try:
        with torch.no_grad():
            yield backbone
    finally:
        for module, training in modes:
            module.training = training


@torch.no_grad()
def embed_batches(backbone: nn.Module, batches: Iterable[torch.Tensor]) -> np.ndarray:
    """Concatenated float64 embeddings of uint8 batches ``(B, 3, H, W)`` (the caller sets the mode)."""
    device = model_device(backbone)
    outputs = [backbone(normalize(batch.to(device, non_blocking=True))).float().cpu().numpy()
               for batch in batches]
    return np.concatenate(outputs).astype(np.float64)


def embed_images(backbone: nn.Module, images: torch.Tensor, batch_size: int, stream: TextIO | None = None,
          description: str = "embedding") -> np.ndarray:
    """Embeddings ``(N, D)`` of uint8 images ``(N, 3, H, W)``, ``batch_size`` at a time.

    Runs in eval mode and restores the backbone's modes. The last batch is simply shorter, so a
    set smaller than one batch works. ``stream``: where a command line shows the progress.
    """
    if batch_size < 1:
        raise ConfigError(f"batch size {batch_size} is not a positive number; pass a batch size of 1 or more")
    batches = images.split(batch_size)
    with eval_mode(unwrap(backbone)) as model:
        return embed_batches(model, progress(batches, len(batches), description, stream))
