"""tools.make_bin: verification sets from a photo folder, read back as arcface_torch reads them.

References: arcface_torch's load_bin written out here (pickle.load with encoding="bytes", each entry
decoded as mx.image.imdecode does: RGB, HWC uint8; PIL stands in for mxnet), the photo files' own
bytes, and PIL's own resize of them.
"""
from __future__ import annotations

import io
import json
import pickle
import re
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from eval.folds import verification_folds
from eval.verification import load_bin
from tools import make_bin

# name -> [(size, file format)] of photos name_0001.jpg, name_0002.jpg, ... (LFW's names, any format).
PEOPLE = {
    "Ann_Lee": [((112, 112), "JPEG"), ((112, 112), "PNG"), ((150, 150), "JPEG")],
    "Bo_Chen": [((112, 112), "JPEG"), ((128, 128), "BMP")],
    "Cy_Dorn": [((112, 112), "PNG")],
}
PAIRS_TXT = """2\t2
Ann_Lee\t1\t2
Bo_Chen\t1\t2
Ann_Lee\t1\tBo_Chen\t2
Cy_Dorn\t1\tAnn_Lee\t3
Ann_Lee\t2\t3
Ann_Lee\t3\t1
Bo_Chen\t1\tCy_Dorn\t1
Ann_Lee\t2\tBo_Chen\t1
"""


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for name, kinds in PEOPLE.items():
        (root / name).mkdir()
        for number, ((width, height), file_format) in enumerate(kinds, 1):
            yy, xx = np.mgrid[0:height, 0:width]  # smooth, so JPEG keeps it close
            pixels = np.stack([xx * 255 // width, yy * 255 // height, np.full_like(xx, rng.integers(256))], -1)
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{name}_{number:04d}.jpg", format=file_format)
    return root


def upstream_load_bin(path, image_size=(112, 112)):
    """arcface_torch's eval/verification.py load_bin, line for line, PIL in place of mx.image.imdecode."""
    with open(path, "rb") as f:
        bins, issame_list = pickle.load(f, encoding="bytes")
    data_list = [torch.empty((len(issame_list) * 2, 3, image_size[0], image_size[1])) for _ in (0, 1)]
    for idx in range(len(issame_list) * 2):
        img = np.asarray(Image.open(io.BytesIO(bins[idx])).convert("RGB"))  # mx.image.imdecode: RGB, HWC
        assert img.shape[1] == image_size[0]  # else upstream would resize_short: make_bin stores 112x112
        img = img.transpose(2, 0, 1)
        for flip in (0, 1):
            if flip == 1:
                img = img[:, :, ::-1]
            data_list[flip][idx][:] = torch.from_numpy(img.copy())
    return data_list, issame_list, bins


def photo(root, name, number):
    return root / name / f"{name}_{number:04d}.jpg"


def test_pairs_file_makes_a_bin_that_upstream_and_we_read_alike(photos, tmp_path, capsys):
    (tmp_path / "pairs.txt").write_text(PAIRS_TXT)
    out = tmp_path / "mine.bin"
    assert make_bin.main([str(photos), str(out), "--pairs", str(tmp_path / "pairs.txt")]) == 0
    assert "wrote" in capsys.readouterr().out

    (original, flipped), issame, bins = upstream_load_bin(out)
    rows = [line.split("\t") for line in PAIRS_TXT.splitlines()[1:]]
    assert issame == [len(row) == 3 for row in rows] and all(type(flag) is bool for flag in issame)
    files = []
    for row in rows:
        if len(row) == 3:
            files += [photo(photos, row[0], int(row[1])), photo(photos, row[0], int(row[2]))]
        else:
            files += [photo(photos, row[0], int(row[1])), photo(photos, row[2], int(row[3]))]
    assert len(bins) == len(files) and all(type(entry) is bytes for entry in bins)
    for entry, path, image in zip(bins, files, original):
        with Image.open(path) as source:
            size, file_format, rgb = source.size, source.format, source.convert("RGB")
        if size == (112, 112) and file_format in ("JPEG", "PNG"):
            assert entry == path.read_bytes(), path  # stored byte for byte
            continue
        want = np.asarray(rgb.resize((112, 112), Image.BILINEAR)).transpose(2, 0, 1)
        got = image.numpy()
        if file_format == "JPEG":  # re-encoded as JPEG: close, not equal
            assert entry[:2] == b"\xff\xd8" and np.abs(got - want).mean() < 2, path
        else:  # lossless sources stay lossless
            assert entry[:8] == b"\x89PNG\r\n\x1a\n" and np.array_equal(got, want), path

    (ours, ours_flipped), our_issame = load_bin(str(out))
    assert our_issame == issame
    assert torch.equal(ours.float(), original) and torch.equal(ours_flipped.float(), flipped)


def test_random_pairs_are_distinct_balanced_alternating_and_seeded(tmp_path):
    # Every photo a distinct 112x112 PNG, stored byte for byte: a pair's images name their files.
    # Ann_Lee 3 photos (3 pairs) and Bo_Chen 2 (1 pair): exactly 4 same-person pairs exist; ask for all.
    root, owner = tmp_path / "faces", {}
    rng = np.random.default_rng(1)
    for name, count in (("Ann_Lee", 3), ("Bo_Chen", 2), ("Cy_Dorn", 1)):
        (root / name).mkdir(parents=True)
        for number in range(1, count + 1):
            path = photo(root, name, number)
            Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(path, format="PNG")
            owner[path.read_bytes()] = (name, number)

    out = tmp_path / "random.bin"
    assert make_bin.main([str(root), str(out), "--random", "4", "--seed", "3"]) == 0
    with open(out, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    assert issame == [True, False] * 4
    pairs = [(owner[a], owner[b]) for a, b in zip(bins[0::2], bins[1::2])]
    for (first, second), same in zip(pairs, issame):
        assert (first[0] == second[0]) == same and first != second
    assert len({frozenset(pair) for pair, same in zip(pairs, issame) if same}) == 4  # all four, none twice
    assert len({frozenset(pair) for pair, same in zip(pairs, issame) if not same}) == 4

    again = tmp_path / "again.bin"
    assert make_bin.main([str(root), str(again), "--random", "4", "--seed", "3"]) == 0
    assert again.read_bytes() == out.read_bytes()
    assert make_bin.main([str(root), str(tmp_path / "other.bin"), "--random", "4", "--seed", "4"]) == 0
    assert (tmp_path / "other.bin").read_bytes() != out.read_bytes()


def test_every_same_person_pair_is_equally_likely(photos):
    # Ann_Lee has 3 of the 4 same-person pairs: drawn 3/4 of the time (a uniform identity would give 1/2).
    counts = Counter(make_bin.random_pairs(photos, 1, seed)[0][0].parent.name for seed in range(400))
    assert 260 < counts["Ann_Lee"] < 340 and counts["Ann_Lee"] + counts["Bo_Chen"] == 400


def one_sentence(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        make_bin.main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 1 and len(errors) == 1 and "Traceback" not in err, err
    message = errors[0][len("error: "):]
    assert "; " in message and not message[0].isupper() and not message.endswith("."), message
    return message


@pytest.mark.parametrize("pairs_txt, message", [
    ("1 1\nAnn_Lee 1 2\nAnn_Lee 1 Zed_Q 1\n", r"line 3 names photo 1 of Zed_Q, but .*Zed_Q_0001\.jpg does not exist"),
    ("1 1\nAnn_Lee 1 2\nAnn_Lee 1 Bo_Chen 2 7\n", "line 3 has 5 fields"),
    ("1 1\nAnn_Lee 1 2\nAnn_Lee 1 Bo_Chen x\n", "photo number 'x' is not a whole number"),
    ("10 300\nAnn_Lee 1 2\n", "lists 1 pairs but its header promises 6000"),
    ("ten\nAnn_Lee 1 2\n", "the first line must be 'folds pairs_per_fold'"),
    ("", "is empty"),
])
def test_a_bad_pairs_file_is_one_sentence_naming_the_line(photos, tmp_path, capsys, pairs_txt, message):
    (tmp_path / "pairs.txt").write_text(pairs_txt)
    found = one_sentence(capsys, [str(photos), str(tmp_path / "x.bin"), "--pairs", str(tmp_path / "pairs.txt")])
    assert re.search(message, found), found
    assert not (tmp_path / "x.bin").exists()


def test_refusals_are_one_sentence_and_nothing_is_overwritten(photos, tmp_path, capsys):
    odd = tmp_path / "odd"
    (odd / "Ann_Lee").mkdir(parents=True)
    Image.new("RGB", (112, 150)).save(odd / "Ann_Lee" / "Ann_Lee_0001.jpg")
    Image.new("RGB", (112, 112)).save(odd / "Ann_Lee" / "Ann_Lee_0002.jpg")
    (tmp_path / "pairs.txt").write_text("1\nAnn_Lee 1 2\nAnn_Lee 2 1\n")
    # 1 count: 2 pairs, the second a same-person line too (a header says nothing of the kinds).
    (odd / "Ann_Lee" / "Ann_Lee_0001.jpg").write_bytes(b"\xff\xd8 truncated")
    assert f"cannot read image {odd / 'Ann_Lee' / 'Ann_Lee_0001.jpg'} (" in one_sentence(
        capsys, [str(odd), str(tmp_path / "x.bin"), "--pairs", str(tmp_path / "pairs.txt")])

    existing = tmp_path / "keep.bin"
    existing.write_bytes(b"keep me")
    assert "keep.bin already exists; pass --force" in one_sentence(
        capsys, [str(photos), str(existing), "--random", "2"])
    assert existing.read_bytes() == b"keep me"
    assert make_bin.main([str(photos), str(existing), "--random", "2", "--force"]) == 0
    assert load_bin(str(existing))[1] == [True, False, True, False]

    assert "allows 4 same-person and" in one_sentence(capsys, [str(photos), str(tmp_path / "y.bin"), "--random", "5"])
    assert "--random 0 is not a positive number" in one_sentence(
        capsys, [str(photos), str(tmp_path / "y.bin"), "--random", "0"])
    assert "missing does not exist" in one_sentence(capsys, [str(tmp_path / "missing"), str(tmp_path / "y.bin"),
                                                             "--random", "1"])


def padded(path) -> np.ndarray:
    """A 140x112 photo as --pad must store it, computed straight with PIL: shrunk to 112x90, centred on black."""
    image = Image.open(path).convert("RGB").resize((112, 90), Image.BILINEAR)
    canvas = np.zeros((112, 112, 3), np.uint8)
    canvas[11:101] = np.asarray(image)
    return canvas


def cropped(path) -> np.ndarray:
    """The same photo as --crop must store it: its centred 112x112 square (no resizing needed)."""
    return np.asarray(Image.open(path).convert("RGB"))[:, 14:126]


def test_a_bin_beside_packed_records_is_prepared_as_they_were_unless_told_otherwise(tmp_path, capsys):
    photos = tmp_path / "photos_val"
    rng = np.random.default_rng(1)
    for name in ("s21", "s22"):
        (photos / name).mkdir(parents=True)
        for number in (1, 2):
            Image.fromarray(rng.integers(0, 256, (112, 140, 3), dtype=np.uint8)).save(photos / name / f"{number}.png")
    (photos / "s23").mkdir()  # an empty person folder
    data = tmp_path / "data"
    data.mkdir()
    # What tools.pack_rec leaves beside the train.rec of photos packed with --pad.
    (data / "train.rec.preparation.json").write_text('{"photo_preparation": "pad", "people": ["s1", "s2", "s21"]}')

    assert make_bin.main([str(photos), str(data / "val.bin"), "--random", "2"]) == 0
    out, err = capsys.readouterr()
    assert f"photos prepared with --pad, as {data / 'train.rec'} records (another option overrides it)" in out
    assert f"skipped 1 sub-folder(s) of {photos} without images (a format Pillow reads: .jpg, .png, .webp, .bmp, " \
           ".tif, .pgm, ...): s23" \
           in out.splitlines()
    assert "every one of the 4 photos prepared (pad to 112x112) and re-encoded" in out and "warning" not in err
    with open(data / "val.bin", "rb") as f:
        bins, _ = pickle.load(f)
    files = {Image.open(io.BytesIO(entry)).tobytes(): entry for entry in bins}
    expected = {padded(path).tobytes() for path in sorted(photos.glob("*/*.png"))}
    assert set(files) == expected  # lossless PNG: every stored face is exactly the padded photo
    assert (f"note: 1 of the 2 people in this set are among the people {data / 'train.rec'} was packed from (e.g. "
            "s21): it does not measure faces the model has never seen, and tools.inference prefers a set of people "
            "kept out of training") in out.splitlines()
    recorded = json.loads((data / "val.bin.preparation.json").read_text())
    assert recorded["photo_preparation"] == "pad" and recorded["people_in_training"] == 1

    assert make_bin.main([str(photos), str(data / "crop.bin"), "--random", "2", "--crop"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("warning")] == [
        f"warning: --crop given, but {data / 'train.rec'} records --pad, the preparation of the photos the model was "
        "trained on; faces prepared otherwise score worse: drop --crop to use --pad"]
    with open(data / "crop.bin", "rb") as f:
        bins, _ = pickle.load(f)
    assert {Image.open(io.BytesIO(entry)).tobytes() for entry in bins} == {
        cropped(path).tobytes() for path in sorted(photos.glob("*/*.png"))}
    assert '"photo_preparation": "crop"' in (data / "crop.bin.preparation.json").read_text()


def test_the_summary_says_how_many_photos_were_stored_as_they_were(photos, tmp_path, capsys):
    (tmp_path / "pairs.txt").write_text(PAIRS_TXT)
    assert make_bin.main([str(photos), str(tmp_path / "mine.bin"), "--pairs", str(tmp_path / "pairs.txt")]) == 0
    # Ann_Lee_0003 (150x150) and Bo_Chen_0002 (a BMP) are prepared; the four 112x112 JPEG/PNG files are not.
    assert ("2 of 6 photos prepared (resize to 112x112) and re-encoded, the others already 112x112, stored as they "
            "were") in capsys.readouterr().out
    square = tmp_path / "square"
    for name in ("a", "b"):
        (square / name).mkdir(parents=True)
        for number in (1, 2):
            Image.new("RGB", (112, 112), (number * 60, 0, 0)).save(square / name / f"{number}.png")
    assert make_bin.main([str(square), str(tmp_path / "square.bin"), "--random", "1"]) == 0
    assert re.search(r"4 images, every one of the [34] photos already 112x112, stored as it was$",
                     capsys.readouterr().out.splitlines()[0])


def test_a_single_count_pairs_file_is_laid_out_as_ten_folds_holding_both_kinds(photos, tmp_path):
    """pairsDevTest's layout (N same-person lines, then N different): 10 blocks of N/10 same then N/10 different,
    each kind in file order, so that evaluation's contiguous folds are arcface_torch's and each holds both."""
    same = [("Ann_Lee", a, b) for a, b in [(1, 2), (1, 3), (2, 3), (2, 1)] * 5]
    different = [("Ann_Lee", a, "Bo_Chen", b) for a, b in [(1, 1), (1, 2), (2, 1), (3, 2)] * 5]
    lines = ["\t".join(map(str, fields)) for fields in same + different]
    (tmp_path / "pairs.txt").write_text("20\n" + "\n".join(lines) + "\n")
    pairs, said = make_bin.read_pairs(tmp_path / "pairs.txt", photos)
    assert said.endswith("laid out as LFW's pairs.txt is, in folds of same-person then different-person pairs, so "
                         "that each evaluation fold holds both kinds")
    assert [flag for _, _, flag in pairs] == [True, True, False, False] * 10
    assert [(a, b) for a, b, flag in pairs if flag] == [
        (photo(photos, name, first), photo(photos, name, second)) for name, first, second in same]
    assert [(a, b) for a, b, flag in pairs if not flag] == [
        (photo(photos, name1, first), photo(photos, name2, second)) for name1, first, name2, second in different]
    assert verification_folds(np.array([flag for _, _, flag in pairs]), 10).note is None
