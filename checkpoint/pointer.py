"""Which checkpoint folder of a run folder is the checkpoint: `checkpoint.json`, and the folder names.

- `checkpoint-<step>/` (`checkpoint-<step>-<n>/` when a renumbered resume saves again at a step whose
  folder exists): a complete checkpoint, its `manifest.json` written last;
- `.tmp-checkpoint-<step>/`: a save being written, renamed to its final name once complete;
- `checkpoint.json`: `{"format", "directory", "global_step", "world_size", "model"}` with a checksum of
  itself, naming the published folder. `directory` is always the name of a child of the run folder.

`<step>` and `global_step` are the shown step, the one the log and TensorBoard count (it goes on counting
across a resume that renumbers the LR schedule's step); state.json's progress holds the schedule's.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from checkpoint.manifest import MANIFEST_NAME, IntegrityError, checked_json, read_checked_json
from utils.atomic import atomic_save, write_bytes
from utils.errors import CheckpointError

FORMAT = "pairface-checkpoint-3"
EARLIER_FORMAT = "pairface-checkpoint-2"  # DCP folders with pickled run state: refused
POINTER_NAME = "checkpoint.json"
FOLDER_PREFIX = "checkpoint-"
TMP_FOLDER_PREFIX = ".tmp-checkpoint-"
FOLDER_NAME = re.compile(r"checkpoint-(\d{9})(?:-(\d+))?")
_POINTER_FIELDS = {"format": str, "directory": str, "global_step": int, "world_size": int, "model": dict}


def folder_step(name: str) -> int | None:
    """The step of a checkpoint folder's name, None for any other name."""
    match = FOLDER_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def free_folder_name(output: Path, step: int) -> str:
    """`checkpoint-<step>`, or `checkpoint-<step>-<n>` if that name is taken (never over a folder)."""
    name, n = f"{FOLDER_PREFIX}{step:09d}", 0
    while (output / name).exists():
        n += 1
        name = f"{FOLDER_PREFIX}{step:09d}-{n}"
    return name


def complete_folders(output: Path) -> list[Path]:
    """The run folder's checkpoint folders that were written to the end (manifest present), newest first."""
    found = [path for path in output.glob(f"{FOLDER_PREFIX}*")
             if folder_step(path.name) is not None and (path / MANIFEST_NAME).is_file()]
    return sorted(found, key=lambda path: (folder_step(path.name), path.stat().st_mtime_ns), reverse=True)


def write_pointer(output: Path, directory: str, global_step: int, world_size: int, model: Mapping) -> None:
    atomic_save(checked_json({"format": FORMAT, "directory": directory, "global_step": global_step,
                              "world_size": world_size, "model": dict(model)}), output / POINTER_NAME,
                write=write_bytes)


def read_pointer(pointer: Path) -> dict:
    """checkpoint.json, checked: its checksum, every field of its type, `directory` a checkpoint folder
    beside it. One CheckpointError for any fault."""
    try:
        saved = read_checked_json(pointer)
    except (OSError, IntegrityError) as error:
        if _format_of(pointer) == EARLIER_FORMAT:
            raise CheckpointError(f"{pointer} was written by an earlier pairface, whose checkpoint folders hold "
                                  "pickles that this version never loads; resume it with that version, or start "
                                  f"from its backbone: --set resume={pointer.parent}/backbone.pth --set "
                                  "output=<a new folder>") from None
        raise _bad_pointer(pointer, str(error)) from None
    for key, kind in _POINTER_FIELDS.items():
        if not isinstance(saved.get(key), kind):
            raise _bad_pointer(pointer, f"its {key!r} is missing or not a {kind.__name__}")
    if saved["format"] != FORMAT:
        raise _bad_pointer(pointer, f"it is of format {saved['format']!r}, not {FORMAT!r}")
    if folder_step(saved["directory"]) is None:
        raise _bad_pointer(pointer, f"its directory {saved['directory']!r} is not a checkpoint folder beside it")
    return saved


def _format_of(pointer: Path) -> str | None:
    try:
        content = json.loads(pointer.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return content.get("format") if isinstance(content, dict) else None


def _bad_pointer(pointer: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{pointer} is damaged ({reason}); resume from one of the checkpoint-<step> folders "
                           f"beside it with --set resume={pointer.parent}/checkpoint-<step>, or start a new run")
