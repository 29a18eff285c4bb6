"""A gallery of people to search: one template per person (the mean of their photos' flip-fused unit
embeddings, L2-normalised), kept in a file beside the photo folder so that a search embeds only its
queries, and rebuilt when the photos or the model change.

The gallery file (``<folder>.gallery.npz``) holds plain arrays, read with ``allow_pickle=False``:
``names`` (people, in folder order), ``features`` (float32, people x D) and what it was built from:
``model`` (a digest of the weights file's path, size and modification time, its network and options),
``photos`` (a digest of every photo's relative path, size and modification time) and ``preparation``
(how the photos were prepared, in words, so that a rebuild can say it was that which changed); and
``nonmated`` (float32, one per photo): each photo's highest similarity to the templates of the *other*
people, the gallery's own stranger scores, from which a search sets the similarity a face must pass to be
called a known person (eval.identification.threshold_at_fpir). A file written before ``preparation`` or
``nonmated`` was kept has none, and is rebuilt. ``skipped``: the sentence of each photo tools.search --skip-bad
left out, so that a search reusing the file names them again. Checking them costs one ``stat`` per photo, not a read.
"""
from __future__ import annotations

import hashlib
import io
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
from torch import nn

from backbones import face_tensor, flip_fused_embeddings
from backbones.trained import SavedBackbone
from dataset import (
    PACKABLE_SAID,
    PACKABLE_SUFFIXES,
    Preparation,
    prepare_or_skip,
    several_faces_line,
    stretch_warning,
)
from utils.atomic import atomic_save
from utils.errors import DataError, located
from utils.progress import progress

GALLERY_SUFFIX = ".gallery.npz"
_KEYS = {"names", "features", "model", "photos", "preparation", "nonmated", "skipped"}
_KEYS_OF_EARLIER_FILES = (_KEYS - {"nonmated", "skipped"}, _KEYS - {"nonmated", "skipped", "preparation"})


def gallery_file(folder: str | os.PathLike) -> Path:
    """``photos/`` -> ``photos.gallery.npz`` beside it."""
    folder = Path(os.path.abspath(folder))
    return folder.with_name(folder.name + GALLERY_SUFFIX)


def gallery_people(folder: str | os.PathLike) -> list[tuple[str, list[str]]]:
    """``(name, sorted photo paths)`` per sub-folder of ``folder`` (hidden ones aside); every sub-folder must
    hold photos. Paths are plain strings: pathlib objects would make listing 10,000 people several times
    slower, and a search lists them every time."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"gallery folder {located(folder)} does not exist; pass a folder with one sub-folder of "
                        "photos per person")
    people = []
    for entry in sorted(os.scandir(folder), key=lambda entry: entry.name):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        photos = [os.path.join(entry.path, name) for name in sorted(os.listdir(entry.path))
                  if name.lower().endswith(PACKABLE_SUFFIXES)]
        if not photos:
            raise DataError(f"gallery person {entry.path} holds no photos ({PACKABLE_SAID}); add "
                            "photos of them or remove the folder")
        people.append((entry.name, photos))
    if not people:
        raise DataError(f"gallery folder {folder} holds no person sub-folders; put each person's photos in a "
                        "sub-folder named after them")
    return people


def _digest(parts: Sequence[str]) -> str:
    sha = hashlib.sha256()
    for part in parts:
        sha.update(part.encode("utf-8", "surrogateescape") + b"\0")
    return sha.hexdigest()


def _stamp(path: str | os.PathLike) -> str:
    status = os.stat(path)
    return f"{status.st_size}:{status.st_mtime_ns}"


def model_digest(saved: SavedBackbone) -> str:
    weights = Path(os.path.abspath(saved.weights))
    return _digest([str(weights), _stamp(weights), saved.network, repr(sorted(saved.options.items()))])


def preparation_stamp(preparation: Preparation) -> str:
    """How the photos are prepared, as a rebuild names it (with the landmarks file's size and time)."""
    landmarks = "" if preparation.landmarks_file is None else f" ({_stamp(preparation.landmarks_file)})"
    return preparation.describe() + landmarks


def photos_digest(people: Sequence[tuple[str, Sequence[str]]]) -> str:
    """What the templates depend on besides the model and the preparation: each photo's ``person/file``, size
    and modification time."""
    parts = []
    for name, photos in people:
        parts += [f"{name}/{os.path.basename(photo)}={_stamp(photo)}" for photo in photos]
    return _digest(parts)


@dataclass(frozen=True)
class PersonGallery:
    names: list[str]
    features: np.ndarray  # float32 (people, D), unit rows
    model: str            # model_digest of the model that built it
    photos: str           # photos_digest of the photos it was built from
    preparation: str      # preparation_stamp of how they were prepared ("" in a file that predates it)
    nonmated: np.ndarray | None = None  # float32 (photos,): see the module doc; None in a file that predates it
    skipped: list[str] = field(default_factory=list)  # why each photo --skip-bad left out could not be prepared


def build_gallery(model: nn.Module, people: Sequence[tuple[str, Sequence[str]]], preparation: Preparation,
                  model_stamp: str, photos_stamp: str, batch_size: int = 64, stream: TextIO | None = None,
                  skip_bad: bool = False) -> tuple[PersonGallery, list[str]]:
    """Embed every photo (flip-fused, unit length) and average each person's into their template; with it, the
    lines to say once about the photos: those ``resize`` stretched out of their aspect ratio, those in which the
    detector found several faces (none when no photo was either). A photo
    that cannot be prepared raises its FaceImageError, or, with ``skip_bad``, is left out and named in the
    gallery's ``skipped`` (a person left without photos is left out too)."""
    paths = [photo for _, photos in people for photo in photos]
    owner = np.repeat(np.arange(len(people)), [len(photos) for _, photos in people])
    batches = [range(start, min(start + batch_size, len(paths))) for start in range(0, len(paths), batch_size)]
    chunks, stretched, crowded, kept = [], [], [], []
    skipped: list[str] | None = [] if skip_bad else None
    for batch in progress(batches, len(batches), "embedding gallery photos", stream):
        prepared = [(index, prepare_or_skip(preparation, paths[index], skipped)) for index in batch]
        crowded += [(paths[index], face.faces_found) for index, face in prepared if face and face.crowded]
        faces = [(index, face_tensor(face)) for index, face in prepared if face is not None]
        stretched += [(paths[index], size) for index, (_, size) in faces if size is not None]
        kept += [index for index, _ in faces]
        if faces:
            chunks.append(flip_fused_embeddings(model, torch.stack([image for _, (image, _) in faces])))
    if not kept:
        raise DataError(f"--skip-bad left out every one of the gallery's {len(paths)} photos (e.g. "
                        f"{(skipped or ['?'])[0]}); replace them")
    # People left without a photo are left out: the others renumbered in their order.
    present, owner = np.unique(owner[kept], return_inverse=True)
    embeddings = torch.cat(chunks).double().numpy()
    sums = np.zeros((present.size, embeddings.shape[1]))
    np.add.at(sums, owner, embeddings)
    features = (sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)).astype(np.float32)
    gallery = PersonGallery([people[person][0] for person in present], features, model_stamp, photos_stamp,
                            preparation_stamp(preparation), nonmated_scores(embeddings, owner, features),
                            skipped or [])
    said = [stretch_warning(stretched, len(kept)), several_faces_line(crowded, len(kept))]
    return gallery, [line for line in said if line]


def nonmated_scores(embeddings: np.ndarray, owner: np.ndarray, features: np.ndarray) -> np.ndarray:
    """Each photo's highest similarity to another person's template, as a search scores a query (float32): what
    a face not in the gallery scores, as near as the gallery itself can tell (empty with one person)."""
    if features.shape[0] < 2:
        return np.zeros(0, np.float32)
    similarity = embeddings.astype(np.float32) @ features.T
    similarity[np.arange(owner.size), owner] = -np.inf  # its own person's template holds the photo itself
    return similarity.max(axis=1)


def save_gallery(gallery: PersonGallery, path: Path) -> None:
    """Written atomically: a crash leaves the previous file or none, never half of one."""
    def write(arrays: dict, handle) -> None:
        np.savez(handle, **arrays)

    atomic_save({"names": np.array(gallery.names, dtype=str), "features": gallery.features,
                 "model": np.array(gallery.model), "photos": np.array(gallery.photos),
                 "preparation": np.array(gallery.preparation), "nonmated": gallery.nonmated,
                 "skipped": np.array(gallery.skipped, dtype=str)}, path, write=write)


def load_gallery(path: Path) -> PersonGallery:
    """The gallery file at ``path``; a file that is not one, or is damaged, is one DataError."""
    fix = "delete it, or pass --rebuild to build the gallery again"
    try:
        with open(path, "rb") as f:
            data = f.read()
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            if set(arrays.files) != _KEYS and set(arrays.files) not in _KEYS_OF_EARLIER_FILES:
                raise ValueError(f"it holds {sorted(arrays.files)}, not {sorted(_KEYS)}")
            names, features = arrays["names"], arrays["features"]
            model, photos = str(arrays["model"][()]), str(arrays["photos"][()])
            preparation = str(arrays["preparation"][()]) if "preparation" in arrays.files else ""
            nonmated = arrays["nonmated"] if "nonmated" in arrays.files else None
            skipped = arrays["skipped"].tolist() if "skipped" in arrays.files else []
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise DataError(f"gallery file {path} cannot be read ({str(error).splitlines()[0] or type(error).__name__}); "
                        f"{fix}") from None
    if names.ndim != 1 or names.dtype.kind != "U" or features.dtype != np.float32 or features.ndim != 2 \
            or len(features) != len(names) or not np.isfinite(features).all() or (nonmated is not None and (
                nonmated.dtype != np.float32 or nonmated.ndim != 1 or not np.isfinite(nonmated).all())):
        raise DataError(f"gallery file {path} is damaged (its names and features do not fit together); {fix}")
    return PersonGallery(names.tolist(), features, model, photos, preparation, nonmated, skipped)


def top_matches(features: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, similarities)``, each (queries, min(k, people)): the most similar people first."""
    similarity = queries.astype(np.float32) @ features.T
    k = min(k, features.shape[0])
    # argpartition finds the k best in linear time; only those k are then sorted.
    best = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
    scores = np.take_along_axis(similarity, best, axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")
    return np.take_along_axis(best, order, axis=1), np.take_along_axis(scores, order, axis=1)
