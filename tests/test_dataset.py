"""The face dataset: views from records, identities and augmentation; errors naming file and record."""
from __future__ import annotations

import io
import json
import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import decode_jpeg

from dataset import RecordReader, RecordWriter, build_dataset, pack, unpack
from utils.errors import DataError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "recordio")
MANIFEST = json.load(open(os.path.join(FIXTURES, "expected.json")))["files"]
PAIRS = os.path.join(FIXTURES, "pairs.rec")
FLAT = os.path.join(FIXTURES, "flat.rec")


def fixture_images(name: str) -> dict[int, tuple[torch.Tensor, int]]:
    """key -> (decoded (3, H, W) image, label) straight from torchvision, for the manifest's image records."""
    reader = RecordReader(os.path.join(FIXTURES, f"{name}.idx"), os.path.join(FIXTURES, f"{name}.rec"))
    out = {}
    for record in MANIFEST[name]["records"]:
        if "decoded_rgb_sum" in record:
            payload = unpack(reader.read(record["key"]))[1]
            out[record["key"]] = (decode_jpeg(torch.frombuffer(bytearray(payload), dtype=torch.uint8)),
                                  int(record["label"]))
    return out


def test_pairs_fixture_gives_two_crops_with_labels_and_class_count():
    ds = build_dataset(PAIRS, num_views=2, flip=False)
    expected = fixture_images("pairs")
    assert ds.num_classes == MANIFEST["pairs"]["num_classes"] == 4
    assert len(ds) == MANIFEST["pairs"]["num_images"] == len(expected)
    for index, key in enumerate(sorted(expected)):
        image, label = expected[key]
        views, got_label = ds[index]
        assert views.dtype == torch.uint8 and views.shape == (2, 3, 112, 112)
        assert got_label.dtype == torch.int64 and got_label.ndim == 0 and int(got_label) == label
        assert torch.equal(views[0], image[:, :, :112]) and torch.equal(views[1], image[:, :, 112:])


def test_folder_path_and_rec_path_read_the_same(tmp_path):
    for name in ("train.rec", "train.idx"):
        os.symlink(os.path.join(FIXTURES, "pairs" + name[5:]), tmp_path / name)
    by_folder, by_file = build_dataset(str(tmp_path), num_views=2), build_dataset(PAIRS, num_views=2)
    for i in range(len(by_file)):
        assert all(torch.equal(a, b) for a, b in zip(by_folder[i], by_file[i]))


def test_flat_fixture_without_identity_table():
    ds = build_dataset(FLAT, num_views=1, flip=False)
    expected = fixture_images("flat")
    assert len(ds) == 6 and ds.num_classes == 1 + max(label for _, label in expected.values())
    for index, key in enumerate(sorted(expected)):
        views, label = ds[index]
        assert torch.equal(views[0], expected[key][0]) and int(label) == expected[key][1]


def test_flip_is_per_view_deterministic_and_depends_on_epoch():
    plain = build_dataset(PAIRS, num_views=2, flip=False)
    flipping = build_dataset(PAIRS, num_views=2, flip=True, seed=3)
    decisions = []
    for epoch in range(6):
        for i in range(len(plain)):
            original = plain[i][0]
            views, _, _ = flipping.load(i, epoch)
            assert torch.equal(views, flipping.load(i, epoch)[0])  # same (seed, epoch, index), same sample
            row = []
            for v in range(2):
                flipped = torch.equal(views[v], original[v].flip(-1))
                assert flipped or torch.equal(views[v], original[v])
                row.append(flipped)
            decisions.append(row)
    decisions = np.array(decisions)
    assert 0.3 < decisions.mean() < 0.7
    assert (decisions[:, 0] != decisions[:, 1]).any()  # views flip independently
    assert len({tuple(decisions[e * 8:(e + 1) * 8].ravel()) for e in range(6)}) > 1  # epochs differ


# --- identity and augment view sources ---------------------------------------------------------

def make_identity_folder(root, sizes: list[int]) -> dict[tuple[int, int, int], int]:
    """Identity i's images are flat colours unique to (i, image); returns colour -> identity."""
    colour_of = {}
    for identity, count in enumerate(sizes):
        folder = root / f"person_{identity:02d}"
        folder.mkdir(parents=True)
        for image in range(count):
            colour = (40 + 20 * identity, 30 + 25 * image, 200 - 10 * identity)
            Image.new("RGB", (112, 112), colour).save(folder / f"{image}.png")
            colour_of[colour] = identity
    return colour_of


def identity_of(view: torch.Tensor, colour_of: dict) -> int:
    centre = tuple(int(c) for c in view[:, 56, 56])
    return colour_of[centre]


def test_identity_source_never_mixes_identities(tmp_path):
    colour_of = make_identity_folder(tmp_path / "faces", [3, 1, 4, 2, 5])
    ds = build_dataset(str(tmp_path / "faces"), num_views=3, view_source="identity")
    assert ds.num_classes == 5 and len(ds) == 15
    seen_others = set()
    for epoch in range(4):
        for i in range(len(ds)):
            views, label, _ = ds.load(i, epoch)
            identities = {identity_of(v, colour_of) for v in views}
            assert identities == {int(label)}
            seen_others.update(tuple(int(c) for c in v[:, 56, 56]) for v in views[1:])
    assert len(seen_others) == 15  # the draws reach every image


def test_identity_source_prefers_other_images_and_repeats_a_lone_one(tmp_path):
    make_identity_folder(tmp_path / "faces", [2, 1])
    ds = build_dataset(str(tmp_path / "faces"), num_views=2, view_source="identity", flip=False)
    first, second = ds[0][0], ds[1][0]
    assert torch.equal(first[1], second[0]) and torch.equal(second[1], first[0])
    lone = ds[2][0]
    assert torch.equal(lone[0], lone[1])


def test_identity_source_over_a_packed_identity_table(tmp_path):
    # A rec with an identity table (insightface layout): the draws follow the table.
    reader = RecordReader(os.path.join(FIXTURES, "pairs.idx"), PAIRS)
    ranges = {k: unpack(reader.read(k))[0].label.astype(int).tolist() for k in range(9, 13)}
    key_identity = {key: identity for identity, (start, end) in enumerate(ranges.values())
                    for key in range(start, end)}
    # Single-view records: the left half of each pair record, re-encoded.
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as writer:
        for key in range(13):
            header, payload = unpack(reader.read(key))
            if 1 <= key <= 8:
                image = decode_jpeg(torch.frombuffer(bytearray(payload), dtype=torch.uint8))[:, :, :112]
                buffer = Image.fromarray(image.permute(1, 2, 0).numpy())
                payload = _png_bytes(buffer)
            writer.write(key, pack(header, payload))
    ds = build_dataset(str(tmp_path), num_views=2, view_source="identity", flip=False)
    lefts = {key: ds[key - 1][0][0] for key in range(1, 9)}
    for epoch in range(3):
        for i in range(len(ds)):
            views, label, _ = ds.load(i, epoch)
            partner = [k for k, left in lefts.items() if torch.equal(left, views[1])]
            assert partner and key_identity[partner[0]] == key_identity[i + 1] == int(label)


def _png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_augment_source_gives_distinct_views_of_one_image(tmp_path):
    folder = tmp_path / "faces" / "a"
    folder.mkdir(parents=True)
    gradient = np.add.outer(np.arange(112), np.arange(112)).astype(np.uint8)
    Image.fromarray(np.stack([gradient, gradient[::-1], 255 - gradient], -1)).save(folder / "x.png")
    ds = build_dataset(str(tmp_path / "faces"), num_views=4, view_source="augment", flip=False)
    views, label = ds[0]
    assert views.shape == (4, 3, 112, 112) and int(label) == 0
    assert len({v.numpy().tobytes() for v in views}) == 4
    assert torch.equal(views, ds[0][0])


# --- speed mode --------------------------------------------------------------------------------

def test_synthetic_speed_mode():
    with pytest.raises(DataError, match="num_classes"):
        build_dataset("synthetic", num_views=2)
    ds = build_dataset("synthetic", num_views=2, num_classes=10, flip=False)
    assert ds.num_classes == 10 and len(ds) >= 100_000
    first, second = ds[0], ds[13]
    assert first[0].shape == (2, 3, 112, 112) and first[0].dtype == torch.uint8
    assert torch.equal(first[0], second[0]) and int(second[1]) == 3
    assert first[0].float().std() > 50  # random noise, not a constant image


# --- errors: one clear sentence naming the file and the record ---------------------------------

def test_width_not_views_times_height_names_the_record():
    ds = build_dataset(PAIRS, num_views=3)
    with pytest.raises(DataError, match=r"pairs\.rec record key 1 is 112x224 \(HxW\), not 3 square view\(s\) "
                                        r"side by side \(112x336\); set num_views to 2"):
        ds[0]


def test_label_beyond_num_classes(tmp_path):
    with pytest.raises(DataError, match=r"pairs\.rec holds 4 classes .* num_classes=3; set num_classes = 4"):
        build_dataset(PAIRS, num_views=2, num_classes=3)
    assert build_dataset(PAIRS, num_views=2, num_classes=10).num_classes == 10
    # A flat file: the error names the record with the offending label.
    reader = RecordReader(os.path.join(FIXTURES, "flat.idx"), FLAT)
    with RecordWriter(str(tmp_path / "f.idx"), str(tmp_path / "f.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header._replace(label=9.0 if key == 4 else header.label), payload))
    with pytest.raises(DataError, match=r"f\.rec record key 4 has label 9 .* num_classes=5"):
        build_dataset(str(tmp_path / "f.rec"), num_classes=5)


def test_label_disagreeing_with_identity_table_is_caught_per_record(tmp_path):
    reader = RecordReader(os.path.join(FIXTURES, "pairs.idx"), PAIRS)
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header._replace(label=7.0) if key == 5 else header, payload))
    ds = build_dataset(str(tmp_path), num_views=2)
    with pytest.raises(DataError, match=r"train\.rec record key 5 has label 7, outside 0\.\.3"):
        ds[4]


def write_rec_with_garbage(tmp_path, bad_keys: set[int]) -> str:
    reader = RecordReader(os.path.join(FIXTURES, "flat.idx"), FLAT)
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as writer:
        for key in reader.keys:
            header, payload = unpack(reader.read(key))
            writer.write(key, pack(header, b"\xff\xd8 not a jpeg" if key in bad_keys else payload))
    return str(tmp_path)


def test_undecodable_image_fails_by_default(tmp_path):
    ds = build_dataset(write_rec_with_garbage(tmp_path, {3}))
    with pytest.raises(DataError, match=r"train\.rec record key 3 is not a decodable image .*skip_bad_records=True"):
        ds[2]


def test_undecodable_image_is_skipped_counted_and_logged(tmp_path, caplog):
    path = write_rec_with_garbage(tmp_path, {3})
    ds = build_dataset(path, skip_bad_records=True, flip=False)
    clean = build_dataset(FLAT, flip=False)
    with caplog.at_level(logging.WARNING):
        views, label = ds[2]
    assert ds.skipped == 1 and "record key 3" in caplog.text and "1 skipped so far" in caplog.text
    assert torch.equal(views, clean[3][0]) and int(label) == int(clean[3][1])  # replaced by the next sample
    assert torch.equal(ds[0][0], clean[0][0]) and ds.skipped == 1


def write_rec_with_zeroed_span(tmp_path, first_key: int) -> tuple[str, int]:
    """The pairs fixture (an identity table: no header is read before its image) with zeros from the middle of
    record `first_key`'s image through the header of the next one (a damaged disk block): (folder, next key)."""
    (tmp_path / "train.idx").write_bytes(open(os.path.join(FIXTURES, "pairs.idx"), "rb").read())
    offsets = dict(tuple(map(int, line.split("\t"))) for line in (tmp_path / "train.idx").read_text().splitlines())
    following = min(key for key in offsets if offsets[key] > offsets[first_key])
    data = bytearray(open(PAIRS, "rb").read())
    start = (offsets[first_key] + offsets[following]) // 2
    data[start:offsets[following] + 40] = bytes(offsets[following] + 40 - start)
    (tmp_path / "train.rec").write_bytes(bytes(data))
    return str(tmp_path), following


def test_a_record_with_a_damaged_header_is_skipped_and_the_rec_not_the_idx_is_blamed(tmp_path, caplog):
    path, second = write_rec_with_zeroed_span(tmp_path, 3)
    clean = build_dataset(PAIRS, num_views=2, flip=False)
    with pytest.raises(DataError) as info:
        build_dataset(path, num_views=2, flip=False)[second - 1]
    assert str(info.value) == (
        f"{path}/train.rec: record key {second} is damaged (no RecordIO magic at offset "
        f"{int(dict(line.split() for line in open(path + '/train.idx'))[str(second)])}, found 0x00000000, though "
        "the records beside it start where the .idx says); copy the .rec again or re-pack it, or set "
        "skip_bad_records = True to skip such records")
    skipping = build_dataset(path, num_views=2, skip_bad_records=True, flip=False)
    with caplog.at_level(logging.WARNING):
        views, label = skipping[2]  # key 3 (its image half zeros), then key 4 (no header): both skipped
    assert skipping.skipped == 2 and torch.equal(views, clean[second][0]) and int(label) == int(clean[second][1])
    assert "skip_bad_records" not in caplog.text and f"record key {second} is damaged" in caplog.text


def test_an_idx_that_does_not_match_its_rec_is_blamed(tmp_path):
    lines = open(os.path.join(FIXTURES, "flat.idx")).read().splitlines()
    (tmp_path / "train.idx").write_text("".join(f"{key}\t{int(offset) + 4}\n" for key, offset in
                                                (line.split("\t") for line in lines)))
    (tmp_path / "train.rec").write_bytes(open(FLAT, "rb").read())
    with pytest.raises(DataError, match=r"does not start with the RecordIO magic .*nor do the records beside it; "
                                        r"the \.idx does not match this \.rec"):
        build_dataset(str(tmp_path), skip_bad_records=True, flip=False)[2]


def test_missing_idx_and_missing_path(tmp_path):
    (tmp_path / "train.rec").write_bytes(open(FLAT, "rb").read())
    with pytest.raises(DataError, match=r"train\.idx not found"):
        build_dataset(str(tmp_path))
    with pytest.raises(DataError, match=r"dataset path .*nowhere does not exist"):
        build_dataset(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty holds neither train\.rec/train\.idx nor identity sub-folders"):
        build_dataset(str(tmp_path / "empty"))


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="num_views must be a positive integer"):
        build_dataset(PAIRS, num_views=0)
    with pytest.raises(DataError, match=r"pairs\.rec record key 1 is 112x224 \(HxW\), not 1 square view\(s\) .*"
                                        r"view_source='identity' takes one view per record"):
        build_dataset(PAIRS, num_views=2, view_source="identity")[0]


@pytest.mark.parametrize("view_source, views", [("record", 2), ("identity", 1)])
def test_an_image_folder_of_photos_that_are_not_faces_yet_says_to_pack_it_first(tmp_path, view_source, views):
    """92x112 portraits as a newcomer has them: under either view source, one sentence with the command that
    prepares them (tools.pack_rec), not advice that sends the user from one view_source to the other."""
    photos = tmp_path / "photos"
    (photos / "s1").mkdir(parents=True)
    Image.new("RGB", (92, 112), (90, 60, 30)).save(photos / "s1" / "1.png")
    ds = build_dataset(str(photos), num_views=2, view_source=view_source)
    with pytest.raises(DataError) as raised:
        ds.load(0, 0)
    assert str(raised.value) == (
        f"image {photos / 's1' / '1.png'} is 112x92 (HxW); an image folder trains on photos that are "
        f"112x{112 * views} faces already; pack it first, which prepares every photo: python -m tools.pack_rec "
        f"{photos} {photos}_packed --views {views} --crop (or --resize, --pad, --landmarks FILE), then train with "
        f"--set rec={photos}_packed")
