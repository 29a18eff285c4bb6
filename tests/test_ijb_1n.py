"""eval.identification and eval.ijb_1n: IJB 1:N identification on a synthetic release layout (60 templates
of 12 subjects, hand-made face features), against a brute-force computation and insightface's 1:N
evaluation (ijb_evals.py's image2template_feature and evaluation_1N, re-derived here loop for loop).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from eval.identification import (
    FPIRS,
    RANKS,
    det_curve,
    format_identification_table,
    gallery_row,
    mean_row,
    rank_counts,
    search_outcome,
    tpir_at_fpir,
)
from eval.ijb import face_features, template_features
from eval.ijb_1n import read_identification, search_galleries
from utils.errors import DataError

DIM = 16
G1_SUBJECTS = list(range(100, 106))
G2_SUBJECTS = list(range(106, 112))
PROBES_PER_SUBJECT = 4


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def synthetic_release(root, rng):
    """The meta files of a release with 12 subjects: gallery templates 1..12 (G1: subjects 100..105,
    G2: 106..111), 4 probe templates per subject (ids from 101); each template 1-3 faces in 1-2 media.
    Returns (faces: list of (template, media), face features, detector scores, template -> subject).

    Features: a subject's direction plus noise of a strength drawn per template, so that some mates are
    outranked; probe 101 (subject 100) is made nearer to subject 101 than to its own: its mate ranks 2."""
    directions = unit(rng.normal(size=(12, DIM)))
    subject_of = {template: subject for template, subject in enumerate(G1_SUBJECTS + G2_SUBJECTS, start=1)}
    probe = 101
    for subject in G1_SUBJECTS + G2_SUBJECTS:
        for _ in range(PROBES_PER_SUBJECT):
            subject_of[probe] = subject
            probe += 1
    faces, features = [], []
    media = 1000
    for template, subject in subject_of.items():
        noise = 0.2 if template <= 12 else rng.uniform(0.5, 3.0)
        for _ in range(rng.integers(1, 3)):
            media += 1
            for _ in range(rng.integers(1, 3)):
                direction = directions[subject - 100]
                if template == 101:
                    direction = 0.45 * direction + 0.9 * directions[1]
                faces.append((template, media))
                features.append(rng.uniform(0.5, 2.0) * (direction + noise * rng.normal(size=DIM) / np.sqrt(DIM)))
    os.makedirs(os.path.join(root, "meta"))
    with open(os.path.join(root, "meta", "ijbc_face_tid_mid.txt"), "w") as f:
        f.writelines(f"img/{i}.jpg {template} {media}\n" for i, (template, media) in enumerate(faces))

    def write_list(kind, templates):
        with open(os.path.join(root, "meta", f"ijbc_1N_{kind}.csv"), "w") as f:
            f.write("TEMPLATE_ID,SUBJECT_ID,FILENAME,SIGHTING_ID\n")
            for i, (template, _) in enumerate(faces):  # one line per image, as the release lists them
                if template in templates:
                    f.write(f"{template},{subject_of[template]},img/{i}.jpg,{i}\n")

    write_list("gallery_G1", range(1, 7))
    write_list("gallery_G2", range(7, 13))
    write_list("probe_mixed", range(101, probe))
    return faces, np.array(features), rng.uniform(0.6, 1.0, len(faces)), subject_of


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("IJBC"))
    faces, features, detector, subject_of = synthetic_release(root, np.random.default_rng(3))
    templates = np.array([t for t, _ in faces])
    medias = np.array([m for _, m in faces])
    lists = read_identification(root, "IJBC", templates, "face_tid_mid.txt")
    ids, pooled = template_features(face_features(features, detector), templates, medias)
    return {"root": root, "faces": faces, "features": features, "detector": detector, "subject_of": subject_of,
            "lists": lists, "searches": search_galleries(ids, pooled, lists)}


# --- the reference: brute force from the definitions --------------------------------------------------------


def pooled_by_loops(features, detector, faces):
    """Template -> unit feature: detector-weighted faces averaged per media, media summed."""
    by_template = {}
    for (template, media), feature, score in zip(faces, features, detector):
        by_template.setdefault(template, {}).setdefault(media, []).append(feature * score)
    return {template: unit(sum(np.mean(media, axis=0) for media in medias.values()))
            for template, medias in by_template.items()}


def brute_force(release, gallery_templates, fpirs):
    pooled = pooled_by_loops(release["features"], release["detector"], release["faces"])
    subject_of = release["subject_of"]
    enrolled = {subject_of[t]: t for t in gallery_templates}
    ranks, mate_scores, nonmated_tops = [], [], []
    for probe in sorted(t for t in subject_of if t > 100):
        scores = {t: float(np.dot(pooled[probe], pooled[t])) for t in gallery_templates}
        if subject_of[probe] in enrolled:
            mate = scores[enrolled[subject_of[probe]]]
            ranks.append(1 + sum(1 for t, s in scores.items() if s > mate))
            mate_scores.append(mate)
        else:
            nonmated_tops.append(max(scores.values()))
    results = {"rank": {k: sum(r <= k for r in ranks) / len(ranks) for k in RANKS}, "tpir": {}, "threshold": {}}
    for fpir in fpirs:
        # The highest threshold that at least max(int(n * fpir), 1) non-mated top scores reach.
        needed = max(int(len(nonmated_tops) * fpir), 1)
        threshold = max(t for t in nonmated_tops if sum(s >= t for s in nonmated_tops) >= needed)
        results["threshold"][fpir] = threshold
        results["tpir"][fpir] = sum(r == 1 and s > threshold for r, s in zip(ranks, mate_scores)) / len(ranks)
    curve = []
    for threshold in sorted(set(nonmated_tops), reverse=True):
        curve.append((sum(s > threshold for s in nonmated_tops) / len(nonmated_tops),
                      sum(r == 1 and s > threshold for r, s in zip(ranks, mate_scores)) / len(ranks)))
    curve.append((1.0, sum(r == 1 for r in ranks) / len(ranks)))
    return results, ranks, curve


GRID = FPIRS + (0.05, 0.2, 0.5)


@pytest.mark.parametrize("name, templates", [("G1", range(1, 7)), ("G2", range(7, 13))])
def test_each_gallery_equals_the_brute_force_computation(release, name, templates):
    want, ranks, curve = brute_force(release, list(templates), GRID)
    outcome = release["searches"][name].outcome
    assert outcome.mated == 24 and outcome.nonmated_top.size == 24
    assert sorted(outcome.mate_ranks.tolist()) == sorted(ranks)
    assert max(ranks) > 1 and min(ranks) == 1  # the fixture outranks some mates: ranks are tested
    got = tpir_at_fpir(outcome, GRID)
    for fpir in GRID:
        assert got[fpir][0] == pytest.approx(want["tpir"][fpir], abs=1e-12)
        assert got[fpir][1] == pytest.approx(want["threshold"][fpir], abs=1e-9)
    assert want["threshold"][0.01] != want["threshold"][0.1]  # 24 non-mated: the 1st and the 2nd highest
    assert gallery_row(outcome).rank == pytest.approx(want["rank"], abs=1e-12)
    fpir, tpir = det_curve(outcome)
    np.testing.assert_allclose(np.stack([fpir, tpir], 1), np.array(curve), atol=1e-12)


def test_the_probe_made_nearer_another_subject_ranks_its_mate_second(release):
    lists, outcome = release["lists"], release["searches"]["G1"].outcome
    mated_probes = lists.probes.templates[np.isin(lists.probes.subjects, lists.galleries["G1"].subjects)]
    assert outcome.mate_ranks[mated_probes.tolist().index(101)] == 2


# --- the reference: insightface's evaluation, re-derived ------------------------------------------------------


def upstream_image2template_feature(img_feats, templates, medias, choose_templates, choose_ids):
    unique_templates, indices = np.unique(choose_templates, return_index=True)
    unique_subjectids = choose_ids[indices]
    template_feats = np.zeros((len(unique_templates), img_feats.shape[1]))
    for count, uqt in enumerate(unique_templates):
        (ind_t,) = np.where(templates == uqt)
        face_feats, face_medias = img_feats[ind_t], medias[ind_t]
        unique_medias, counts = np.unique(face_medias, return_counts=True)
        media_feats = []
        for u, ct in zip(unique_medias, counts):
            (ind_m,) = np.where(face_medias == u)
            media_feats += [face_feats[ind_m]] if ct == 1 else [np.mean(face_feats[ind_m], 0, keepdims=True)]
        template_feats[count] = np.sum(np.array(media_feats), 0)
    return unit(template_feats), unique_templates, unique_subjectids


def upstream_evaluation_1n(query_feats, gallery_feats, query_ids, reg_ids, fars):
    similarity = np.dot(query_feats, gallery_feats.T)
    top_1, top_5, top_10 = 0, 0, 0
    pos_sims, neg_sims, non_gallery_sims = [], [], []
    for index, query_id in enumerate(query_ids):
        if query_id in reg_ids:
            gallery_label = np.argwhere(reg_ids == query_id)[0, 0]
            index_sorted = np.argsort(similarity[index])[::-1]
            top_1 += gallery_label in index_sorted[:1]
            top_5 += gallery_label in index_sorted[:5]
            top_10 += gallery_label in index_sorted[:10]
            pos_sims.append(similarity[index][reg_ids == query_id][0])
            neg_sims.append(similarity[index][reg_ids != query_id])
        else:
            non_gallery_sims.append(similarity[index])
    pos_sims, neg_sims, non_gallery_sims = np.array(pos_sims), np.array(neg_sims), np.array(non_gallery_sims)
    correct_pos_cond = pos_sims > neg_sims.max(1)
    non_gallery_sims_sorted = np.sort(non_gallery_sims.max(1))[::-1]
    recalls = []
    for far in fars:
        thresh = non_gallery_sims_sorted[max(int(non_gallery_sims_sorted.shape[0] * far) - 1, 0)]
        recalls.append(np.logical_and(correct_pos_cond, pos_sims > thresh).sum() / pos_sims.shape[0])
    return (top_1, top_5, top_10), recalls, pos_sims.shape[0]


def read_csv_columns(path):
    rows = np.loadtxt(path, dtype=str, skiprows=1, delimiter=",")
    return rows[:, 0].astype(int), rows[:, 1].astype(int)


def test_per_gallery_and_mean_rows_equal_insightfaces_evaluation(release):
    meta = os.path.join(release["root"], "meta")
    templates = np.array([t for t, _ in release["faces"]])
    medias = np.array([m for _, m in release["faces"]])
    img_feats = release["features"] * release["detector"][:, None]
    probe_feats, _, probe_ids = upstream_image2template_feature(
        img_feats, templates, medias, *read_csv_columns(os.path.join(meta, "ijbc_1N_probe_mixed.csv")))
    upstream = {}
    for name in ("G1", "G2"):
        gallery_feats, _, gallery_ids = upstream_image2template_feature(
            img_feats, templates, medias, *read_csv_columns(os.path.join(meta, f"ijbc_1N_gallery_{name}.csv")))
        upstream[name] = upstream_evaluation_1n(probe_feats, gallery_feats, probe_ids, gallery_ids, FPIRS)

    outcomes = [release["searches"][name].outcome for name in ("G1", "G2")]
    for name, outcome in zip(("G1", "G2"), outcomes):
        tops, recalls, mated = upstream[name]
        row = gallery_row(outcome)
        assert [row.tpir[fpir] for fpir in FPIRS] == pytest.approx(recalls, abs=1e-12)
        assert rank_counts(outcome) == dict(zip(RANKS, tops))
        assert outcome.mated == mated
    mean = mean_row(outcomes)
    query_num = probe_feats.shape[0]
    for i, k in enumerate(RANKS):
        assert mean.rank[k] == pytest.approx((upstream["G1"][0][i] + upstream["G2"][0][i]) / query_num, abs=1e-12)
    for i, fpir in enumerate(FPIRS):
        assert mean.tpir[fpir] == pytest.approx((upstream["G1"][1][i] + upstream["G2"][1][i]) / 2, abs=1e-12)


def test_ties_count_against_the_mate_and_the_table_prints_percentages():
    similarity = np.array([[0.5, 0.5, 0.1], [0.2, 0.9, 0.3], [0.4, 0.1, 0.0], [0.7, 0.2, 0.1]])
    outcome = search_outcome(similarity, probe_subjects=np.array([7, 8, 5, 6]), gallery_subjects=np.array([7, 8, 9]))
    assert outcome.mate_ranks.tolist() == [2, 1]  # probe 0 ties with entry 1: not identified at rank 1
    assert outcome.nonmated_top.tolist() == [0.4, 0.7]
    assert tpir_at_fpir(outcome) == {0.01: (0.5, 0.7), 0.1: (0.5, 0.7)}
    lines = format_identification_table({"r18-IJBC G1": gallery_row(outcome)}).splitlines()
    assert [cell.strip() for cell in lines[1].strip("|").split("|")] == [
        "Gallery", "TPIR@FPIR=0.01", "TPIR@FPIR=0.1", "Rank-1", "Rank-5", "Rank-10"]
    assert [cell.strip() for cell in lines[3].strip("|").split("|")] == [
        "r18-IJBC G1", "50.00", "50.00", "50.00", "100.00", "100.00"]
    with pytest.raises(ValueError, match="distinct"):
        search_outcome(similarity, np.array([7, 8, 5, 6]), np.array([7, 7, 9]))


# --- errors in the lists ------------------------------------------------------------------------------------


def rewrite(path, transform):
    with open(path) as f:
        lines = f.read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join(transform(lines)) + "\n")


@pytest.mark.parametrize("damage, message", [
    (lambda meta: os.remove(f"{meta}/ijbc_1N_gallery_G2.csv"),
     r"1:N list .*ijbc_1N_gallery_G2.csv does not exist; .*--protocol 11 alone"),
    (lambda meta: rewrite(f"{meta}/ijbc_1N_probe_mixed.csv", lambda lines: lines + ["999,100,x.jpg,1"]),
     r"template 999 of .*probe_mixed.csv has no images in face_tid_mid.txt"),
    (lambda meta: rewrite(f"{meta}/ijbc_1N_gallery_G1.csv", lambda lines: lines + ["1,105,x.jpg,1"]),
     r"gallery_G1.csv gives template 1 two subjects"),
    (lambda meta: rewrite(f"{meta}/ijbc_1N_gallery_G1.csv", lambda lines: lines + ["7,100,x.jpg,1"]),
     r"gallery_G1.csv enrols subject 100 in templates 1 and 7; a 1:N gallery holds one template per subject"),
    (lambda meta: rewrite(f"{meta}/ijbc_1N_gallery_G1.csv", lambda lines: lines[:3] + ["one,100"]),
     r"gallery_G1.csv line 4 does not start with TEMPLATE_ID,SUBJECT_ID"),
    (lambda meta: rewrite(f"{meta}/ijbc_1N_gallery_G1.csv", lambda lines: lines[:1]),
     r"gallery_G1.csv lists no template below its header"),
    (lambda meta: rewrite(f"{meta}/ijbc_1N_probe_mixed.csv",
                          lambda lines: [line for line in lines if line.split(",")[1] not in map(str, G2_SUBJECTS)]),
     r"has 24 of its 24 probe templates enrolled in .*gallery_G1.csv; open-set identification needs"),
])
def test_a_damaged_list_is_one_sentence_naming_the_file(tmp_path, damage, message):
    faces, *_ = synthetic_release(str(tmp_path), np.random.default_rng(3))
    damage(str(tmp_path / "meta"))
    with pytest.raises(DataError, match=message):
        read_identification(str(tmp_path), "IJBC", np.array([t for t, _ in faces]), "face_tid_mid.txt")
