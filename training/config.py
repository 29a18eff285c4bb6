"""The run's configuration: utils.config's loading, with the keys and checks the margin families declare.

utils.config, on the ground floor, cannot import the families; everything that loads a config to run it loads
it through here, so that a family's own keys exist and are checked wherever a config is read.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from types import SimpleNamespace

from margin_families import declared
from utils import config


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> SimpleNamespace:
    """configs/base.py, the file `path`, then each `key=value` override, checked (utils.config.load_config), with
    every registered margin family's keys and the chosen family's checks."""
    return config.load_config(path, overrides, declared())
