"""facedata.alignment and eval.ijb: landmark alignment, pooling, TAR table, on an IJB layout written here.

References: linear least squares for the similarity fit, analytic ramps for the warp, array slicing
for integer-offset alignment, hand-computed pooling and TAR values, upstream's per-template loop.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from dataset import align_face
from eval.ijb import (
    AlignedFaces,
    embed_faces,
    face_features,
    format_tar_table,
    read_meta,
    tar_table,
    template_features,
    template_pair_scores,
)
from facedata.alignment import ARCFACE_TEMPLATE, umeyama_similarity, warp_affine
from references.ijb import upstream_template_scores
from tests.test_verification import TinyNet
from utils.errors import DataError

torch.set_num_threads(1)


def similarity(scale, degrees, tx, ty):
    angle = np.deg2rad(degrees)
    rotation = scale * np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    return np.hstack([rotation, [[tx], [ty]]])


def apply(matrix, points):
    return points @ matrix[:, :2].T + matrix[:, 2]


def least_squares_similarity(src, dst):
    """x' = a x - b y + tx, y' = b x + a y + ty is linear in (a, b, tx, ty): solve it directly."""
    rows, rhs = [], []
    for (x, y), (u, v) in zip(src, dst):
        rows += [[x, -y, 1, 0], [y, x, 0, 1]]
        rhs += [u, v]
    a, b, tx, ty = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
    return np.array([[a, -b, tx], [b, a, ty]])


def test_umeyama_recovers_an_exact_similarity_and_fits_noisy_points_as_least_squares():
    known = similarity(1.7, -23.0, 12.5, -4.0)
    landmarks = np.array([[10.0, 20.0], [50.0, 18.0], [31.0, 40.0], [15.0, 60.0], [47.0, 61.0]])
    np.testing.assert_allclose(umeyama_similarity(landmarks, apply(known, landmarks)), known, atol=1e-10)

    rng = np.random.default_rng(0)
    noisy = ARCFACE_TEMPLATE + rng.normal(0, 3.0, ARCFACE_TEMPLATE.shape)
    np.testing.assert_allclose(umeyama_similarity(noisy, ARCFACE_TEMPLATE),
                               least_squares_similarity(noisy, ARCFACE_TEMPLATE), atol=1e-9)
    mirrored = ARCFACE_TEMPLATE * [-1, 1]  # the best fit would be a reflection, which is excluded
    fit = umeyama_similarity(mirrored, ARCFACE_TEMPLATE)
    assert np.linalg.det(fit[:, :2]) > 0
    np.testing.assert_allclose(fit, least_squares_similarity(mirrored, ARCFACE_TEMPLATE), atol=1e-9)
    with pytest.raises(ValueError, match="one point"):
        umeyama_similarity(np.ones((5, 2)), ARCFACE_TEMPLATE)


def test_warp_samples_at_the_inverse_map_with_pixel_centres_on_integers():
    # Channel 0 = 2x, channel 1 = 2y: bilinear sampling reproduces a linear ramp exactly, so each
    # output pixel must hold 2 * (its source coordinate), up to the final rounding to uint8.
    size = 120
    ys, xs = np.mgrid[0:size, 0:size]
    image = torch.from_numpy(np.stack([2 * xs, 2 * ys, np.full_like(xs, 200)]).astype(np.uint8))
    matrix = similarity(1.3, 17.0, -20.0, 5.0)
    warped = warp_affine(image, matrix, 112).numpy().astype(np.float64)

    out_y, out_x = np.mgrid[0:112, 0:112]
    inverse = np.linalg.inv(np.vstack([matrix, [0, 0, 1]]))[:2]
    source = apply(inverse, np.stack([out_x.ravel(), out_y.ravel()], axis=1)).reshape(112, 112, 2)
    inside = np.all((source >= 0) & (source <= size - 1), axis=2)
    outside = np.any((source < -1) | (source > size), axis=2)
    assert inside.sum() > 5000 and outside.sum() > 500
    np.testing.assert_allclose(warped[0][inside], 2 * source[..., 0][inside], atol=0.51)
    np.testing.assert_allclose(warped[1][inside], 2 * source[..., 1][inside], atol=0.51)
    assert np.all(warped[2][inside] == 200) and np.all(warped[:, outside] == 0)


def test_align_face_on_template_landmarks_shifted_by_whole_pixels_is_a_crop():
    rng = np.random.default_rng(1)
    photo = torch.from_numpy(rng.integers(0, 256, (3, 150, 140), dtype=np.uint8))
    aligned = align_face(photo, ARCFACE_TEMPLATE + [9, 23])
    assert torch.equal(aligned, photo[:, 23:23 + 112, 9:9 + 112])


# ---------------------------------------------------------------------------------------------
# Pooling and TAR, by hand

def test_template_pooling_averages_within_media_and_sums_media():
    features = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0],   # template 7: media 10 twice, media 11
                         [0.0, 5.0],                            # template 3: one face
                         [4.0, 0.0], [0.0, 1.0], [0.0, 3.0]])   # template 9: media 1, media 2 twice
    templates = np.array([7, 7, 7, 3, 9, 9, 9])
    medias = np.array([10, 10, 11, 30, 1, 2, 2])
    ids, pooled = template_features(features, templates, medias)
    assert ids.tolist() == [3, 7, 9]
    # 3: (0, 5) -> (0, 1). 7: mean(1,0; 3,0) + (0,2) = (2, 2). 9: (4,0) + mean(0,1; 0,3) = (4, 2).
    np.testing.assert_allclose(pooled, [[0, 1], [2 / np.sqrt(8), 2 / np.sqrt(8)], [4 / np.sqrt(20), 2 / np.sqrt(20)]])
    scores = template_pair_scores(ids, pooled, np.array([[7, 9], [3, 9], [7, 7]]), chunk=2)
    np.testing.assert_allclose(scores, [(8 + 4) / np.sqrt(8 * 20), 2 / np.sqrt(20), 1.0])

    weighted = face_features(features, np.array([1, 1, 1, 1, 0.5, 2, 2]))
    np.testing.assert_allclose(weighted[4:], [[2, 0], [0, 2], [0, 6]])
    unit = face_features(features, np.full(7, 3.0), normalize_faces=True, use_detector_score=False)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0)


def test_tar_table_and_its_upstream_format():
    # 20 impostors: 0.90, then 19 scores below every genuine but one. Genuine: 0.95 0.85 0.80 0.05.
    impostors = np.r_[0.90, np.linspace(0.1, 0.5, 19)]
    genuine = np.array([0.95, 0.85, 0.80, 0.05])
    scores = np.r_[impostors, genuine]
    labels = np.r_[np.zeros(20), np.ones(4)].astype(int)
    # FAR < 1/20: no impostor passes -> only 0.95 (1/4). FAR 0.1 = 2/20: the 0.90 impostor and the
    # next (0.5) pass -> threshold 0.5 -> 0.95 0.85 0.80 -> 3/4.
    table = tar_table(scores, labels)
    assert table == {1e-6: 0.25, 1e-5: 0.25, 1e-4: 0.25, 1e-3: 0.25, 1e-2: 0.25, 1e-1: 0.75}
    text = format_tar_table({"r18-IJBC": table})
    lines = text.splitlines()
    assert [cell.strip() for cell in lines[1].strip("|").split("|")] == [
        "Methods", "1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1"]
    assert [cell.strip() for cell in lines[3].strip("|").split("|")] == [
        "r18-IJBC", "25.00", "25.00", "25.00", "25.00", "25.00", "75.00"]


# ---------------------------------------------------------------------------------------------
# A miniature IJB release, end to end through the library

# name, template, media, (x, y) offset of the face in its loose crop, detector score
FACES = [("1.jpg", 1, 100, (0, 0), 0.9), ("2.jpg", 1, 100, (5, 3), 0.8), ("3.jpg", 1, 101, (12, 0), 0.95),
         ("4.jpg", 2, 200, (0, 7), 0.7), ("5.jpg", 2, 201, (4, 4), 0.99),
         ("6.jpg", 5, 500, (8, 8), 0.6),
         ("7.jpg", 8, 800, (1, 2), 0.85), ("8.jpg", 8, 800, (0, 0), 0.75)]
PAIRS = [(1, 2, 1), (1, 5, 0), (2, 5, 0), (5, 8, 1), (1, 8, 0), (2, 8, 0)]


def write_ijb(root, target="ijbc", faces=FACES, pairs=PAIRS):
    """The release layout; crops are PNG bytes under IJB's .jpg names (lossless, so the reference
    sees the very pixels the loader decodes). Returns each face's 112x112 patch."""
    rng = np.random.default_rng(2)
    os.makedirs(os.path.join(root, "loose_crop"))
    os.makedirs(os.path.join(root, "meta"))
    crops = {}
    for name, _, _, (dx, dy), _ in faces:
        pixels = rng.integers(0, 256, (112 + dy + 6, 112 + dx + 4, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, "loose_crop", name), format="PNG")
        crops[name] = pixels[dy:dy + 112, dx:dx + 112]
    with open(os.path.join(root, "meta", f"{target}_name_5pts_score.txt"), "w") as f:
        for name, _, _, offset, score in faces:
            points = " ".join(f"{v:.4f}" for v in (ARCFACE_TEMPLATE + offset).ravel())
            f.write(f"{name} {points} {score}\n")
    with open(os.path.join(root, "meta", f"{target}_face_tid_mid.txt"), "w") as f:
        f.writelines(f"{name} {template} {media}\n" for name, template, media, _, _ in faces)
    with open(os.path.join(root, "meta", f"{target}_template_pair_label.txt"), "w") as f:
        f.writelines(f"{a} {b} {label}\n" for a, b, label in pairs)
    return crops


def test_miniature_ijb_end_to_end(tmp_path):
    crops = write_ijb(str(tmp_path))
    meta = read_meta(str(tmp_path), "IJBC")
    assert meta.templates.tolist() == [f[1] for f in FACES] and meta.medias.tolist() == [f[2] for f in FACES]
    np.testing.assert_allclose(meta.detector_scores, [f[4] for f in FACES])
    assert meta.pairs.tolist() == [[a, b] for a, b, _ in PAIRS] and meta.labels.tolist() == [p[2] for p in PAIRS]

    model = TinyNet().eval()
    embeddings = embed_faces(model, AlignedFaces(meta.image_paths, meta.landmarks), batch_size=3)

    faces = torch.from_numpy(np.stack([crops[f[0]] for f in FACES])).permute(0, 3, 1, 2).double()
    with torch.no_grad():
        reference_model = TinyNet().double().eval()
        want = (reference_model(faces / 127.5 - 1) + reference_model(faces.flip(3) / 127.5 - 1)).numpy()
    np.testing.assert_allclose(embeddings, want, rtol=1e-4, atol=1e-5)

    detector = np.array([f[4] for f in FACES])
    features = face_features(embeddings, meta.detector_scores)
    ids, templates = template_features(features, meta.templates, meta.medias)
    scores = template_pair_scores(ids, templates, meta.pairs)
    reference = upstream_template_scores(want * detector[:, None], meta.templates, meta.medias,
                                         [(a, b) for a, b, _ in PAIRS])
    np.testing.assert_allclose(scores, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("damage, message", [
    (lambda root: os.remove(os.path.join(root, "meta", "ijbc_face_tid_mid.txt")),
     "ijbc_face_tid_mid.txt does not exist"),
    (lambda root: os.remove(os.path.join(root, "loose_crop", "6.jpg")), "6.jpg .*does not exist"),
    (lambda root: open(os.path.join(root, "meta", "ijbc_template_pair_label.txt"), "a").write("1 42 0\n"),
     "template 42"),
    (lambda root: open(os.path.join(root, "meta", "ijbc_face_tid_mid.txt"), "a").write("9.jpg 9 900\n"),
     "lists 8 faces but"),
    (lambda root: open(os.path.join(root, "meta", "ijbc_name_5pts_score.txt"), "a").write("9.jpg 1 2\n"),
     "line 9 has 3 fields, expected 12"),
    (lambda root: open(os.path.join(root, "meta", "ijbc_template_pair_label.txt"), "w").close(), "is empty"),
    (lambda root: open(os.path.join(root, "meta", "ijbc_template_pair_label.txt"), "a").write("1 2 1 7\n"),
     "template_pair_label.txt is not lines of"),
    (lambda root: open(os.path.join(root, "meta", "ijbc_template_pair_label.txt"), "w").write("1 2 1\n5 8 1\n"),
     "lists only genuine pairs; TAR@FAR needs both"),
    (lambda root: open(os.path.join(root, "meta", "ijbc_template_pair_label.txt"), "a").write("1 2 3\n"),
     "third column other than 1 .* or 0"),
])
def test_read_meta_errors_name_the_file_and_line(tmp_path, damage, message):
    write_ijb(str(tmp_path))
    damage(str(tmp_path))
    with pytest.raises(DataError, match=message):
        read_meta(str(tmp_path), "IJBC")


def test_a_face_that_cannot_be_aligned_or_decoded_is_a_data_error_naming_it(tmp_path):
    write_ijb(str(tmp_path))
    meta = read_meta(str(tmp_path), "IJBC")
    landmarks = meta.landmarks.copy()
    landmarks[2] = 50.0  # all five landmarks on one point
    with pytest.raises(DataError, match=r"face image .*3\.jpg cannot be aligned .*one point.*; fix its landmarks"):
        embed_faces(TinyNet().eval(), AlignedFaces(meta.image_paths, landmarks), batch_size=4)
    open(meta.image_paths[6], "wb").write(b"GIF89a broken")
    with pytest.raises(DataError, match=r"face image .*7\.jpg cannot be decoded"):
        embed_faces(TinyNet().eval(), AlignedFaces(meta.image_paths, meta.landmarks), batch_size=4)


def test_read_meta_requires_both_files_to_list_faces_in_the_same_order(tmp_path):
    write_ijb(str(tmp_path))
    path = os.path.join(tmp_path, "meta", "ijbc_face_tid_mid.txt")
    lines = open(path).read().splitlines()
    lines[0], lines[1] = lines[1], lines[0]
    open(path, "w").write("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="line 1: .* names 1.jpg but .* names 2.jpg"):
        read_meta(str(tmp_path), "IJBC")
