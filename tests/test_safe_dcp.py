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

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from checkpoint.safe_dcp import MetadataError, read_metadata
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
