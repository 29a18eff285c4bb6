"""The one way pairface reads a .pt/.pth file: torch's weights-only unpickler (plain containers, numbers
and tensors; nothing in the file can run code), and one line for whatever makes a file unreadable."""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from utils.errors import UserError


def load_torch_file(path: str | os.PathLike, unreadable: Callable[[str], UserError], mmap: bool = False):
    """The object torch.save wrote to `path`, its tensors on the CPU (memory-mapped with `mmap`: only the
    pickled structure is read until a tensor is touched). Any failure (missing, truncated, not a torch
    file, a pickle that names code) raises `unreadable(reason)`, reason being torch's first sentence."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # torch raises many types for a foreign, truncated or hostile file
        # torch's own text runs to paragraphs (e.g. on weights_only); its first sentence says what failed.
        text = str(error).splitlines()[0].split(". ")[0] if str(error) else ""
        raise unreadable(text or type(error).__name__) from None
