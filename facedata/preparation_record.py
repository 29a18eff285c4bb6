"""How the photos in a data file were prepared, kept in a small JSON file beside it
(``train.rec`` -> ``train.rec.preparation.json``, ``val.bin`` -> ``val.bin.preparation.json``), so that
training can carry it into model.json and the tools that read photos can prepare theirs the same way
by default. Beside the file, not inside it: ``.rec`` and ``.bin`` files stay exactly what mxnet and
arcface_torch read. A data file without one (packed elsewhere, or by an earlier version) records nothing.

Content: ``{"photo_preparation": "crop", "landmarks_file": null, "written_by": "tools.pack_rec"}``, the
preparation one of ``facedata.photos.PREPARATIONS``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from facedata.photos import PREPARATIONS, Preparation
from utils.atomic import atomic_save, write_bytes
from utils.errors import DataError

RECORD_SUFFIX = ".preparation.json"
TRAINING_RECORDS = "train.rec"  # in the folder config key 'rec' names


def record_path(data_file: str | os.PathLike) -> Path:
    """Where the preparation of ``data_file``'s photos is recorded."""
    data_file = Path(data_file)
    return data_file.with_name(data_file.name + RECORD_SUFFIX)


def write_preparation(data_file: str | os.PathLike, preparation: Preparation, tool: str) -> Path:
    """Record, beside ``data_file``, how ``tool`` prepared its photos; the file written."""
    landmarks = None if preparation.landmarks_file is None else str(preparation.landmarks_file)
    content = {"photo_preparation": preparation.name, "landmarks_file": landmarks, "written_by": tool}
    path = record_path(data_file)
    atomic_save(json.dumps(content, indent=2).encode(), path, write=write_bytes)
    return path


def read_preparation(data_file: str | os.PathLike) -> str | None:
    """The preparation recorded beside ``data_file`` (a PREPARATIONS name), or None when none is."""
    path = record_path(data_file)
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text()).get("photo_preparation")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise DataError(f"{path} cannot be read as the record of how {Path(data_file).name}'s photos were "
                        f"prepared ({type(error).__name__}); delete it, or pack the data again") from None
    if recorded not in PREPARATIONS:
        raise DataError(f"{path} records photo_preparation {recorded!r}, not one of {', '.join(PREPARATIONS)}; "
                        "delete it, or pack the data again")
    return recorded


def recorded_preparation(rec: str) -> str | None:
    """The preparation recorded for the training records of config key ``rec`` (a folder holding train.rec),
    or None (nothing recorded, an image folder, "synthetic")."""
    records = Path(rec) / TRAINING_RECORDS
    return read_preparation(records) if records.is_file() else None
