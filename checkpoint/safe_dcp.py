"""Reading torch.distributed.checkpoint (DCP) folders without running anything they contain.

DCP keeps a folder's index (`.metadata`) as a plain pickle, and hands any entry the index marks as
bytes to `torch.load(weights_only=False)`: a crafted folder could run code on load. Here the index
goes through an unpickler that can build only DCP's own metadata classes (plus torch.Size, dtypes,
layouts and paths), the result is checked entry by entry against what pairface writes (tensors only,
in `__<rank>_<n>.distcp` files of this folder), and a planner that refuses bytes entries loads the
tensors; DCP reads tensor data with torch's weights-only unpickler itself. Checkpoints stay plain
DCP folders that torch's own tools read.
"""
from __future__ import annotations

import pathlib
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from utils.compat import dcp_storage_transforms

SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
_CLASSES = {(cls.__module__, cls.__qualname__): cls for cls in (
    dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta,
    dcp_metadata._MEM_FORMAT_ENCODING, dcp_filesystem._StorageInfo, torch.Size, pathlib.PosixPath)}
_LAYOUTS = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}


class MetadataError(ValueError):
    """A `.metadata` file that is not DCP's index of a pairface checkpoint."""


class _MetadataUnpickler(pickle.Unpickler):
    """pickle with every global refused but DCP's metadata classes and torch's dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _CLASSES[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _LAYOUTS.__getitem__  # DCP pickles a layout as _get_layout("torch.strided")
        raise MetadataError(f"it names {module}.{name}, which a checkpoint index never holds")


def read_metadata(path: pathlib.Path) -> dcp_metadata.Metadata:
    """The DCP index at `path`, checked; MetadataError (or OSError) for anything else."""
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle).load()
        except MetadataError:
            raise
        except Exception as error:  # a damaged pickle fails in many ways (MemoryError included)
            raise MetadataError(f"it is not a readable index ({type(error).__name__})") from None
    _check(metadata)
    return metadata


def _check(metadata: object) -> None:
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise MetadataError("it does not hold DCP's index of tensors and their storage")
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str) or not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise MetadataError(f"its entry {fqn!r} is not a tensor (pairface checkpoints hold tensors only)")
        if not isinstance(entry.properties, dcp_metadata.TensorProperties) \
                or not isinstance(entry.properties.dtype, torch.dtype) or not isinstance(entry.size, torch.Size) \
                or not all(isinstance(c, dcp_metadata.ChunkStorageMetadata) for c in entry.chunks):
            raise MetadataError(f"its entry {fqn!r} is malformed")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, dcp_filesystem._StorageInfo) \
                or not isinstance(info.relative_path, str) or not SHARD_FILE.fullmatch(info.relative_path) \
                or not _natural(info.offset) or not _natural(info.length) or dcp_storage_transforms(info):
            raise MetadataError(f"its storage entry for {getattr(index, 'fqn', index)!r} is malformed")


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SafeReader(FileSystemReader):
    """FileSystemReader whose index is read by read_metadata above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(pathlib.Path(self.path) / ".metadata")
        metadata.storage_meta = dcp_metadata.StorageMeta(load_id=self.load_id)
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner without its one unrestricted unpickler: an entry stored as bytes is refused."""

    def load_bytes(self, read_item, value) -> None:
        raise MetadataError(f"its entry {read_item.dest_index.fqn!r} is stored as a pickle")
