"""This process's random streams (Python, numpy, torch CPU and CUDA), saved and put back for an exact resume.

Saved as plain JSON numbers (the torch states are byte tensors, stored as their bytes' values): a
checkpoint's random streams never go through an unpickler.
"""
from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch


def rng_state() -> dict:
    """This process's random generators, as JSON-ready lists and numbers."""
    version, internal, gauss = random.getstate()
    _, keys, position, has_gauss, cached_gauss = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().tolist(),
             "numpy": [keys.tolist(), int(position), int(has_gauss), float(cached_gauss)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: Mapping) -> None:
    """Put back what rng_state() saved (or checkpoint.pt's encoding: tuples and tensors)."""
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    keys, position, has_gauss, cached_gauss = state["numpy"][-4:]  # checkpoint.pt's starts with "MT19937"
    keys = keys.numpy() if torch.is_tensor(keys) else np.asarray(keys)
    np.random.set_state(("MT19937", keys.astype(np.uint32), int(position), int(has_gauss), float(cached_gauss)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_byte_tensor(state["cuda"]))


def _byte_tensor(value) -> torch.Tensor:
    return value if torch.is_tensor(value) else torch.tensor(value, dtype=torch.uint8)


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
