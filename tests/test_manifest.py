"""The manifest's checksums (checkpoint/manifest.py): a file verified against its listed size and crc32c, and
JSON files that carry a checksum of themselves, in one process. Checksums are computed here with the crc32c
package and plain json, the reference the files are read against; a save and a resume through them are in
test_sharded.py.
"""
from __future__ import annotations

import json

import crc32c
import pytest

from checkpoint.manifest import (
    IntegrityError,
    checked_json,
    describe_files,
    file_crc32c,
    read_checked_json,
    verify_file,
)


def with_checksum(content: dict) -> bytes:
    """What a checked JSON file holds, computed independently: the content and the crc32c of its sorted JSON."""
    return json.dumps({**content, "crc32c": crc32c.crc32c(json.dumps(content, sort_keys=True).encode())}).encode()


@pytest.mark.parametrize("content", [b"", b"x", bytes(range(256)) * 4099])
def test_a_files_checksum_and_size_are_those_of_its_bytes(tmp_path, content):
    (tmp_path / "f").write_bytes(content)
    assert file_crc32c(tmp_path / "f") == crc32c.crc32c(content)
    assert describe_files(tmp_path, ["f"]) == {"f": {"size": len(content), "crc32c": crc32c.crc32c(content)}}


def test_a_file_is_verified_against_its_listed_size_and_checksum_and_each_fault_names_it(tmp_path):
    content = b"0123456789" * 7
    path = tmp_path / "shard"
    path.write_bytes(content)
    listed = {"size": len(content), "crc32c": crc32c.crc32c(content)}
    verify_file(tmp_path, "shard", listed)
    flipped = bytearray(content)
    flipped[35] ^= 0x10
    path.write_bytes(bytes(flipped))
    found = crc32c.crc32c(bytes(flipped))
    with pytest.raises(IntegrityError) as raised:
        verify_file(tmp_path, "shard", listed)
    assert str(raised.value) == (f"{path} does not match its checksum (crc32c {found:08x}, the manifest lists "
                                 f"{listed['crc32c']:08x})")
    path.write_bytes(content[:-1])
    with pytest.raises(IntegrityError) as raised:
        verify_file(tmp_path, "shard", listed)
    assert str(raised.value) == f"{path} is {len(content) - 1} bytes, the manifest lists {len(content)}"
    path.unlink()
    path.mkdir()  # a folder where the file was is as missing as no file
    with pytest.raises(IntegrityError) as raised:
        verify_file(tmp_path, "shard", listed)
    assert str(raised.value) == f"{path} is missing"


def test_checked_json_carries_the_crc32c_of_its_content_and_reads_back_exactly(tmp_path):
    content = {"b": [1, 2.5, None], "a": {"z": "é", "y": True}}
    written = checked_json(content)
    assert json.loads(written) == json.loads(with_checksum(content))
    (tmp_path / "c.json").write_bytes(written)
    assert read_checked_json(tmp_path / "c.json") == content
    (tmp_path / "other.json").write_bytes(with_checksum(content))  # written by anyone, in any layout
    assert read_checked_json(tmp_path / "other.json") == content


@pytest.mark.parametrize(("content", "reason"), [
    (json.dumps({"a": 2, "crc32c": crc32c.crc32c(json.dumps({"a": 1}).encode())}).encode(),
     "does not match its own checksum: the file was changed or damaged"),
    (json.dumps({"a": 1}).encode(), "carries no checksum of its content"),
    (json.dumps({"a": 1, "crc32c": "0"}).encode(), "carries no checksum of its content"),
    (json.dumps([1, 2]).encode(), "carries no checksum of its content"),
    (b'{"a": 1', "is not JSON"),
    (b"\xff\xfe", "is not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "is not JSON"),
])
def test_a_checked_json_file_changed_cut_or_foreign_is_an_integrity_error_naming_it(tmp_path, content, reason):
    path = tmp_path / "c.json"
    path.write_bytes(content)
    with pytest.raises(IntegrityError) as raised:
        read_checked_json(path)
    assert str(raised.value).startswith(f"{path} {reason}")
