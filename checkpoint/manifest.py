"""Checksums: every file of a checkpoint folder is listed, with its size and crc32c, in the folder's
`manifest.json`, written last; the small JSON files (the manifest, checkpoint.json, state.json) carry
a crc32c of their own content. A load checks them before it reads anything else, so a flipped bit, a
cut-short copy or a missing file is named instead of trained on.

crc32c runs at memory speed (SSE4.2/ARMv8 instructions, ~10 GB/s here) on the memory-mapped file:
verifying costs one pass over data that the load then reads from the page cache.
"""
from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping
from pathlib import Path

import crc32c

MANIFEST_NAME = "manifest.json"
_CHECKSUM_KEY = "crc32c"


class IntegrityError(ValueError):
    """A file whose content is not what was written."""


def file_crc32c(path: Path) -> int:
    """crc32c of the file's bytes (OSError if it cannot be read)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return crc32c.crc32c(b"")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return crc32c.crc32c(mapped)


def describe_files(folder: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """{name: {"size", "crc32c"}} of files in `folder`."""
    return {name: {"size": (folder / name).stat().st_size, "crc32c": file_crc32c(folder / name)} for name in names}


def verify_file(folder: Path, name: str, expected: Mapping[str, int]) -> None:
    """IntegrityError naming the file unless it has the size and crc32c the manifest lists."""
    path = folder / name
    if not path.is_file():
        raise IntegrityError(f"{path} is missing")
    size = path.stat().st_size
    if size != expected["size"]:
        raise IntegrityError(f"{path} is {size} bytes, the manifest lists {expected['size']}")
    found = file_crc32c(path)
    if found != expected["crc32c"]:
        raise IntegrityError(f"{path} does not match its checksum (crc32c {found:08x}, the manifest lists "
                             f"{expected['crc32c']:08x})")


def checked_json(content: Mapping) -> bytes:
    """`content` as JSON with a crc32c of itself, so that any change to the file is detected."""
    body = json.dumps(dict(content), sort_keys=True)
    return json.dumps({**content, _CHECKSUM_KEY: crc32c.crc32c(body.encode())}, indent=2, sort_keys=True).encode()


def read_checked_json(path: Path) -> dict:
    """What checked_json wrote to `path`; IntegrityError for a damaged or foreign file (OSError if unreadable)."""
    try:
        content = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise IntegrityError(f"{path} is not JSON ({error})") from None
    if not isinstance(content, dict) or not isinstance(content.get(_CHECKSUM_KEY), int):
        raise IntegrityError(f"{path} carries no checksum of its content")
    expected = content.pop(_CHECKSUM_KEY)
    if crc32c.crc32c(json.dumps(content, sort_keys=True).encode()) != expected:
        raise IntegrityError(f"{path} does not match its own checksum: the file was changed or damaged")
    return content
