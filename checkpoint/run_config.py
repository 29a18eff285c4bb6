"""A run folder's `config.json`: the config file and the `--set` overrides the run was started (or last
resumed) with, so that `--resume` keeps what was said without it being said again."""
from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from checkpoint.pointer import POINTER_NAME
from checkpoint.run_dir import AUTO
from utils.atomic import atomic_save, write_bytes
from utils.config import override_key
from utils.errors import ConfigError
from utils.launcher import launch_words

RUN_CONFIG_NAME = "config.json"
# Keys that say where a run is, not how it trains: never carried over from an earlier start.
WHERE_KEYS = ("output", "resume")


def resumed_overrides(output: str, resume: bool | str, said_now: Sequence[str]) -> list[str]:
    """The `--set` overrides (KEY=VALUE) a resumed run was started or last resumed with (its config.json)
    whose keys `said_now` does not set again: applied before those, they keep what was said. [] when the
    run has none (a bare backbone, arcface_torch's folder, an earlier version's run)."""
    location = Path(output if resume in (True, AUTO) else resume)
    if location.is_file() and location.name != POINTER_NAME:  # weights to start from, not a run to continue
        return []
    path = (location.parent if location.is_file() else location) / RUN_CONFIG_NAME
    if not path.is_file():
        return []
    try:
        overrides = json.loads(path.read_text())["set"]
        if not all(isinstance(item, str) for item in overrides):
            raise TypeError("'set' is not a list of KEY=VALUE strings")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"cannot read {path} ({type(error).__name__}: {error}), which keeps the --set overrides "
                          "the run was started with; remove it and give them again with --set") from None
    said = {override_key(item) for item in said_now}
    return [item for item in overrides if override_key(item) not in said]


def kept_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides a later resume keeps: the last one of each key, where-keys left out."""
    last = {override_key(item): item for item in overrides}
    return [item for key, item in last.items() if key not in WHERE_KEYS]


@dataclass(frozen=True)
class ResumeCommand:
    """The command line that continues a run: its launcher, `script` and config file, every `--set` given
    (the last of each key; `output` included, since --resume looks the run up there), then `--resume`."""

    script: str
    config_file: str
    overrides: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.with_sets()

    def with_sets(self, *extra: str) -> str:
        """The command with `extra` KEY=VALUE overrides too (each replacing a --set of its key)."""
        last = {override_key(item): item for item in (*self.overrides, *extra)}
        sets = [f"--set {shlex.quote(item)}" for key, item in last.items() if key != "resume"]
        return " ".join([launch_words(), shlex.quote(self.script), shlex.quote(self.config_file), *sets, "--resume"])


def write_run_config(output: str, config_file: str, overrides: Sequence[str]) -> None:
    """Rank 0, once a checkpoint of this start is published (a failed save leaves the old config.json as it
    was): config.json, written only when it says something new."""
    content = json.dumps({"config_file": str(config_file), "set": kept_overrides(overrides)}, indent=2).encode()
    path = Path(output) / RUN_CONFIG_NAME
    if not path.is_file() or path.read_bytes() != content:
        atomic_save(content, path, write=write_bytes)
