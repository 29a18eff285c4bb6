"""IJB-B / IJB-C 1:1 template verification, as arcface_torch's eval_ijbc.py computes it, and 1:N
identification (eval/ijb_1n.py) from the same template features.

Dataset layout (the published release, ``<target>`` = ``ijbb`` or ``ijbc``)::

    ROOT/loose_crop/<image files>
    ROOT/meta/<target>_name_5pts_score.txt      name x1 y1 ... x5 y5 detector_score   (one face a line)
    ROOT/meta/<target>_face_tid_mid.txt         name template_id media_id            (same order)
    ROOT/meta/<target>_template_pair_label.txt  template_id template_id 1|0   (1:1)
    ROOT/meta/<target>_1N_gallery_G1.csv, _G2.csv (IJB-B: _S1, _S2), _1N_probe_mixed.csv   (1:N)

Each face is aligned to the ArcFace template by its 5 landmarks and embedded with its mirror image
(embeddings summed); face features are averaged within a media (a video's frames count once),
media features summed into a template feature, and template pairs scored by cosine similarity.

Command line (prints the TAR table, writes the ROC plot and the raw scores next to the model; with
``--protocol 1n`` the TPIR/rank table of each gallery and their mean, a DET plot and the similarities):

    python -m eval.ijb --model output/run --root IJB_release/IJBC --target IJBC
    python -m eval.ijb --model output/run --root IJB_release/IJBC --target IJBC --protocol 11 1n
    python -m eval.ijb --onnx w600k_r50.onnx --root IJB_release/IJBB --target IJBB --protocol 1n
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

import numpy as np
import torch
from PIL import Image
from scipy import sparse
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dataset import align_face
from eval.cli import add_network_arguments, check_positive, open_network, output_prefix
from eval.embedding import embed_batches, eval_mode, unwrap
from eval.identification import det_curve, format_identification_table, gallery_row, mean_row
from eval.ijb_1n import IdentificationLists, read_identification, save_searches, search_galleries
from eval.roc import roc_points, save_roc_plot, tar_at_far
from eval.table import boxed_table
from utils.atomic import atomic_save, write_bytes
from utils.cli import exit_on_user_error
from utils.errors import ConfigError, DataError
from utils.image import IMAGE_SIZE
from utils.progress import progress

IJB_FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
PROTOCOLS = ("11", "1n")


@dataclass(frozen=True)
class IJBFaces:
    """Every face of an IJB release, in file order."""

    image_paths: list[str]
    landmarks: np.ndarray        # (faces, 5, 2) x, y in the loose crop
    detector_scores: np.ndarray  # (faces,)
    templates: np.ndarray        # (faces,) template id
    medias: np.ndarray           # (faces,) media id


@dataclass(frozen=True)
class IJBMeta(IJBFaces):
    """The faces and the 1:1 protocol's template pairs."""

    pairs: np.ndarray            # (pairs, 2) template ids
    labels: np.ndarray           # (pairs,) 1 genuine, 0 impostor


def meta_path(root: str, target: str, kind: str) -> str:
    return os.path.join(root, "meta", f"{target.lower()}_{kind}.txt")


def _require_file(path: str) -> None:
    if not os.path.isfile(path):
        raise DataError(f"meta file {path} does not exist; --root must hold meta/ and loose_crop/ and "
                        f"--target name the protocol (IJBB or IJBC)")


def _split_lines(path: str, columns: int) -> list[list[str]]:
    _require_file(path)
    with open(path) as f:
        rows = [line.split() for line in f if line.strip()]
    if not rows:
        raise DataError(f"meta file {path} is empty; restore it from the IJB release")
    for number, row in enumerate(rows, start=1):
        if len(row) != columns:
            raise DataError(f"{path} line {number} has {len(row)} fields, expected {columns}; restore the file "
                            "from the IJB release")
    return rows


def _numbers(path: str, rows: list[list[str]], dtype) -> np.ndarray:
    try:
        return np.asarray(rows, dtype=dtype)
    except ValueError as error:
        raise DataError(f"{path} holds a field that is not a number ({error}); restore the file from the IJB "
                        "release") from None


def _read_pairs(path: str) -> np.ndarray:
    """``(pairs, 3)`` int64 rows; numpy's C parser, as IJB-C lists 15.6M pairs."""
    _require_file(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # numpy's "no data" warning: reported below
            rows = np.loadtxt(path, dtype=np.int64, ndmin=2)
    except ValueError as error:
        raise DataError(f"{path} is not lines of 'template_id template_id 1|0' ({error}); restore the file from "
                        "the IJB release") from None
    if rows.size == 0:
        raise DataError(f"meta file {path} is empty; restore it from the IJB release")
    if rows.shape[1] != 3:
        raise DataError(f"{path} has {rows.shape[1]} fields a line, expected 3 (template_id template_id 1|0); "
                        "restore the file from the IJB release")
    return rows


def read_faces(root: str, target: str) -> IJBFaces:
    """Read and cross-check the face list and its template/media ids of ``target`` under ``root``."""
    faces_path = meta_path(root, target, "name_5pts_score")
    ids_path = meta_path(root, target, "face_tid_mid")
    faces = _split_lines(faces_path, 12)
    ids = _split_lines(ids_path, 3)
    if len(faces) != len(ids):
        raise DataError(f"{faces_path} lists {len(faces)} faces but {ids_path} lists {len(ids)}; they must "
                        f"describe the same faces line by line")
    for number, (face, face_ids) in enumerate(zip(faces, ids), start=1):
        if face[0] != face_ids[0]:
            raise DataError(f"line {number}: {faces_path} names {face[0]} but {ids_path} names "
                            f"{face_ids[0]}; the files must list the faces in the same order")
    points = _numbers(faces_path, [row[1:] for row in faces], np.float64)
    template_media = _numbers(ids_path, [row[1:] for row in ids], np.int64)
    crops = os.path.join(root, "loose_crop")
    image_paths = [os.path.join(crops, row[0]) for row in faces]
    missing = next((path for path in image_paths if not os.path.isfile(path)), None)
    if missing is not None:
        raise DataError(f"face image {missing} (listed in {faces_path}) does not exist; is --root the "
                        f"folder holding loose_crop/?")
    return IJBFaces(image_paths=image_paths, landmarks=points[:, :10].reshape(-1, 5, 2),
                    detector_scores=points[:, 10], templates=template_media[:, 0], medias=template_media[:, 1])


def read_template_pairs(root: str, target: str, faces: IJBFaces) -> tuple[np.ndarray, np.ndarray]:
    """The 1:1 protocol: ``(pairs (n, 2) template ids, labels (n,) 1 genuine / 0 impostor)``."""
    pairs_path = meta_path(root, target, "template_pair_label")
    pair_rows = _read_pairs(pairs_path)
    unknown = np.setdiff1d(pair_rows[:, :2], faces.templates)
    if unknown.size:
        raise DataError(f"{pairs_path} pairs template {unknown[0]}, which no face in "
                        f"{meta_path(root, target, 'face_tid_mid')} belongs to; the meta files must come from one "
                        "release")
    labels = pair_rows[:, 2]
    if not np.isin(labels, (0, 1)).all():
        raise DataError(f"{pairs_path} has a third column other than 1 (same person) or 0 (different); "
                        "restore the file from the IJB release")
    if labels.all() or not labels.any():
        raise DataError(f"{pairs_path} lists only {'genuine' if labels.all() else 'impostor'} pairs; TAR@FAR "
                        "needs both: use the protocol's full pair list")
    return pair_rows[:, :2], labels


def read_meta(root: str, target: str) -> IJBMeta:
    """The faces and the 1:1 pairs of ``target`` under ``root``, cross-checked."""
    faces = read_faces(root, target)
    pairs, labels = read_template_pairs(root, target, faces)
    return IJBMeta(**vars(faces), pairs=pairs, labels=labels)


class AlignedFaces(Dataset):
    """``(uint8 (3, 112, 112) aligned crop, problem)``, decoded in DataLoader workers.

    ``problem`` is "" or the one sentence saying why the face is unusable (its crop is then black):
    an exception raised in a worker reaches the main process wrapped in the worker's traceback text.
    """

    def __init__(self, image_paths: Sequence[str], landmarks: np.ndarray) -> None:
        self.image_paths = list(image_paths)
        self.landmarks = landmarks

    def __len__(self) -> int:
        return len(self.image_paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        path = self.image_paths[index]
        try:
            with Image.open(path) as image:
                rgb = np.array(image.convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as error:
            return torch.zeros(3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8), (
                f"face image {path} cannot be decoded ({error}); replace it with the file from the IJB release")
        try:
            return align_face(torch.from_numpy(rgb).permute(2, 0, 1), self.landmarks[index]), ""
        except ValueError as error:
            return torch.zeros(3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8), (
                f"face image {path} cannot be aligned ({error}); fix its landmarks in the meta file")


def embed_faces(backbone: nn.Module, faces: Dataset, batch_size: int = 128, workers: int = 0,
                flip: bool = True, stream: TextIO | None = None) -> np.ndarray:
    """``(faces, D)`` embeddings, each summed with its mirror image's when ``flip``.

    ``stream``: where a command line shows the progress. The first unusable face raises its DataError.
    """
    loader = DataLoader(faces, batch_size=batch_size, num_workers=workers)
    chunks = []
    with eval_mode(unwrap(backbone)) as model:
        for batch, problems in progress(loader, len(loader), "embedding faces", stream):
            problem = next((problem for problem in problems if problem), None)
            if problem is not None:
                raise DataError(problem)
            if flip:
                both = embed_batches(model, [torch.cat([batch, batch.flip(3)])])
                chunks.append(both[:len(batch)] + both[len(batch):])
            else:
                chunks.append(embed_batches(model, [batch]))
    return np.concatenate(chunks)


def face_features(embeddings: np.ndarray, detector_scores: np.ndarray, normalize_faces: bool = False,
                  use_detector_score: bool = True) -> np.ndarray:
    """Per-face features before pooling, upstream's defaults: the embedding's norm is kept as a
    quality signal (``normalize_faces`` drops it) and weighted by the detector score."""
    features = np.asarray(embeddings, dtype=np.float64)
    if normalize_faces:
        features = features / np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
    if use_detector_score:
        features = features * np.asarray(detector_scores, dtype=np.float64)[:, None]
    return features


def _sum_by_group(values: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    """Row sums of ``values`` per group id in ``[0, num_groups)``, as one sparse matrix product."""
    indicator = sparse.csr_matrix((np.ones(group.size), (group, np.arange(group.size))),
                                  shape=(num_groups, group.size))
    return np.asarray(indicator @ values)


def template_features(features: np.ndarray, templates: np.ndarray,
                      medias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(template_ids, unit features)``: the mean of each (template, media) group, summed per
    template, L2-normalised. ``template_ids`` is sorted; row i belongs to ``template_ids[i]``."""
    template_ids, template_index = np.unique(templates, return_inverse=True)
    _, media_index = np.unique(medias, return_inverse=True)
    num_medias = int(media_index.max()) + 1
    group_keys, group_index, group_sizes = np.unique(template_index * num_medias + media_index,
                                                     return_inverse=True, return_counts=True)
    media_means = _sum_by_group(features, group_index, group_keys.size) / group_sizes[:, None]
    pooled = _sum_by_group(media_means, group_keys // num_medias, template_ids.size)
    return template_ids, pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def template_pair_scores(template_ids: np.ndarray, features: np.ndarray, pairs: np.ndarray,
                chunk: int = 65536) -> np.ndarray:
    """Cosine similarity of each template pair (rows of ``features`` are unit vectors).

    ``chunk`` pairs at a time: IJB-C's 15.6M pairs gathered at once would need ~128 GB.
    """
    rows = np.searchsorted(template_ids, pairs)
    scores = np.empty(len(pairs))
    for start in range(0, len(pairs), chunk):
        block = rows[start:start + chunk]
        scores[start:start + chunk] = np.einsum("ij,ij->i", features[block[:, 0]], features[block[:, 1]])
    return scores


def tar_table(scores: np.ndarray, labels: np.ndarray) -> dict[float, float]:
    """TAR at FAR 1e-6 .. 1e-1 (see ``eval.roc.tar_at_far`` for the exact rule)."""
    return tar_at_far(scores, labels, IJB_FARS)


def format_tar_table(rows: Mapping[str, Mapping[float, float]]) -> str:
    """Upstream's table: one row per method, TAR in percent with two decimals per FAR column."""
    header = ["Methods"] + [str(far) for far in IJB_FARS]
    body = [[name] + [f"{table[far] * 100:.2f}" for far in IJB_FARS] for name, table in rows.items()]
    return boxed_table(header, body)


def verify(args: argparse.Namespace, pairs: tuple[np.ndarray, np.ndarray], method: str,
           template_ids: np.ndarray, templates: np.ndarray, prefix: str) -> None:
    """The 1:1 protocol: the TAR table, the pair scores and the ROC plot."""
    pair_ids, labels = pairs
    scores = template_pair_scores(template_ids, templates, pair_ids)
    table = tar_table(scores, labels)
    print(format_tar_table({method: table}))
    # The TAR table on its own, for eval.compare (the scores alone lack the labels).
    tar_path = f"{prefix}_{args.target.lower()}_tar.json"
    atomic_save(json.dumps({"target": args.target, "pairs": int(labels.size),
                            "tar_at_far": {f"{far:g}": tar for far, tar in table.items()}}, indent=2).encode(),
                tar_path, write=write_bytes)
    scores_path = f"{prefix}_{args.target.lower()}_scores.npy"
    np.save(scores_path, scores)
    print(f"scores (cosine, one per line of {meta_path(args.root, args.target, 'template_pair_label')}): "
          f"{scores_path}")
    plot_path = f"{prefix}_{args.target.lower()}_roc.png"
    save_roc_plot({method: roc_points(scores, labels)[:2]}, plot_path, title=f"ROC on {args.target}")
    print(f"ROC plot: {plot_path}, TAR table: {tar_path}")


def identify(args: argparse.Namespace, lists: IdentificationLists, method: str, template_ids: np.ndarray,
             templates: np.ndarray, prefix: str) -> None:
    """The 1:N protocol: the TPIR/rank table per gallery and their mean, the similarities and the DET plot."""
    searches = search_galleries(template_ids, templates, lists)
    outcomes = {name: search.outcome for name, search in searches.items()}
    rows = {f"{method} {name}": gallery_row(outcome) for name, outcome in outcomes.items()}
    print(format_identification_table({**rows, f"{method} mean": mean_row(list(outcomes.values()))}))
    scores_path = f"{prefix}_{args.target.lower()}_1n_scores.npz"
    save_searches(scores_path, lists, searches)
    print(f"similarities (probe templates x gallery templates, per gallery): {scores_path}")
    plot_path = f"{prefix}_{args.target.lower()}_1n_det.png"
    save_roc_plot({f"{method} {name}": det_curve(outcome) for name, outcome in outcomes.items()}, plot_path,
                  title=f"1:N identification on {args.target}",
                  axes=("False Positive Identification Rate", "True Positive Identification Rate"))
    print(f"DET plot: {plot_path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_network_arguments(parser)
    parser.add_argument("--root", required=True, help="IJB folder holding meta/ and loose_crop/")
    parser.add_argument("--target", default="IJBC", help="IJBC or IJBB: the meta file prefix")
    parser.add_argument("--protocol", nargs="+", choices=PROTOCOLS, default=["11"],
                        help="11: template verification (TAR at FAR); 1n: identification in the two galleries "
                             "(TPIR at FPIR, rank-k); both (--protocol 11 1n) share one embedding pass")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="images per forward pass (memory only: the scores do not depend on it)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes decoding and aligning images")
    parser.add_argument("--no-flip", action="store_true", help="embed the images only, not their mirror images")
    parser.add_argument("--no-detector-score", action="store_true", help="do not weight faces by detector score")
    parser.add_argument("--normalize-faces", action="store_true",
                        help="L2-normalise each face before pooling (drops the norm as a quality signal)")
    args = parser.parse_args(argv)

    with exit_on_user_error():
        check_positive(args.batch_size, "--batch-size")
        if args.workers < 0:
            raise ConfigError(f"--workers {args.workers} is negative; pass 0 (decode in this process) or more")
        # Every meta file is read and checked before the long embedding pass.
        meta = read_faces(args.root, args.target)
        pairs = read_template_pairs(args.root, args.target, meta) if "11" in args.protocol else None
        lists = None
        if "1n" in args.protocol:
            lists = read_identification(args.root, args.target, meta.templates,
                                        meta_path(args.root, args.target, "face_tid_mid"))
        network = open_network(args)
        prefix = output_prefix(network.path)
        counts = []
        if pairs is not None:
            counts.append(f"{len(pairs[1])} pairs")
        if lists is not None:
            galleries = " and ".join(f"{name} ({gallery.templates.size})" for name, gallery in lists.galleries.items())
            counts.append(f"{lists.probes.templates.size} probes in galleries {galleries}")
        print(f"{args.target}: {len(meta.image_paths)} faces, {np.unique(meta.templates).size} templates, "
              f"{', '.join(counts)}")
        embeddings = embed_faces(network.module, AlignedFaces(meta.image_paths, meta.landmarks), args.batch_size,
                                 args.workers, flip=not args.no_flip, stream=sys.stderr)
        features = face_features(embeddings, meta.detector_scores, args.normalize_faces,
                                 use_detector_score=not args.no_detector_score)
        template_ids, templates = template_features(features, meta.templates, meta.medias)
        method = f"{network.name}-{args.target}"
        if pairs is not None:
            verify(args, pairs, method, template_ids, templates, prefix)
        if lists is not None:
            identify(args, lists, method, template_ids, templates, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
