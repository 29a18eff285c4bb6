"""--skip-bad in tools.pack_rec, tools.make_bin and tools.search (issue 54, item 4): every photo that cannot be read
is left out and named once at the end, the output written whole or not at all; without it the first such photo
stops the job in one line, leaving nothing written.

References: the photos the test wrote (which ones it damaged), the records read back with RecordReader, the .bin
unpickled here, and the pairs the test listed.
"""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from dataset import RecordReader, render_faces, unpack
from tests.test_export_inference import trained_like
from tools import make_bin, pack_rec, search

PEOPLE = ["Ann", "Bob", "Cid"]
BAD = {"Ann/Ann_0002.jpg": b"not a photo at all", "Cid/Cid_0001.jpg": None}  # None: a truncated JPEG


@pytest.fixture()
def photos(tmp_path):
    """Three people with three photos each, two of them damaged (named in BAD)."""
    root = tmp_path / "photos"
    for identity, person in enumerate(PEOPLE):
        (root / person).mkdir(parents=True)
        for number, face in enumerate(render_faces(identity, np.arange(3), seed=0), 1):
            Image.fromarray(face).save(root / person / f"{person}_{number:04d}.jpg", quality=90)
    for name, content in BAD.items():
        path = root / name
        path.write_bytes(content if content is not None else path.read_bytes()[:300])
    return root


def error_line(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def assert_each_bad_photo_named_once(err, root):
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"warning: --skip-bad left out {len(BAD)} photo(s) that could not be prepared: ")
    for name in BAD:
        assert last.count(f"cannot read image {root / name} (") == 1, last
    assert "replace or remove it" not in last  # each sentence's advice is said once, not per photo


def test_pack_rec_skips_bad_photos_and_names_each_once_at_the_end(photos, tmp_path, capsys):
    out = tmp_path / "data"
    first = sorted(BAD)[0]
    assert f"cannot read image {photos / first}" in error_line(capsys, pack_rec.main,
                                                               [str(photos), str(out), "--workers", "1"])
    assert not out.exists()  # nothing half-written
    assert pack_rec.main([str(photos), str(out), "--workers", "1", "--skip-bad", "--views", "2"]) == 0
    captured = capsys.readouterr()
    assert_each_bad_photo_named_once(captured.err, photos)
    reader = RecordReader(str(out / "train.idx"), str(out / "train.rec"))
    header, _ = unpack(reader.read(0))
    labels = [unpack(reader.read(key))[0].label for key in range(1, int(header.label[0]))]
    # Records of two views: ceil(readable photos / 2) per person (3 photos but one bad: 1), classes in name order.
    readable = [3 - sum(name.startswith(person) for name in BAD) for person in PEOPLE]
    assert labels == [float(label) for label, count in enumerate(readable) for _ in range(-(-count // 2))]
    recorded = json.loads((out / "train.rec.preparation.json").read_text())
    assert recorded["people"] == PEOPLE


def test_pack_rec_leaves_out_a_person_the_bad_photos_leave_too_few(photos, tmp_path, capsys):
    out = tmp_path / "data"
    assert pack_rec.main([str(photos), str(out), "--workers", "1", "--skip-bad", "--views", "3"]) == 0
    captured = capsys.readouterr()
    assert "left out 2 identities with fewer than 3 readable images: Ann, Cid" in captured.out
    assert "1 identities (classes 0..0)" in captured.out
    assert json.loads((out / "train.rec.preparation.json").read_text())["people"] == ["Bob"]


def test_make_bin_leaves_out_the_pairs_of_bad_photos(photos, tmp_path, capsys):
    lines = ["Ann 1 2", "Ann 1 Bob 1", "Bob 1 3", "Bob 2 Cid 2", "Cid 2 3", "Ann 3 Cid 1", "Bob 2 3", "Ann 1 Cid 3"]
    (tmp_path / "pairs.txt").write_text("\n".join(["4", *lines]) + "\n")  # 4: 2 x 4 pairs follow
    out = tmp_path / "val.bin"
    argv = [str(photos), str(out), "--pairs", str(tmp_path / "pairs.txt")]
    assert f"cannot read image {photos / 'Ann/Ann_0002.jpg'}" in error_line(capsys, make_bin.main, argv)
    assert not out.exists() and not list(tmp_path.glob(".val.bin*"))
    assert make_bin.main([*argv, "--skip-bad"]) == 0
    err = capsys.readouterr().err
    assert_each_bad_photo_named_once(err, photos)
    assert err.strip().endswith(f"; the 2 pair(s) holding them are not in {out}")
    with open(out, "rb") as f:
        bins, issame = pickle.load(f)
    kept = [line.split() for index, line in enumerate(lines) if index not in (0, 5)]  # Ann 2 and Cid 1
    assert issame == [len(fields) == 3 for fields in kept]
    expected = []
    for fields in kept:
        names = [fields[0], fields[0]] if len(fields) == 3 else [fields[0], fields[2]]
        numbers = fields[1:] if len(fields) == 3 else [fields[1], fields[3]]
        expected += [(photos / name / f"{name}_{int(number):04d}.jpg").read_bytes() for name, number in
                     zip(names, numbers)]
    assert bins == expected  # 112x112 JPEGs are stored byte for byte


def test_search_skips_bad_gallery_photos_and_queries(photos, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    torch.save(trained_like("r18", 0.25).state_dict(), run / "backbone.pth")
    (run / "model.json").write_text(json.dumps({"network": "r18", "network_kwargs": {"width_mult": 0.25},
                                                "embedding_size": 512, "num_classes": 3}))
    (photos / "Cid" / "Cid_0002.jpg").write_bytes(b"")
    (photos / "Cid" / "Cid_0003.jpg").write_bytes(b"")  # every photo of Cid unreadable now
    query, bad_query = photos / "Bob" / "Bob_0001.jpg", tmp_path / "bad.jpg"
    bad_query.write_bytes(b"junk")
    argv = ["--model", str(run), "--gallery", str(photos), str(query)]
    assert f"cannot read image {photos / 'Ann/Ann_0002.jpg'}" in error_line(capsys, search.main, argv)
    assert not (tmp_path / "photos.gallery.npz").exists()
    assert search.main([*argv, str(bad_query), "--skip-bad"]) == 0
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    named = [str(photos / name) for name in ("Ann/Ann_0002.jpg", "Cid/Cid_0001.jpg", "Cid/Cid_0002.jpg",
                                              "Cid/Cid_0003.jpg")] + [str(bad_query)]
    assert last.startswith("warning: --skip-bad left out 5 photo(s) that could not be prepared: ")
    assert all(last.count(f"cannot read image {name} (") == 1 for name in named), last
    # Cid, without a readable photo, is left out of the gallery.
    assert "gallery: 2 people (5 photos, 4 left out by --skip-bad)" in captured.err
    assert f"{query}:" in captured.out and f"{bad_query}:" not in captured.out
    # A later search reuses the file and names the photos it was built without again.
    assert search.main([*argv, "--skip-bad"]) == 0
    err = capsys.readouterr().err
    assert "gallery: 2 people from" in err and err.strip().splitlines()[-1].count("image " + named[3]) == 1
