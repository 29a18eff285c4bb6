"""The restricted unpickler of DCP's `.metadata` (checkpoint/safe_dcp.py), fed pickles crafted opcode by opcode.

A checkpoint's index is a plain pickle that `--resume` reads before anything else: a crafted one must not
reach any callable. The pickles here are written by hand from pickletools' opcodes, one per way a pickle
names or calls something (GLOBAL, STACK_GLOBAL, INST, OBJ, REDUCE, NEWOBJ, NEWOBJ_EX, EXT1/2/4), each with
arguments that would create a marker file if the callable ran; and every callable that builtins, os,
subprocess, torch's loading internals and pairface's own modules hold is named once. Each is refused with
the one sentence naming it, and the marker never appears. What an index legitimately names is listed
here, independently of the module, from what DCP's own `.metadata` holds (checked on a real one).
"""
from __future__ import annotations

import builtins
import copyreg
import importlib
import io
import os
import pathlib
import pickle
import pkgutil
import posix
import struct
import subprocess
import warnings
from dataclasses import fields

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.safe_dcp import MetadataError, SafeReader, TensorsOnlyPlanner, read_metadata
from tests.run_helpers import ROOT
from utils.compat import dcp_group

PROTO2, PROTO4, STOP, MARK, TUPLE, EMPTY_TUPLE = b"\x80\x02", b"\x80\x04", b".", b"(", b"t", b")"
REDUCE, BUILD, OBJ, NEWOBJ, NEWOBJ_EX, STACK_GLOBAL, EMPTY_DICT = b"R", b"b", b"o", b"\x81", b"\x92", b"\x93", b"}"
EXTENSION_CODES = {"EXT1": 0xEF, "EXT2": 0xBEEF, "EXT4": 0xBADBEEF}  # registered with copyreg for one pickle each


def unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def binbytes(data: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(data)) + data  # BINBYTES (protocol 3+)


def arguments(*values: str | bytes) -> bytes:
    return b"".join(unicode(value) if isinstance(value, str) else binbytes(value) for value in values)


def glob(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()  # GLOBAL


def stack_glob(module: str, name: str) -> bytes:
    return unicode(module) + unicode(name) + STACK_GLOBAL


# Each opcode that names a callable (GLOBAL, STACK_GLOBAL, INST, EXT*) or calls one (REDUCE, OBJ, NEWOBJ,
# NEWOBJ_EX): the pickle calling `module.name(*args)`, or for NEWOBJ `module.name.__new__(module.name, *args)`.
OPCODES = {
    "GLOBAL+REDUCE": lambda m, n, args: PROTO2 + glob(m, n) + MARK + arguments(*args) + TUPLE + REDUCE + STOP,
    "STACK_GLOBAL+REDUCE": lambda m, n, args: PROTO4 + stack_glob(m, n) + MARK + arguments(*args) + TUPLE + REDUCE
    + STOP,
    "INST": lambda m, n, args: MARK + arguments(*args) + f"i{m}\n{n}\n".encode() + STOP,
    "GLOBAL+OBJ": lambda m, n, args: PROTO2 + MARK + glob(m, n) + arguments(*args) + OBJ + STOP,
    "STACK_GLOBAL+OBJ": lambda m, n, args: PROTO4 + MARK + stack_glob(m, n) + arguments(*args) + OBJ + STOP,
    "GLOBAL+NEWOBJ": lambda m, n, args: PROTO2 + glob(m, n) + MARK + arguments(*args) + TUPLE + NEWOBJ + STOP,
    "STACK_GLOBAL+NEWOBJ_EX": lambda m, n, args: PROTO4 + stack_glob(m, n) + MARK + arguments(*args) + TUPLE
    + EMPTY_DICT + NEWOBJ_EX + STOP,
    "EXT1+REDUCE": lambda m, n, args: PROTO2 + b"\x82" + bytes([EXTENSION_CODES["EXT1"]]) + MARK + arguments(*args)
    + TUPLE + REDUCE + STOP,
    "EXT2+REDUCE": lambda m, n, args: PROTO2 + b"\x83" + struct.pack("<H", EXTENSION_CODES["EXT2"]) + MARK
    + arguments(*args) + TUPLE + REDUCE + STOP,
    "EXT4+REDUCE": lambda m, n, args: PROTO2 + b"\x84" + struct.pack("<i", EXTENSION_CODES["EXT4"]) + MARK
    + arguments(*args) + TUPLE + REDUCE + STOP,
}


class _OpensMarker:
    """torch.save's pickle of this opens `path` for writing when loaded without weights_only."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def hostile_calls(marker: pathlib.Path) -> dict[str, tuple[str, str, tuple]]:
    """(module, name, arguments) whose call would create `marker`: the builtins that run code or reach any
    other callable, the shell, torch's own unrestricted loaders, and a pairface function that writes files."""
    path = str(marker)
    source = f"open({path!r}, 'w').close()"
    return {
        "builtins.eval": ("builtins", "eval", (source,)),
        "builtins.exec": ("builtins", "exec", (source,)),
        "builtins.open": ("builtins", "open", (path, "w")),
        "builtins.compile": ("builtins", "compile", (source, "x", "exec")),  # the first step of a chain
        "builtins.getattr": ("builtins", "getattr", (path, "__class__")),  # reaches any method of any object
        "builtins.__import__": ("builtins", "__import__", ("os",)),  # reaches any module
        "os.system": ("os", "system", (f"touch {path}",)),
        "posix.system": ("posix", "system", (f"touch {path}",)),  # how pickle itself names os.system
        "os.popen": ("os", "popen", (f"touch {path}",)),
        "subprocess.getoutput": ("subprocess", "getoutput", (f"touch {path}",)),
        "subprocess.Popen": ("subprocess", "Popen", (f"touch {path}",)),
        "torch.load": ("torch", "load", (path,)),
        "torch.serialization.load": ("torch.serialization", "load", (path,)),
        "torch.storage._load_from_bytes": ("torch.storage", "_load_from_bytes", (_saved(_OpensMarker(path)),)),
        "torch.save": ("torch", "save", ("x", path)),
        "utils.atomic.atomic_save": ("utils.atomic", "atomic_save", (b"x", path)),
        "dotted torch.serialization.load": ("torch", "serialization.load", (path,)),  # protocol 4 resolves dots
    }


def refusal(module: str, name: str) -> str:
    return f"it names {module}.{name}, which a checkpoint index never holds"


def read(tmp_path: pathlib.Path, content: bytes, name: str = ".metadata"):
    path = tmp_path / name  # a new file for each pickle of a sweep: rewriting one is ~100 times slower
    path.write_bytes(content)
    return read_metadata(path)


@pytest.mark.parametrize("opcode", OPCODES)
def test_a_crafted_index_calling_anything_is_refused_in_one_sentence_naming_it_and_nothing_runs(tmp_path, opcode):
    marker = tmp_path / "marker-the-index-ran-code"
    for case, (module, name, args) in hostile_calls(marker).items():
        content = OPCODES[opcode](module, name, args)
        code = EXTENSION_CODES.get(opcode.split("+")[0])
        if code:  # an extension code names its callable through copyreg's registry
            copyreg.add_extension(module, name, code)
        try:
            with pytest.raises(MetadataError) as raised:
                read(tmp_path, content)
        finally:
            if code:
                copyreg.remove_extension(module, name, code)
        assert not marker.exists(), f"{case} ran"
        assert str(raised.value) == refusal(module, name), case
        assert {p.name for p in tmp_path.iterdir()} == {".metadata"}, case


# What DCP's index of a pairface checkpoint is made of: its metadata classes, torch.Size and dtypes, layouts
# (pickled as torch.serialization._get_layout("torch.strided")) and paths.
LEGITIMATE = {(cls.__module__, cls.__qualname__) for cls in (
    dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta,
    dcp_metadata._MEM_FORMAT_ENCODING, dcp_filesystem._StorageInfo, torch.Size, pathlib.PosixPath)} | {
    ("torch.serialization", "_get_layout")} | {
    ("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
SWEPT = [builtins, os, posix, subprocess, torch, torch.serialization, torch.storage, torch._utils, torch.hub,
         torch.jit, torch.package, dcp_metadata, dcp_filesystem, pickle, copyreg, importlib]


def project_modules() -> list:
    """Every module of pairface's own packages and the top-level modules (train.py imports the rest)."""
    modules = [importlib.import_module(name) for name in ("train", "dataset", "partial_fc", "losses")]
    for package in ("utils", "facedata", "backbones", "eval", "training", "checkpoint", "tools"):
        modules += [importlib.import_module(info.name)
                    for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}.")]
    return modules


def test_every_name_of_builtins_os_subprocess_torchs_loaders_and_pairfaces_modules_is_refused(tmp_path):
    """Named alone (GLOBAL and STACK_GLOBAL, the pickle's result the object itself): whatever would come back
    is refused by its name before it exists, DCP's index classes excepted, which a real index does hold."""
    modules = SWEPT + project_modules()
    named = sorted({(module.__name__, name) for module in modules for name in dir(module)} - LEGITIMATE)
    assert len(named) > 5000 and ("builtins", "eval") in named and ("checkpoint.safe_dcp", "read_metadata") in named
    wrong = {}
    for number, (module, name) in enumerate(named):
        for protocol, content in enumerate((PROTO2 + glob(module, name) + STOP,
                                            PROTO4 + stack_glob(module, name) + STOP)):
            try:
                read(tmp_path, content, f"{number}.{protocol}")
            except MetadataError as error:
                if str(error) != refusal(module, name):
                    wrong[module, name] = str(error)
            else:
                wrong[module, name] = "read"
    assert wrong == {}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: meant
def test_a_real_dcp_index_reads_back_with_its_tensors_sizes_and_dtypes(tmp_path):
    """The control for the refusals above: what DCP writes for pairface's tensors passes."""
    state = {"centres": torch.zeros(5, 3), "optimizer.0.momentum_buffer": torch.zeros(5, 3, dtype=torch.float64)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), **dcp_group(None))
    metadata = read_metadata(tmp_path / ".metadata")
    assert {fqn: (tuple(md.size), md.properties.dtype) for fqn, md in metadata.state_dict_metadata.items()} == {
        "centres": ((5, 3), torch.float32), "optimizer.0.momentum_buffer": ((5, 3), torch.float64)}


@pytest.fixture(scope="module")
def real_index(tmp_path_factory) -> bytes:
    """The `.metadata` DCP writes for a centre matrix and its momentum, in one process."""
    folder = tmp_path_factory.mktemp("dcp")
    state = {"centres": torch.zeros(5, 3), "optimizer.0.momentum_buffer": torch.zeros(5, 3)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process, no group: meant
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), **dcp_group(None))
    return (folder / ".metadata").read_bytes()


def changed(index: bytes, change) -> bytes:
    """The index unpickled plainly, `change`d in place (or replaced by what `change` returns), pickled again."""
    metadata = pickle.loads(index)
    return pickle.dumps(change(metadata) or metadata)


def _first_storage(metadata):
    return next(iter(metadata.storage_data.values()))


def _with_storage(field: str, value):
    return lambda metadata: setattr(_first_storage(metadata), field, value)


def _with_entry(field: str, value):
    return lambda metadata: setattr(metadata.state_dict_metadata["centres"], field, value)


def _with_properties(field: str, value):
    return lambda metadata: setattr(metadata.state_dict_metadata["centres"].properties, field, value)


NOT_AN_INDEX = "it does not hold DCP's index of tensors and their storage"
MALFORMED_ENTRIES = {
    "not a Metadata": (lambda metadata: torch.Size([1]), NOT_AN_INDEX),
    "entries a list": (lambda metadata: setattr(metadata, "state_dict_metadata", []), NOT_AN_INDEX),
    "storage a list": (lambda metadata: setattr(metadata, "storage_data", [1]), NOT_AN_INDEX),
    "a name not a string": (lambda metadata: metadata.state_dict_metadata.__setitem__(
        7, metadata.state_dict_metadata.pop("centres")), "its entry 7 is not a tensor (pairface checkpoints hold "
                                                         "tensors only)"),
    "an entry not a tensor": (lambda metadata: metadata.state_dict_metadata.__setitem__(
        "centres", torch.Size([5, 3])), "its entry 'centres' is not a tensor (pairface checkpoints hold tensors only)"),
    "properties missing": (_with_entry("properties", None), "its entry 'centres' is malformed"),
    "dtype a string": (_with_properties("dtype", "float32"), "its entry 'centres' is malformed"),
    "size a tuple": (_with_entry("size", (5, 3)), "its entry 'centres' is malformed"),
    "a chunk not a chunk": (lambda metadata: metadata.state_dict_metadata["centres"].chunks.append((0, 0)),
                            "its entry 'centres' is malformed"),
}


MALFORMED_STORAGE = {
    "index a string": lambda metadata: metadata.storage_data.__setitem__("centres",
                                                                          metadata.storage_data.popitem()[1]),
    "storage a path": lambda metadata: metadata.storage_data.__setitem__(
        next(iter(metadata.storage_data)), pathlib.PosixPath("__0_0.distcp")),
    "file a path": _with_storage("relative_path", pathlib.PosixPath("__0_0.distcp")),
    "file outside the folder": _with_storage("relative_path", "../__0_0.distcp"),
    "file in a subfolder": _with_storage("relative_path", "x/__0_0.distcp"),
    "file not a shard": _with_storage("relative_path", "__0_0.distcp.pth"),
    "file prefixed": _with_storage("relative_path", "a__0_0.distcp"),
    "offset negative": _with_storage("offset", -1),
    "offset a bool": _with_storage("offset", True),
    "offset a float": _with_storage("offset", 0.0),
    "length negative": _with_storage("length", -8),
    "length a bool": _with_storage("length", False),
    "length a string": _with_storage("length", "60"),
    "transformed": _with_storage("transform_descriptors", ["zstd"]),
}


@pytest.mark.parametrize("case", MALFORMED_ENTRIES)
def test_an_index_of_allowed_classes_holding_anything_but_tensors_in_shard_files_is_refused(tmp_path, real_index,
                                                                                           case):
    change, message = MALFORMED_ENTRIES[case]
    with pytest.raises(MetadataError) as raised:
        read(tmp_path, changed(real_index, change))
    assert str(raised.value) == message


@pytest.mark.parametrize("case", MALFORMED_STORAGE)
def test_an_index_naming_storage_outside_the_folders_shards_or_transformed_is_refused(tmp_path, real_index, case):
    if case == "transformed" and "transform_descriptors" not in {f.name for f in fields(dcp_filesystem._StorageInfo)}:
        pytest.skip("this torch's DCP stores no transforms")
    content = changed(real_index, MALFORMED_STORAGE[case])
    index = next(iter(pickle.loads(content).storage_data))
    with pytest.raises(MetadataError) as raised:
        read(tmp_path, content)
    assert str(raised.value) == f"its storage entry for {getattr(index, 'fqn', index)!r} is malformed"


def test_the_real_index_with_its_storage_at_offset_and_length_zero_reads(tmp_path, real_index):
    """The control for the refusals above: zero is a natural offset and length."""
    content = changed(real_index, lambda metadata: [_with_storage(f, 0)(metadata) for f in ("offset", "length")]
                      and None)
    assert {info.offset for info in read(tmp_path, content).storage_data.values()} >= {0}


@pytest.mark.parametrize("content", [b"", b"\x80\x04\x95", b"garbage", b"\x80\x02]q\x00(K\x01"])
def test_a_damaged_index_is_one_sentence_saying_it_is_not_readable(tmp_path, content):
    with pytest.raises(MetadataError) as raised:
        read(tmp_path, content)
    assert str(raised.value).startswith("it is not a readable index (") and "\n" not in str(raised.value)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_folder_read_through_the_safe_reader_and_planner_loads_its_tensors(tmp_path):
    saved = {"centres": torch.arange(15.0).view(5, 3)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path), **dcp_group(None))
    loaded = {"centres": torch.zeros(5, 3)}
    dcp.load(loaded, storage_reader=SafeReader(tmp_path), planner=TensorsOnlyPlanner(), **dcp_group(None))
    assert torch.equal(loaded["centres"], saved["centres"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_entry_stored_as_a_pickle_is_refused_by_the_planner_before_it_is_unpickled(tmp_path):
    """Even behind a reader that let the index through (DCP's own), the planner unpickles no bytes entry."""
    marker = tmp_path / "marker-the-entry-ran-code"
    dcp.save({"centres": torch.zeros(2), "extra": _OpensMarker(str(marker))},
             storage_writer=dcp.FileSystemWriter(tmp_path / "folder"), **dcp_group(None))
    with pytest.raises(CheckpointException) as raised:  # DCP wraps what a planner raises
        dcp.load({"centres": torch.zeros(2), "extra": None}, storage_reader=dcp.FileSystemReader(tmp_path / "folder"),
                 planner=TensorsOnlyPlanner(), **dcp_group(None))
    assert "its entry 'extra' is stored as a pickle" in str(raised.value)
    assert not marker.exists()
