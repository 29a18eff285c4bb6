"""MXNet RecordIO (.rec/.idx), read and written byte for byte as mxnet 1.9.1 does, without mxnet.

Layout of one record: ``<I`` magic 0xCED7230A, ``<I`` lrec (cflag = lrec >> 29, length =
lrec & (2**29 - 1)), ``length`` data bytes, zero padding to a multiple of 4. dmlc-core splits a
payload at every 4-byte-aligned occurrence of the magic (cflag 1 first part, 2 middle, 3 last) so
that a reader can resynchronise on the magic; the magic itself is dropped from the data and the
reader puts it back between parts. A record's data starts with an ``IRHeader`` (``<IfQQ``: flag,
label, id, id2); ``flag > 0`` means ``flag`` float32 labels follow the header.
"""
from __future__ import annotations

import numbers
import os
import struct
from collections import namedtuple
from functools import cached_property

import numpy as np

from utils.errors import DataError

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
SKIP_FIX = "set skip_bad_records = True to skip such records"


class BadRecordError(DataError):
    """One record that cannot be used while the file around it is sound (damaged bytes, an image no decoder
    takes): the per-record problem ``skip_bad_records`` skips. ``problem`` is the sentence without its fix, for
    the line that says a record was skipped (that line must not advise the option already set)."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix

    def __reduce__(self):  # from a loader worker to the training process, both parts intact
        return type(self), (self.problem, self.fix)
_LENGTH_MASK = (1 << 29) - 1
_IR_FORMAT = "<IfQQ"
_IR_SIZE = struct.calcsize(_IR_FORMAT)
# Enough for the part header, the IRHeader and a few array labels in one read.
_HEADER_PROBE = 8 + _IR_SIZE + 4 * 8
# Upper bound of the first read when the next indexed offset is far away (sparse .idx files).
_MAX_FIRST_READ = 1 << 22

IRHeader = namedtuple("IRHeader", ["flag", "label", "id", "id2"])


def unpack(record: bytes) -> tuple[IRHeader, bytes]:
    """Split a record into its IRHeader and payload, as ``mxnet.recordio.unpack``.

    ``label`` is a float for ``flag == 0`` and a float32 array of ``flag`` values otherwise.
    """
    if len(record) < _IR_SIZE:
        raise DataError(f"record is {len(record)} bytes, shorter than the {_IR_SIZE}-byte IRHeader; "
                        "it was not written by mxnet.recordio.pack or tools/pack_rec.py")
    header = IRHeader(*struct.unpack_from(_IR_FORMAT, record))
    payload = record[_IR_SIZE:]
    if header.flag > 0:
        label_bytes = 4 * header.flag
        if len(payload) < label_bytes:
            raise DataError(f"record header announces {header.flag} float labels but only "
                            f"{len(payload)} bytes follow; the record is corrupt, re-pack the dataset")
        header = header._replace(label=np.frombuffer(payload[:label_bytes], dtype=np.float32).copy())
        payload = payload[label_bytes:]
    return header, payload


def pack(header: IRHeader, payload: bytes) -> bytes:
    """The inverse of :func:`unpack`, as ``mxnet.recordio.pack``: a number label gives flag 0,
    a sequence label gives flag = its length (and 0 in the header's label field)."""
    header = IRHeader(*header)
    if isinstance(header.label, numbers.Number):
        header = header._replace(flag=0)
        prefix = b""
    else:
        labels = np.asarray(header.label, dtype=np.float32)
        header = header._replace(flag=labels.size, label=0)
        prefix = labels.tobytes()
    return struct.pack(_IR_FORMAT, *header) + prefix + payload


def header_label(header: IRHeader) -> float:
    """The class of a record: the label, or the first of an array label (insightface's rule)."""
    return float(header.label) if header.flag == 0 else float(header.label[0])


def encode_parts(record: bytes) -> bytes:
    """A record's bytes on disk, split at aligned magics exactly as dmlc-core's WriteRecord."""
    if len(record) > _LENGTH_MASK:
        raise DataError(f"a record of {len(record)} bytes exceeds RecordIO's limit of {_LENGTH_MASK} bytes; "
                        "store smaller images")
    out = bytearray()
    start = 0
    for i in range(0, len(record) - len(record) % 4, 4):
        if record[i:i + 4] == _MAGIC_BYTES:
            cflag = 1 if start == 0 else 2
            out += _MAGIC_BYTES + struct.pack("<I", (cflag << 29) | (i - start)) + record[start:i]
            start = i + 4
    cflag = 3 if start else 0
    out += _MAGIC_BYTES + struct.pack("<I", (cflag << 29) | (len(record) - start)) + record[start:]
    out += bytes(-len(record) % 4)
    return bytes(out)


class RecordWriter:
    """Writes ``.rec`` + ``.idx`` (``key\\toffset`` lines) like ``mxnet.recordio.MXIndexedRecordIO``."""

    def __init__(self, idx_path: str, rec_path: str) -> None:
        self.idx_path, self.rec_path = idx_path, rec_path
        self._rec = open(rec_path, "wb")
        self._idx = open(idx_path, "w")

    def write(self, key: int, record: bytes) -> None:
        self._idx.write(f"{int(key)}\t{self._rec.tell()}\n")
        self._rec.write(encode_parts(record))

    def close(self) -> None:
        self._rec.close()
        self._idx.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse_index(idx_path: str) -> tuple[np.ndarray, np.ndarray]:
    keys, offsets = [], []
    with open(idx_path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                key, offset = int(fields[0]), int(fields[1])
            except (ValueError, IndexError):
                raise DataError(f"{idx_path} line {line_no} is {line[:60]!r}, not 'key<TAB>offset'; "
                                "the .idx is damaged, re-pack the dataset with tools/pack_rec.py") from None
            keys.append(key)
            offsets.append(offset)
    return np.asarray(keys, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


class RecordReader:
    """Random access to an indexed ``.rec``: one positioned read per record, no scan of the file.

    The file is opened lazily in the process that reads, so a reader built before DataLoader
    workers fork (or pickled into spawned workers) gives each worker its own descriptor.
    """

    def __init__(self, idx_path: str, rec_path: str) -> None:
        self.idx_path, self.rec_path = os.fspath(idx_path), os.fspath(rec_path)
        if not os.path.isfile(self.rec_path):
            raise DataError(f"{self.rec_path} not found; point the dataset path at the folder holding train.rec")
        if not os.path.isfile(self.idx_path):
            raise DataError(f"{self.idx_path} not found: the index of {self.rec_path} is missing; copy the .idx "
                            "written with it next to the .rec (same name, .idx), or re-pack with tools/pack_rec.py")
        keys, offsets = _parse_index(self.idx_path)
        self.file_size = os.path.getsize(self.rec_path)
        past_end = np.flatnonzero(offsets >= self.file_size)
        if past_end.size:
            bad = past_end[0]
            raise DataError(f"{self.idx_path}: key {keys[bad]} points at offset {offsets[bad]}, past the end of "
                            f"{self.rec_path} ({self.file_size} bytes); the .rec is truncated or the .idx belongs to "
                            "another .rec; copy the matching pair again or re-pack")
        # mxnet keeps the index in a dict: a key listed twice means its last offset.
        kept = len(keys) - 1 - np.unique(keys[::-1], return_index=True)[1]
        self._keys, self._offsets = keys[kept], offsets[kept]
        # A record ends where the next one (in file order) starts, so one read usually fetches it whole.
        boundaries = np.unique(np.append(offsets, self.file_size))
        self._extents = boundaries[np.searchsorted(boundaries, self._offsets, side="right")] - self._offsets
        # Keys k0, k0+1, ... (every file tools write) are found by subtraction instead of a search.
        self._dense = len(keys) == 0 or np.array_equal(self._keys, self._keys[0] + np.arange(len(keys)))
        self._fd: int | None = None
        self._pid: int | None = None
        if len(keys):
            # An interrupted copy cuts the last record: say so now rather than hours into training.
            last = int(np.argmax(self._offsets))
            self.read(int(self._keys[last]))

    @cached_property
    def keys(self) -> list[int]:
        return self._keys.tolist()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return self._position(key) is not None

    def read(self, key: int) -> bytes:
        """The record's bytes (IRHeader + payload), parts rejoined."""
        pos = self._require(key)
        offset = int(self._offsets[pos])
        return self._read_at(key, offset, min(int(self._extents[pos]), _MAX_FIRST_READ))

    def read_header(self, key: int) -> IRHeader:
        """Only the IRHeader of a record (one small read; used to scan labels of flat datasets)."""
        pos = self._require(key)
        offset = int(self._offsets[pos])
        probe = self._read_at(key, offset, min(int(self._extents[pos]), _HEADER_PROBE), first_part_only=True)
        if len(probe) >= _IR_SIZE:
            flag = struct.unpack_from("<I", probe)[0]
            if len(probe) >= _IR_SIZE + 4 * flag:
                return unpack(probe)[0]
        return unpack(self.read(key))[0]

    def _position(self, key: int) -> int | None:
        n = len(self._keys)
        if self._dense and n:
            pos = int(key) - int(self._keys[0])
            return pos if 0 <= pos < n else None
        pos = int(np.searchsorted(self._keys, key))
        return pos if pos < n and self._keys[pos] == key else None

    def _require(self, key: int) -> int:
        pos = self._position(key)
        if pos is None:
            raise KeyError(f"key {key} is not in {self.idx_path}")
        return pos

    def _descriptor(self) -> int:
        if self._pid != os.getpid():
            self._fd = os.open(self.rec_path, os.O_RDONLY)
            self._pid = os.getpid()
        return self._fd

    def _read_at(self, key: int, offset: int, first_read: int, first_part_only: bool = False) -> bytes:
        fd = self._descriptor()
        buf = os.pread(fd, first_read, offset)

        def need(end: int) -> None:
            nonlocal buf
            if end > len(buf):
                buf += os.pread(fd, end - len(buf), offset + len(buf))
                if end > len(buf):
                    raise DataError(f"{self.rec_path} is truncated: record key {key} at offset {offset} needs "
                                    f"{end} bytes but the file ends at {offset + len(buf)}; copy the .rec again "
                                    "or re-pack")

        parts, pos = [], 0
        while True:
            need(pos + 8)
            magic, lrec = struct.unpack_from("<II", buf, pos)
            if magic != MAGIC:
                if pos == 0 and not self._neighbours_start_records(key):
                    raise DataError(f"{self.rec_path}: record key {key} at offset {offset} does not start with the "
                                    f"RecordIO magic (found 0x{magic:08X}), nor do the records beside it; the .idx "
                                    "does not match this .rec: use the .idx written with it or re-pack")
                raise BadRecordError(f"{self.rec_path}: record key {key} is damaged (no RecordIO magic at offset "
                                     f"{offset + pos}, found 0x{magic:08X}, though the records beside it start where "
                                     "the .idx says)", f"copy the .rec again or re-pack it, or {SKIP_FIX}")
            cflag, length = lrec >> 29, lrec & _LENGTH_MASK
            if cflag not in ((0, 1) if not parts else (2, 3)):
                raise BadRecordError(f"{self.rec_path}: record key {key} is damaged (a broken multi-part chain: part "
                                     f"flag {cflag} at offset {offset + pos})",
                                     f"copy the .rec again or re-pack it, or {SKIP_FIX}")
            if first_part_only:
                return bytes(buf[pos + 8:pos + 8 + length])
            need(pos + 8 + length)
            parts.append(buf[pos + 8:pos + 8 + length])
            pos += 8 + length + (-length % 4)
            if cflag in (0, 3):
                return _MAGIC_BYTES.join(parts)

    def _neighbours_start_records(self, key: int) -> bool:
        """Whether a record indexed next to ``key`` starts with the magic where the .idx puts it: then the .idx
        matches the .rec, and a record without its magic is damaged, not misplaced."""
        pos = self._require(key)
        return any(os.pread(self._descriptor(), 4, int(self._offsets[other])) == _MAGIC_BYTES
                   for other in (pos - 1, pos + 1) if 0 <= other < len(self._keys))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fd"], state["_pid"] = None, None
        state.pop("keys", None)
        return state

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            os.close(self._fd)
