"""checkpoint.json and the names of checkpoint folders (checkpoint/pointer.py), in one process: which folder
names have a step, which folders are complete, and checkpoint.json read back checked field by field. The
checksums are computed here with the crc32c package (test_manifest.py's with_checksum), the reference the
file is read against.
"""
from __future__ import annotations

import json
import os

import pytest

from checkpoint.pointer import FORMAT, complete_folders, folder_step, free_folder_name, read_pointer, write_pointer
from tests.test_manifest import with_checksum
from utils.errors import CheckpointError


@pytest.mark.parametrize(("name", "step"), [
    ("checkpoint-000000012", 12), ("checkpoint-000000012-3", 12), ("checkpoint-123456789-10", 123456789),
    ("checkpoint-12", None), ("checkpoint-0000000012", None), ("checkpoint-000000012-", None),
    ("checkpoint-000000012-x", None), (".tmp-checkpoint-000000012", None), ("xcheckpoint-000000012", None),
    ("checkpoint-000000012.bak", None),
])
def test_only_checkpoint_folder_names_have_a_step(name, step):
    assert folder_step(name) == step


def test_a_new_folder_name_never_reuses_an_existing_one(tmp_path):
    assert free_folder_name(tmp_path, 7) == "checkpoint-000000007"
    (tmp_path / "checkpoint-000000007").mkdir()
    assert free_folder_name(tmp_path, 7) == "checkpoint-000000007-1"
    (tmp_path / "checkpoint-000000007-1").write_text("")  # a file of that name counts too
    assert free_folder_name(tmp_path, 7) == "checkpoint-000000007-2"
    assert free_folder_name(tmp_path, 8) == "checkpoint-000000008"


def test_complete_folders_are_those_with_a_manifest_newest_step_first_then_newest_written(tmp_path):
    def folder(name: str, manifest: bool = True, mtime: int = 0):
        path = tmp_path / name
        path.mkdir()
        if manifest:
            (path / "manifest.json").write_text("{}")
        os.utime(path, ns=(mtime, mtime))
        return path

    older_save = folder("checkpoint-000000009-1", mtime=10 ** 18)
    same_step_later = folder("checkpoint-000000009", mtime=2 * 10 ** 18)  # a renumbered resume's, written later
    newest = folder("checkpoint-000000010")
    first = folder("checkpoint-000000002", mtime=3 * 10 ** 18)
    folder("checkpoint-000000011", manifest=False)  # cut short
    folder(".tmp-checkpoint-000000012")
    folder("checkpoint-000000013.old")
    (tmp_path / "checkpoint-000000014").write_text("")  # a file, no manifest inside
    assert complete_folders(tmp_path) == [newest, same_step_later, older_save, first]


MODEL = {"network": "r18", "embedding_size": 32}


def test_checkpoint_json_reads_back_what_was_written_checksummed(tmp_path):
    write_pointer(tmp_path, "checkpoint-000000004", 4, 2, MODEL)
    content = json.loads((tmp_path / "checkpoint.json").read_bytes())
    expected = {"format": FORMAT, "directory": "checkpoint-000000004", "global_step": 4, "world_size": 2,
                "model": MODEL}
    assert content == json.loads(with_checksum(expected))
    assert read_pointer(tmp_path / "checkpoint.json") == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]  # no temporary file left


POINTERS = {"format": FORMAT, "directory": "checkpoint-000000004", "global_step": 4, "world_size": 2, "model": MODEL}


@pytest.mark.parametrize(("changes", "reason"), [
    ({"format": None}, "its 'format' is missing or not a str"),
    ({"directory": 4}, "its 'directory' is missing or not a str"),
    ({"global_step": "4"}, "its 'global_step' is missing or not a int"),
    ({"world_size": 2.0}, "its 'world_size' is missing or not a int"),
    ({"model": ["r18"]}, "its 'model' is missing or not a dict"),
    ({"format": "pairface-checkpoint-4"}, f"it is of format 'pairface-checkpoint-4', not {FORMAT!r}"),
    ({"directory": "../checkpoint-000000004"}, "its directory '../checkpoint-000000004' is not a checkpoint folder "
                                               "beside it"),
    ({"directory": "checkpoint-000000004/.."}, "its directory 'checkpoint-000000004/..' is not a checkpoint folder "
                                               "beside it"),
])
def test_a_checkpoint_json_with_a_field_not_as_written_is_one_error_naming_the_field(tmp_path, changes, reason):
    content = {key: value for key, value in {**POINTERS, **changes}.items() if value is not None}
    pointer = tmp_path / "checkpoint.json"
    pointer.write_bytes(with_checksum(content))
    with pytest.raises(CheckpointError) as raised:
        read_pointer(pointer)
    assert str(raised.value) == (f"{pointer} is damaged ({reason}); resume from one of the checkpoint-<step> folders "
                                 f"beside it with --set resume={tmp_path}/checkpoint-<step>, or start a new run")


@pytest.mark.parametrize("content", [b"", b"{", json.dumps({**POINTERS, "crc32c": 1}).encode(), b"[1]",
                                     b"[" * 100_000 + b"]" * 100_000, None])
def test_a_damaged_checkpoint_json_is_one_error_saying_what_is_wrong(tmp_path, content):
    """Cut, changed, not an object, nested past the parser's depth, or a folder (None) in its place."""
    pointer = tmp_path / "checkpoint.json"
    if content is None:
        pointer.mkdir()
    else:
        pointer.write_bytes(content)
    with pytest.raises(CheckpointError) as raised:
        read_pointer(pointer)
    reason = "[Errno 21] Is a directory: " if content is None else f"{pointer} "
    assert str(raised.value).startswith(f"{pointer} is damaged ({reason}")
    assert str(raised.value).endswith("or start a new run")


def test_an_earlier_formats_checkpoint_json_says_which_version_reads_it_and_how_to_start_from_its_backbone(tmp_path):
    """pairface-checkpoint-2 wrote checkpoint.json as plain JSON, without a checksum: recognised by its format."""
    content = {**POINTERS, "format": "pairface-checkpoint-2"}
    pointer = tmp_path / "checkpoint.json"
    pointer.write_text(json.dumps(content, indent=2))
    with pytest.raises(CheckpointError) as raised:
        read_pointer(pointer)
    assert str(raised.value) == (
        f"{pointer} was written by an earlier pairface, whose checkpoint folders hold pickles that this version "
        f"never loads; resume it with that version, or start from its backbone: --set resume={tmp_path}/backbone.pth "
        "--set output=<a new folder>")
