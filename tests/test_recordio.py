"""RecordIO against files mxnet 1.9.1 wrote (tests/fixtures/recordio, manifest expected.json)."""
from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import os
import pickle
import shutil
import struct
import sys

import numpy as np
import pytest
import torch
from torchvision.io import decode_jpeg

from dataset import IRHeader, RecordReader, RecordWriter, pack, unpack
from facedata import recordio
from facedata.recordio import encode_parts, header_label
from utils.errors import DataError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "recordio")
MANIFEST = json.load(open(os.path.join(FIXTURES, "expected.json")))
RECORD_FILES = ["pairs", "flat", "split"]
MAGIC = struct.pack("<I", 0xCED7230A)


def fixture_reader(name: str) -> RecordReader:
    return RecordReader(os.path.join(FIXTURES, f"{name}.idx"), os.path.join(FIXTURES, f"{name}.rec"))


def manifest_records(name: str) -> list[dict]:
    return MANIFEST["files"][name]["records"]


@pytest.mark.parametrize("name", RECORD_FILES)
def test_every_fixture_record_reads_back_as_mxnet_wrote_it(name):
    reader = fixture_reader(name)
    assert sorted(reader.keys) == sorted(r["key"] for r in manifest_records(name))
    for expected in manifest_records(name):
        header, payload = unpack(reader.read(expected["key"]))
        label = header.label.tolist() if header.flag else header.label
        assert (header.flag, label, header.id, header.id2) == (
            expected["flag"], expected["label"], expected["id"], expected["id2"]), expected["key"]
        assert len(payload) == expected["payload_len"]
        assert hashlib.sha256(payload).hexdigest() == expected["payload_sha256"]


@pytest.mark.parametrize("name", ["pairs", "flat"])
def test_fixture_images_decode_to_the_manifest_pixel_sums(name):
    reader = fixture_reader(name)
    images = [r for r in manifest_records(name) if "decoded_rgb_sum" in r]
    assert images
    for expected in images:
        payload = unpack(reader.read(expected["key"]))[1]
        pixels = decode_jpeg(torch.frombuffer(bytearray(payload), dtype=torch.uint8))  # (3, H, W) RGB
        assert list(pixels.permute(1, 2, 0).shape) == expected["decoded_shape_hwc"]
        assert int(pixels.sum()) == expected["decoded_rgb_sum"], expected["key"]


def test_split_fixture_payloads_contain_the_magic_they_were_split_at():
    # The split file exists to exercise multi-part records: check that it really does.
    reader = fixture_reader("split")
    payloads = [unpack(reader.read(r["key"]))[1] for r in manifest_records("split")]
    assert sum(p.count(MAGIC) for p in payloads) >= 4


@pytest.mark.parametrize("name", RECORD_FILES)
def test_pack_rebuilds_mxnet_record_bytes(name):
    reader = fixture_reader(name)
    for key in reader.keys:
        record = reader.read(key)
        assert pack(*unpack(record)) == record, key


@pytest.mark.parametrize("name", RECORD_FILES)
def test_writer_reproduces_mxnet_files_byte_for_byte(name, tmp_path):
    reader = fixture_reader(name)
    idx, rec = tmp_path / "out.idx", tmp_path / "out.rec"
    order = [r["key"] for r in sorted(manifest_records(name), key=lambda r: r["offset"])]
    with RecordWriter(str(idx), str(rec)) as writer:
        for key in order:
            writer.write(key, reader.read(key))
    assert rec.read_bytes() == open(os.path.join(FIXTURES, f"{name}.rec"), "rb").read()
    assert idx.read_text() == open(os.path.join(FIXTURES, f"{name}.idx")).read()


def test_pack_gives_flag_from_label_shape():
    scalar = unpack(pack(IRHeader(5, 3.0, 7, 1), b"x"))
    assert scalar == (IRHeader(0, 3.0, 7, 1), b"x")
    header, payload = unpack(pack(IRHeader(0, [4.0, 9.0, 2.5], 7, 1), b"yz"))
    assert header.flag == 3 and header.label.tolist() == [4.0, 9.0, 2.5] and payload == b"yz"
    # mxnet stores 0 in the header's float slot when an array label follows.
    assert struct.unpack_from("<f", pack(IRHeader(0, [4.0, 9.0], 0, 0), b""), 4)[0] == 0.0


def test_read_header_matches_full_read():
    for name in RECORD_FILES:
        reader = fixture_reader(name)
        for key in reader.keys:
            expected = unpack(reader.read(key))[0]
            header = reader.read_header(key)
            assert header.flag == expected.flag and header.id == expected.id and header.id2 == expected.id2
            assert np.array_equal(np.asarray(header.label), np.asarray(expected.label))


def test_sparse_unsorted_index(tmp_path):
    # An .idx listing only some records, out of order: each read still finds its own record.
    lines = open(os.path.join(FIXTURES, "pairs.idx")).read().splitlines()
    chosen = [lines[i] for i in (7, 2, 11, 4)]
    (tmp_path / "p.idx").write_text("\n".join(chosen) + "\n")
    shutil.copy(os.path.join(FIXTURES, "pairs.rec"), tmp_path / "p.rec")
    reader = RecordReader(str(tmp_path / "p.idx"), str(tmp_path / "p.rec"))
    expected = {r["key"]: r["payload_sha256"] for r in manifest_records("pairs")}
    assert reader.keys == sorted(int(line.split()[0]) for line in chosen)
    for key in reader.keys:
        assert hashlib.sha256(unpack(reader.read(key))[1]).hexdigest() == expected[key]
    with pytest.raises(KeyError):
        reader.read(1)


def _digests(reader: RecordReader) -> tuple[int, list[str]]:
    return os.getpid(), [hashlib.sha256(reader.read(k)).hexdigest() for k in reader.keys]


def test_reader_is_usable_in_forked_workers_and_after_pickling():
    reader = fixture_reader("split")
    expected = [hashlib.sha256(reader.read(k)).hexdigest() for k in reader.keys]  # opens in the parent first
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_digests, [reader] * 4)
    assert all(digests == expected for _, digests in results)
    assert all(pid != os.getpid() for pid, _ in results)
    # Spawned workers receive the reader pickled: it must arrive without the parent's descriptor.
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._fd is None and _digests(copy)[1] == expected


# --- errors a user can cause: each names the file and the record ---------------------------------

def copy_fixture(tmp_path, name: str) -> tuple[str, str]:
    idx, rec = str(tmp_path / f"{name}.idx"), str(tmp_path / f"{name}.rec")
    shutil.copy(os.path.join(FIXTURES, f"{name}.idx"), idx)
    shutil.copy(os.path.join(FIXTURES, f"{name}.rec"), rec)
    return idx, rec


def test_missing_idx_is_named(tmp_path):
    idx, rec = copy_fixture(tmp_path, "flat")
    os.remove(idx)
    with pytest.raises(DataError, match=r"flat\.idx not found.*flat\.rec"):
        RecordReader(idx, rec)


def test_truncated_rec_names_the_record(tmp_path):
    idx, rec = copy_fixture(tmp_path, "flat")
    last = max(manifest_records("flat"), key=lambda r: r["offset"])
    with open(rec, "r+b") as f:
        f.truncate(last["offset"] + 100)
    with pytest.raises(DataError, match=rf"flat\.rec is truncated: record key {last['key']} at offset"):
        RecordReader(idx, rec)


def test_wrong_magic_names_the_record(tmp_path):
    idx, rec = copy_fixture(tmp_path, "flat")
    target = manifest_records("flat")[2]
    with open(rec, "r+b") as f:
        f.seek(target["offset"])
        f.write(b"\0\0\0\0")
    reader = RecordReader(idx, rec)
    # Its neighbours start where the .idx says: the record is damaged, the .idx is not to blame.
    with pytest.raises(DataError, match=rf"flat\.rec: record key {target['key']} is damaged \(no RecordIO magic at "
                                        rf"offset {target['offset']}, found 0x00000000"):
        reader.read(target["key"])


def test_idx_offset_past_the_end_names_the_key(tmp_path):
    idx, rec = copy_fixture(tmp_path, "flat")
    size = os.path.getsize(rec)
    with open(idx, "a") as f:
        f.write(f"9\t{size + 64}\n")
    with pytest.raises(DataError, match=rf"flat\.idx: key 9 points at offset {size + 64}, past the end of .*flat\.rec"):
        RecordReader(idx, rec)


def test_malformed_idx_line_is_named(tmp_path):
    idx, rec = copy_fixture(tmp_path, "flat")
    with open(idx, "a") as f:
        f.write("seven\tx\n")
    with pytest.raises(DataError, match=r"flat\.idx line 7"):
        RecordReader(idx, rec)


# --- what mutation testing found unchecked ---------------------------------------------------------

def test_one_float_label_is_an_array_label():
    """flag 1: one float32 label follows the header (not the header's own label field)."""
    header, payload = unpack(pack(IRHeader(0, [7.0], 3, 0), b"img"))
    assert header.flag == 1 and header.label.tolist() == [7.0] and payload == b"img"


def test_the_class_of_a_record_is_its_label_or_the_first_of_its_labels():
    assert header_label(IRHeader(0, 4.0, 0, 0)) == 4.0
    assert header_label(unpack(pack(IRHeader(0, [3.0, 9.0], 0, 0), b""))[0]) == 3.0


def test_a_record_ending_in_an_aligned_magic_is_split_as_dmlc_core_splits_it():
    """24 bytes whose last aligned word is the magic: a first part of 20 bytes (cflag 1), then an empty
    last part (cflag 3), written out here from the format, not by the code under test."""
    record = bytes(range(20)) + MAGIC
    expected = MAGIC + struct.pack("<I", (1 << 29) | 20) + bytes(range(20)) + MAGIC + struct.pack("<I", 3 << 29)
    assert encode_parts(record) == expected


def test_records_read_whole_when_the_first_read_is_short(monkeypatch):
    """Records longer than the first read (4 MiB) need further reads: every fixture record, multi-part ones
    included, still reads back as mxnet wrote it when the first read is 16 bytes."""
    monkeypatch.setattr(recordio, "_MAX_FIRST_READ", 16)
    for name in RECORD_FILES:
        reader = fixture_reader(name)
        for expected in manifest_records(name):
            payload = unpack(reader.read(expected["key"]))[1]
            assert hashlib.sha256(payload).hexdigest() == expected["payload_sha256"], (name, expected["key"])


def test_read_header_of_a_record_with_many_labels(tmp_path):
    """More labels than the header probe holds: read_header falls back to reading the record."""
    labels = [float(i) for i in range(12)]
    with RecordWriter(str(tmp_path / "r.idx"), str(tmp_path / "r.rec")) as writer:
        writer.write(0, pack(IRHeader(0, labels, 5, 6), b"payload"))
    header = RecordReader(str(tmp_path / "r.idx"), str(tmp_path / "r.rec")).read_header(0)
    assert (header.flag, header.label.tolist(), header.id, header.id2) == (12, labels, 5, 6)


@pytest.mark.parametrize("name", ["flat", "sparse"])
def test_keys_outside_the_index_are_not_there(name, tmp_path):
    if name == "sparse":
        lines = open(os.path.join(FIXTURES, "pairs.idx")).read().splitlines()
        (tmp_path / "p.idx").write_text("\n".join(lines[i] for i in (2, 4, 7)) + "\n")
        shutil.copy(os.path.join(FIXTURES, "pairs.rec"), tmp_path / "p.rec")
        reader = RecordReader(str(tmp_path / "p.idx"), str(tmp_path / "p.rec"))
    else:
        reader = fixture_reader(name)
    keys = reader.keys
    for key in (min(keys) - 1, max(keys) + 1, max(keys) + 100):
        assert key not in reader
        with pytest.raises(KeyError):
            reader.read(key)
    assert all(key in reader for key in keys)


def test_blank_lines_in_an_index_are_skipped(tmp_path):
    idx, rec = copy_fixture(tmp_path, "flat")
    lines = open(idx).read().splitlines()
    with open(idx, "w") as f:
        f.write("\n".join(lines[:2] + ["", "   "] + lines[2:]) + "\n")
    reader = RecordReader(idx, rec)
    assert reader.keys == sorted(r["key"] for r in manifest_records("flat"))


def test_a_key_listed_twice_reads_its_last_offset_as_mxnet_does(tmp_path):
    """mxnet's MXIndexedRecordIO fills a dict from the .idx lines, so the later line wins."""
    idx, rec = copy_fixture(tmp_path, "flat")
    lines = open(idx).read().splitlines()
    second_offset = lines[1].split("\t")[1]
    with open(idx, "a") as f:
        f.write(f"1\t{second_offset}\n")
    reader, original = RecordReader(idx, rec), fixture_reader("flat")
    assert len(reader) == len(original)
    assert reader.read(1) == original.read(2)
    assert [reader.read(key) for key in original.keys[1:]] == [original.read(key) for key in original.keys[1:]]


def test_an_index_with_bytes_that_are_not_text_names_the_line(tmp_path):
    idx, rec = copy_fixture(tmp_path, "flat")
    with open(idx, "ab") as f:
        f.write(b"\xff\xfe\t12\n")
    with pytest.raises(DataError, match=r"flat\.idx line 7"):
        RecordReader(idx, rec)


def test_an_offset_exactly_at_the_end_of_the_rec_is_past_it(tmp_path):
    idx, rec = copy_fixture(tmp_path, "flat")
    size = os.path.getsize(rec)
    with open(idx, "a") as f:
        f.write(f"9\t{size}\n")
    with pytest.raises(DataError, match=rf"key 9 points at offset {size}, past the end"):
        RecordReader(idx, rec)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_readers_keep_one_descriptor_and_close_it_when_dropped():
    before = _open_descriptors()
    for _ in range(5):
        reader = fixture_reader("flat")
        for key in reader.keys * 3:
            reader.read(key)
        assert _open_descriptors() == before + 1
        del reader
        assert _open_descriptors() == before


def test_a_reader_that_failed_to_open_leaves_no_error_behind(tmp_path, monkeypatch):
    """A reader whose constructor raised is collected quietly (its __del__ must not fail on missing fields)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(DataError):
        RecordReader(str(tmp_path / "none.idx"), str(tmp_path / "none.rec"))
    gc.collect()
    assert unraisable == []
