"""IJB-B / IJB-C 1:N identification: the release's two galleries and its mixed probe set, searched with
the template features the 1:1 protocol builds (eval/ijb.py), measured by eval/identification.py.

Files (``<target>`` in lower case; IJB-C's galleries are G1 and G2, IJB-B's S1 and S2)::

    ROOT/meta/<target>_1N_gallery_G1.csv     TEMPLATE_ID,SUBJECT_ID,...   (a header line, then one image a line)
    ROOT/meta/<target>_1N_gallery_G2.csv
    ROOT/meta/<target>_1N_probe_mixed.csv

Every template's faces are those ``<target>_face_tid_mid.txt`` gives it. A gallery enrols each subject
once; the galleries are disjoint, so each probe is mated in one and non-mated in the other.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass

import numpy as np

from eval.identification import SearchOutcome, search_outcome
from utils.errors import DataError

PROBES = "probe_mixed"


def gallery_names(target: str) -> tuple[str, str]:
    return ("S1", "S2") if target.upper() == "IJBB" else ("G1", "G2")


def list_path(root: str, target: str, kind: str) -> str:
    """``kind``: ``gallery_G1`` ... or ``probe_mixed``."""
    return os.path.join(root, "meta", f"{target.lower()}_1N_{kind}.csv")


@dataclass(frozen=True)
class SubjectTemplates:
    """Templates (sorted, distinct) and the subject each one shows."""

    path: str
    templates: np.ndarray
    subjects: np.ndarray


def read_subject_templates(path: str) -> SubjectTemplates:
    """One 1:N list: a header line, then ``TEMPLATE_ID,SUBJECT_ID,...`` per image."""
    if not os.path.isfile(path):
        raise DataError(f"1:N list {path} does not exist; --root's meta/ must hold the release's 1:N lists "
                        "(gallery and probe_mixed .csv files), or run --protocol 11 alone")
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f)][1:]
    numbers = []
    for number, row in enumerate(rows, start=2):
        if not row:
            continue
        try:
            numbers.append((int(row[0]), int(row[1])))
        except (ValueError, IndexError):
            raise DataError(f"{path} line {number} does not start with TEMPLATE_ID,SUBJECT_ID (two whole numbers); "
                            "restore the file from the IJB release") from None
    if not numbers:
        raise DataError(f"1:N list {path} lists no template below its header; restore it from the IJB release")
    pairs = np.unique(np.asarray(numbers, dtype=np.int64), axis=0)
    templates, first = np.unique(pairs[:, 0], return_index=True)
    if templates.size != len(pairs):
        twice = pairs[np.setdiff1d(np.arange(len(pairs)), first)][0, 0]
        raise DataError(f"{path} gives template {twice} two subjects; restore the file from the IJB release")
    return SubjectTemplates(path, templates, pairs[first, 1])


@dataclass(frozen=True)
class IdentificationLists:
    """The two galleries (by name) and the probes."""

    galleries: dict[str, SubjectTemplates]
    probes: SubjectTemplates


def read_identification(root: str, target: str, face_templates: np.ndarray, face_list: str) -> IdentificationLists:
    """The 1:N lists of ``target``, each template checked to have faces in ``face_list`` (the
    face_tid_mid file that gave ``face_templates``) and each gallery to enrol a subject once."""
    galleries = {name: read_subject_templates(list_path(root, target, f"gallery_{name}"))
                 for name in gallery_names(target)}
    probes = read_subject_templates(list_path(root, target, PROBES))
    for listed in [*galleries.values(), probes]:
        faceless = np.setdiff1d(listed.templates, face_templates)
        if faceless.size:
            raise DataError(f"template {faceless[0]} of {listed.path} has no images in {face_list}; the meta files "
                            "must come from one release")
    for gallery in galleries.values():
        subjects, counts = np.unique(gallery.subjects, return_counts=True)
        if (counts > 1).any():
            subject = subjects[counts > 1][0]
            twice = gallery.templates[gallery.subjects == subject][:2]
            raise DataError(f"{gallery.path} enrols subject {subject} in templates {twice[0]} and {twice[1]}; a 1:N "
                            "gallery holds one template per subject: restore the file from the IJB release")
        mated = int(np.isin(probes.subjects, gallery.subjects).sum())
        if mated in (0, probes.templates.size):
            raise DataError(f"{probes.path} has {mated} of its {probes.templates.size} probe templates enrolled in "
                            f"{gallery.path}; open-set identification needs probes of enrolled and of other subjects: "
                            "use the release's mixed probe list")
    return IdentificationLists(galleries, probes)


@dataclass(frozen=True)
class GallerySearch:
    similarity: np.ndarray  # (probes, gallery templates) cosine, rows and columns in the lists' template order
    outcome: SearchOutcome


def search_galleries(template_ids: np.ndarray, features: np.ndarray,
                     lists: IdentificationLists) -> dict[str, GallerySearch]:
    """Every probe template searched in each gallery (``features``: unit rows of sorted ``template_ids``)."""
    probe_features = features[np.searchsorted(template_ids, lists.probes.templates)]
    searches = {}
    for name, gallery in lists.galleries.items():
        similarity = probe_features @ features[np.searchsorted(template_ids, gallery.templates)].T
        searches[name] = GallerySearch(similarity, search_outcome(similarity, lists.probes.subjects, gallery.subjects))
    return searches


def save_searches(path: str, lists: IdentificationLists, searches: dict[str, GallerySearch]) -> None:
    """An ``.npz`` of plain arrays (readable with ``allow_pickle=False``): ``probe_templates``,
    ``probe_subjects`` and, per gallery, ``<name>_templates``, ``<name>_subjects``, ``<name>_similarity``
    (float32, probes x gallery templates)."""
    arrays = {"probe_templates": lists.probes.templates, "probe_subjects": lists.probes.subjects}
    for name, gallery in lists.galleries.items():
        arrays |= {f"{name}_templates": gallery.templates, f"{name}_subjects": gallery.subjects,
                   f"{name}_similarity": searches[name].similarity.astype(np.float32)}
    np.savez(path, **arrays)
