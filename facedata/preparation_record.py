"""How the photos in a data file were prepared, kept in a small JSON file beside it
(``train.rec`` -> ``train.rec.preparation.json``, ``val.bin`` -> ``val.bin.preparation.json``), so that
training can carry it into model.json and the tools that read photos can prepare theirs the same way
by default. Beside the file, not inside it: ``.rec`` and ``.bin`` files stay exactly what mxnet and
arcface_torch read. A data file without one (packed elsewhere, or by an earlier version) records nothing.

Content: ``{"photo_preparation": "crop", "landmarks_file": null, "written_by": "tools.pack_rec",
"same_pixels_as": ["resize", "crop"]}``, the preparation one of ``facedata.photos.PREPARATIONS``, and the fits
that would have given these very photos the same pixels (from their sizes: on square photos --crop and --resize
are one preparation), so that ``preparation_note`` compares the faces a model sees, not the option's name;
tools.pack_rec adds ``people`` (the identities it packed), tools.make_bin ``people_in_training`` (how many of
the set's people those include), so that a verification set of people kept out of training can be told from one
of training people.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from facedata.photos import PREPARATIONS, Preparation, same_pixels_as
from utils.atomic import atomic_save, write_bytes
from utils.errors import DataError

RECORD_SUFFIX = ".preparation.json"
TRAINING_RECORDS = "train.rec"  # in the folder config key 'rec' names


def record_path(data_file: str | os.PathLike) -> Path:
    """Where the preparation of ``data_file``'s photos is recorded."""
    data_file = Path(data_file)
    return data_file.with_name(data_file.name + RECORD_SUFFIX)


def write_preparation(data_file: str | os.PathLike, preparation: Preparation, tool: str,
                      photo_sizes: Iterable[tuple[int, int]], extra: Mapping[str, object] | None = None) -> Path:
    """Record, beside ``data_file``, how ``tool`` prepared its photos, of these (width, height) sizes (and
    ``extra``: ``people``, the identities pack_rec packed; ``people_in_training``, how many of a .bin's people
    are among them); the file written."""
    landmarks = None if preparation.landmarks_file is None else str(preparation.landmarks_file)
    alike = {} if preparation.aligns else {
        "same_pixels_as": same_pixels_as(preparation.fit, photo_sizes)}
    detector = {} if preparation.detector is None else {"detector": preparation.detector}
    content = {"photo_preparation": preparation.name, "landmarks_file": landmarks, **detector, "written_by": tool,
               **alike, **(extra or {})}
    path = record_path(data_file)
    atomic_save(json.dumps(content, indent=2).encode(), path, write=write_bytes)
    return path


def copy_record(source_file: str | os.PathLike, data_file: str | os.PathLike,
                changes: Mapping[str, object]) -> Path | None:
    """Record beside ``data_file`` what is recorded beside ``source_file``, with ``changes`` (a data file made from
    another's records, such as a cleaned train.rec, holds photos prepared as those were); None when nothing is."""
    content = read_record(source_file)
    if not content:
        return None
    path = record_path(data_file)
    atomic_save(json.dumps({**content, **changes}, indent=2).encode(), path, write=write_bytes)
    return path


def read_record(data_file: str | os.PathLike) -> dict:
    """Everything recorded beside ``data_file`` ({} when nothing is); DataError naming a damaged record."""
    path = record_path(data_file)
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text())
        if not isinstance(content, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DataError(f"{path} cannot be read as the record of how {Path(data_file).name}'s photos were "
                        f"prepared ({type(error).__name__}); delete it, or pack the data again") from None
    return content


def held_out(data_file: str | os.PathLike) -> bool | None:
    """Whether a verification set's people were all kept out of training (tools.make_bin compared them with
    the training records' people beside it), or None when that is not known."""
    count = read_record(data_file).get("people_in_training")
    return count == 0 if isinstance(count, int) else None


def read_preparation(data_file: str | os.PathLike) -> str | None:
    """The preparation recorded beside ``data_file`` (a PREPARATIONS name), or None when none is."""
    recorded = read_record(data_file).get("photo_preparation")
    if recorded is not None and recorded not in PREPARATIONS:
        raise DataError(f"{record_path(data_file)} records photo_preparation {recorded!r}, not one of "
                        f"{', '.join(PREPARATIONS)}; delete it, or pack the data again")
    return recorded


BIN_MISMATCH = ("its scores understate the model", "tools.make_bin")


def preparation_note(data_file: str | os.PathLike, trained: str | None, where: str | os.PathLike,
                     mismatch: tuple[str, str] = BIN_MISMATCH) -> str | None:
    """One line comparing the faces in ``data_file`` with the model's training photos, prepared as ``trained``
    (recorded in ``where``): the same preparation, one that gives these photos the same pixels, or a line
    starting "warning:" when the faces differ, saying ``mismatch``'s consequence and the tool that makes the data
    again; None when either preparation is unknown."""
    recorded = read_preparation(data_file)
    if trained is None or recorded is None:
        return None
    if recorded == trained:
        return f"{data_file}: photos prepared with --{recorded}, as the model's training photos ({where})"
    if trained in read_record(data_file).get("same_pixels_as", []):
        return (f"{data_file}: photos prepared with --{recorded}, which gives these photos the same pixels as "
                f"--{trained}, the preparation {where} records for the model's training photos")
    consequence, tool = mismatch
    return (f"warning: {data_file} holds photos prepared with --{recorded}, but {where} records --{trained} for the "
            f"model's training photos, and on these photos the two give different faces, so {consequence}; make it "
            f"again with {tool} --{trained}")


def recorded_preparation(rec: str) -> str | None:
    """The preparation recorded for the training records of config key ``rec`` (a folder holding train.rec),
    or None (nothing recorded, an image folder, "synthetic")."""
    records = Path(rec) / TRAINING_RECORDS
    return read_preparation(records) if records.is_file() else None
