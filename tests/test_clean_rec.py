"""tools.clean_rec: sub-center ArcFace's cleaning of noisy labels, checked against a direct numpy computation of
the dominant sub-centres and the angles from the checkpoint read by torch's own DCP converter and the records
decoded by Pillow; every record in the report; the cleaned .rec read back record by record; the same cleaning
from one process and from two, of a checkpoint two processes wrote; one error line for each wrong input."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dataset import InsightfaceWriter, RecordReader, build_dataset, encode, render_faces, unpack
from eval.label_noise import judge
from gpu_acceptance.runs import load_backbone_strict
from tests.run_helpers import run_cli, run_command, run_here
from tools import clean_rec

K = 3


@pytest.fixture(scope="module")
def subcenter_run(data, tmp_path_factory) -> Path:
    """A sub-center run (K = 3) of 5 steps that two processes trained and saved: its centres in two shards."""
    output = tmp_path_factory.mktemp("clean") / "run"
    result = run_cli(data, output, "margin_family=subcenter", f"subcenter_k={K}", "num_epoch=1", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


def reference(run: Path, data: Path, tmp_path: Path) -> dict:
    """Every record's angle to its class's dominant sub-centre, computed directly: the centres assembled by torch's
    DCP converter, the views decoded by Pillow and embedded by the backbone loaded strictly, the rest numpy."""
    folder = run / json.loads((run / "checkpoint.json").read_text())["directory"]
    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    centres = torch.load(tmp_path / "whole.pt", weights_only=True)["centres"].double().numpy()
    centres = centres / np.linalg.norm(centres, axis=1, keepdims=True)
    centres = centres.reshape(-1, K, centres.shape[1])
    backbone = load_backbone_strict(folder / "backbone.pth").eval()
    reader = RecordReader(str(data / "train.idx"), str(data / "train.rec"))
    first_identity = int(unpack(reader.read(0))[0].label[0])
    keys, labels, views = [], [], []
    for key in range(1, first_identity):
        header, payload = unpack(reader.read(key))
        image = np.asarray(Image.open(io.BytesIO(payload)).convert("RGB"), dtype=np.float32)  # (112, 224, 3)
        keys.append(key)
        labels.append(int(header.label))
        views += [image[:, :112], image[:, 112:]]
    pixels = torch.from_numpy((np.stack(views) / 255 - 0.5) / 0.5).permute(0, 3, 1, 2).float()
    with torch.no_grad():
        embeddings = backbone(pixels).double().numpy().reshape(len(keys), 2, -1)
    embeddings /= np.linalg.norm(embeddings, axis=2, keepdims=True)
    records = embeddings.mean(axis=1)
    records /= np.linalg.norm(records, axis=1, keepdims=True)
    labels = np.array(labels)
    nearest = np.array([np.argmax(centres[c] @ x) for c, x in zip(labels, records)])
    dominant = np.array([np.bincount(nearest[labels == c], minlength=K).argmax() for c in range(len(centres))])
    centre = centres[labels, dominant[labels]]
    return {"keys": keys, "labels": labels, "nearest": nearest, "dominant": dominant[labels],
            "angle": np.degrees(np.arccos(np.sum(records * centre, axis=1))),
            "view_angles": np.degrees(np.arccos(np.einsum("nvd,nd->nv", embeddings, centre)))}


def a_threshold_that_empties_classes(angle: np.ndarray, labels: np.ndarray) -> float:
    """Between the closest records of two classes, so that about half the classes keep no record."""
    closest = np.sort([angle[labels == c].min() for c in np.unique(labels)])
    middle = len(closest) // 2
    return float(closest[middle - 1] + closest[middle]) / 2


def report_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / clean_rec.REPORT).read_text().splitlines()]


@pytest.fixture(scope="module")
def cleaned(subcenter_run, data, tmp_path_factory) -> tuple[Path, dict, float]:
    """The run's cleaning in one process at an angle that empties classes, and the reference it is held to."""
    tmp = tmp_path_factory.mktemp("cleaned")
    expected = reference(subcenter_run, data, tmp)
    angle = a_threshold_that_empties_classes(expected["angle"], expected["labels"])
    assert clean_rec.main([str(subcenter_run), str(data), str(tmp / "out"), "--angle", str(angle), "--workers", "0",
                           "--batch-size", "7"]) == 0
    return tmp / "out", expected, angle


def test_the_angles_equal_a_direct_computation_and_every_record_is_reported(cleaned):
    out, expected, angle = cleaned
    report = report_of(out)
    assert [line["key"] for line in report] == expected["keys"]
    assert [line["label"] for line in report] == expected["labels"].tolist()
    np.testing.assert_allclose([line["angle"] for line in report], expected["angle"], atol=1e-3)
    np.testing.assert_allclose([line["view_angles"] for line in report], expected["view_angles"], atol=1e-3)
    assert [line["nearest"] for line in report] == expected["nearest"].tolist()
    assert [line["dominant"] for line in report] == expected["dominant"].tolist()
    assert [line["kept"] for line in report] == (expected["angle"] < angle).tolist()
    kept_classes = sorted({label for label, angle_ in zip(expected["labels"], expected["angle"]) if angle_ < angle})
    assert 0 < len(kept_classes) < len(set(expected["labels"]))  # classes were left empty, and dropped
    new = {old: index for index, old in enumerate(kept_classes)}
    assert [line["new_label"] for line in report] == [new[line["label"]] if line["kept"] else None for line in report]
    assert sorted(line["new_key"] for line in report if line["kept"]) == list(range(1, sum(expected["angle"] < angle)
                                                                                     + 1))
    assert (out / clean_rec.HISTOGRAM).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cleaned_rec_reads_back_with_the_kept_records_and_new_labels(cleaned, data):
    out, _, _ = cleaned
    report = report_of(out)
    kept = [line for line in report if line["kept"]]
    original = RecordReader(str(data / "train.idx"), str(data / "train.rec"))
    written = RecordReader(str(out / "train.idx"), str(out / "train.rec"))
    header = unpack(written.read(0))[0]
    first_identity, end = int(header.label[0]), int(header.label[1])
    assert header.flag > 0 and first_identity == len(kept) + 1
    assert end - first_identity == len({line["new_label"] for line in kept})
    for line in kept:
        new_header, payload = unpack(written.read(line["new_key"]))
        assert payload == unpack(original.read(line["key"]))[1]  # the image bytes as they were
        assert int(new_header.label) == line["new_label"]
    for identity, key in enumerate(range(first_identity, end)):
        start, stop = (int(value) for value in unpack(written.read(key))[0].label[:2])
        assert sorted(line["new_key"] for line in kept if line["new_label"] == identity) == list(range(start, stop))
    dataset = build_dataset(str(out), num_views=2, flip=False)
    assert (len(dataset), dataset.num_classes) == (len(kept), end - first_identity)
    assert (out / "synthetic_val.bin").resolve() == (data / "synthetic_val.bin").resolve()


def test_two_processes_clean_as_one(cleaned, subcenter_run, data, tmp_path):
    out, _, angle = cleaned
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "tools.clean_rec", str(subcenter_run), str(data), str(tmp_path / "out"), "--angle",
                          str(angle), "--workers", "0"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("train.rec", "train.idx"):
        assert (tmp_path / "out" / name).read_bytes() == (out / name).read_bytes(), name
    # the angles to float32's rounding: one process embedded 7 records at a time, these 20 (a class range each)
    one, two = report_of(out), report_of(tmp_path / "out")
    np.testing.assert_allclose([line.pop("angle") for line in two], [line.pop("angle") for line in one], atol=1e-3)
    np.testing.assert_allclose([line.pop("view_angles") for line in two], [line.pop("view_angles") for line in one],
                               atol=1e-3)
    assert two == one


def test_dominant_subcentres_and_angles_by_hand():
    """Class 0: two records nearest sub-centre 1, one nearest 0, so 1 dominates; class 1: a record as near to both
    (the lower taken) and one nearest 1, a tie of votes, which goes to the lower sub-centre, as numpy's argmax."""
    centres = np.array([[[1, 0], [0, 1]], [[1, 0], [0, 1]]], dtype=np.float64)
    records = np.array([[0, 1], [0.2, 1], [1, 0], [1, 1], [0, 1]], dtype=np.float64)
    classes = np.array([0, 0, 0, 1, 1])
    record_cos = np.array([centres[c] @ (x / np.linalg.norm(x)) for c, x in zip(classes, records)])
    judged = judge(record_cos, record_cos[:, None, :], classes, 2)
    assert judged.nearest.tolist() == [1, 1, 0, 0, 1]
    assert judged.dominant.tolist() == [1, 0]
    np.testing.assert_allclose(judged.angle, [0, np.degrees(np.arctan(0.2)), 90, 45, 90])
    np.testing.assert_allclose(judged.view_angles[:, 0], judged.angle)


# --- one error line each ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def combined_run(data, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("combined") / "run"
    assert run_here(data, output, "max_steps=1") == (0, "")
    return output


def other_records(folder: Path, identities: int, per_identity: int) -> Path:
    faces = render_faces(range(identities * per_identity), 0, seed=3)
    with InsightfaceWriter(str(folder)) as writer:
        for identity in range(identities):
            writer.write_identity([encode(np.concatenate([face, face], axis=1))
                                   for face in faces[identity * per_identity:(identity + 1) * per_identity]])
    return folder


def one_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as stopped:
        clean_rec.main([*map(str, args), "--workers", "0"])
    assert stopped.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_errors_are_one_line(subcenter_run, combined_run, data, tmp_path, capsys):
    line = one_error(capsys, combined_run, data, tmp_path / "a")
    assert f"{combined_run} was trained with margin_family='combined'" in line and "subcenter" in line
    line = one_error(capsys, subcenter_run, other_records(tmp_path / "seven", 7, 1), tmp_path / "b")
    assert "holds 7 classes, but" in line and "trained on 20" in line
    line = one_error(capsys, subcenter_run, other_records(tmp_path / "one_each", 20, 1), tmp_path / "c")
    assert "holds 20 records, but" in line and "5 steps an epoch of 4 records on each of 2 processes" in line
    line = one_error(capsys, tmp_path, data, tmp_path / "d")
    assert f"{tmp_path} holds no checkpoint.json" in line
    line = one_error(capsys, subcenter_run, data, data)
    assert "is the folder of the records being cleaned" in line
    assert not any((tmp_path / name).exists() for name in "abcd")
