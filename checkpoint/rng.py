"""This process's random streams (Python, numpy, torch CPU and CUDA), saved and put back for an exact resume."""
from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch


def rng_state() -> dict:
    """This process's random generators."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping) -> None:
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, (list, tuple)) and torch.is_tensor(numpy_state[0]):  # checkpoint.pt's encoding
        keys, position, has_gauss, cached_gauss = numpy_state
        numpy_state = ("MT19937", keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss)
    np.random.set_state(numpy_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
