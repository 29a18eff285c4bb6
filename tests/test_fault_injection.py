"""Fault injection on every file of a checkpoint: removed, truncated, one byte flipped inside its data,
or replaced by a crafted pickle whose unpickling would create a marker file. Each `--resume` ends in one
`error:` line naming what is wrong, no marker file appears, and the run folder (the damaged checkpoint
included) comes out byte for byte as it went in.

The checkpoint was written by two processes (two shards). A crafted payload is also planted with the
manifest rewritten to match it (as an attacker would), so that the unpickler itself, not the
checksum, is what refuses it; the checksums are computed here with the crc32c package and plain json.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.run_helpers import assert_nothing_lost, file_states, run_cli, run_here
from tests.test_state_file import MISSING, STATE_FIELDS, changed
from tests.test_train_errors import only_line

FOLDER = "checkpoint-000000002"
FILES = ["checkpoint.json", f"{FOLDER}/.metadata", f"{FOLDER}/__0_0.distcp", f"{FOLDER}/__1_0.distcp",
         f"{FOLDER}/state.json", f"{FOLDER}/manifest.json", f"{FOLDER}/backbone.pth", f"{FOLDER}/model.json"]
FAULTS = ["removed", "truncated", "flipped", "payload"]
PARSED = FILES[1:5] + FILES[6:7]  # the files a resume unpickles or parses (model.json is only checksummed)
CASES = [(name, fault) for name in FILES for fault in FAULTS if (name, fault) != ("checkpoint.json", "removed")] + [
    (name, "forged payload") for name in PARSED]
MARKER = "marker-the-payload-ran"


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("faults") / "run"
    result = run_cli(data, output, "max_steps=2", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (output / FOLDER / "manifest.json").is_file()
    return output


class _Payload:
    """Unpickling this creates `path`: what a hostile checkpoint would do (running a shell is no harder)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def payload(path: Path, marker: Path) -> bytes:
    """A crafted file of `path`'s kind: a torch.save archive for tensor files, a bare pickle otherwise."""
    if path.suffix in (".pth", ".distcp"):
        target = path.parent / "payload.tmp"
        torch.save({"weight": _Payload(marker)}, target)
        data = target.read_bytes()
        target.unlink()
        return data
    return pickle.dumps(_Payload(marker))


def data_offset(path: Path, trained: Path) -> int:
    """Where a tensor's values lie in `path`: the first centre row a shard holds (rank r of 2 holds rows
    10r..10r+9 of 20), or backbone.pth's first convolution, found by their bytes."""
    if path.suffix == ".distcp":
        whole = Path(path.parent / "whole.tmp")
        dcp_to_torch_save(trained / FOLDER, whole)
        values = torch.load(whole, weights_only=True)["centres"][10 * int(path.name[2])]
        whole.unlink()
    else:
        values = torch.load(path, weights_only=True)["conv1.weight"]
    return path.read_bytes().index(values.numpy().tobytes()) + values.numel() * values.element_size() // 2


def forge_manifest(folder: Path, name: str) -> None:
    """Rewrite the manifest (and its own checksum) so that it lists `name` as it now is."""
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["crc32c"]
    content = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(content), "crc32c": crc32c.crc32c(content)}
    manifest["crc32c"] = crc32c.crc32c(json.dumps(manifest, sort_keys=True).encode())
    (folder / "manifest.json").write_text(json.dumps(manifest))


def inject(run: Path, name: str, fault: str, marker: Path, trained: Path) -> None:
    path = run / name
    content = path.read_bytes()
    if fault == "removed":
        path.unlink()
    elif fault == "truncated":
        path.write_bytes(content[:len(content) // 2])
    elif fault == "flipped":
        at = data_offset(path, trained) if path.suffix in (".pth", ".distcp") else len(content) // 2
        changed = bytearray(content)
        changed[at] ^= 0x01
        path.write_bytes(bytes(changed))
    else:
        path.write_bytes(payload(path, marker))
        if fault == "forged payload":
            forge_manifest(path.parent, path.name)


@pytest.mark.parametrize("name, fault", CASES)
def test_a_damaged_or_hostile_checkpoint_file_is_one_error_line_and_changes_nothing(data, trained, tmp_path, name,
                                                                                     fault):
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    marker = tmp_path / MARKER
    inject(run, name, fault, marker, trained)
    before = file_states(run)
    status, stderr = run_here(data, run, "max_steps=4", resume=True)
    assert status == 1
    line = only_line(stderr)
    assert line.startswith("error: ") and "Traceback" not in stderr
    # a planted archive that DCP then reads at the offsets of the old one fails in torch's reader, which
    # does not say the file
    assert Path(name).name in line or "checkpoint.json" in line or fault == "forged payload", line
    assert not marker.exists()
    assert_nothing_lost(before, run)


def forge_state(folder: Path, path: tuple, value) -> None:
    """state.json with `path` set to `value` (or removed), carrying a valid checksum, listed so by the manifest."""
    content = json.loads((folder / "state.json").read_text())
    del content["crc32c"]
    content = changed(content, path, value)
    content["crc32c"] = crc32c.crc32c(json.dumps(content, sort_keys=True).encode())
    (folder / "state.json").write_text(json.dumps(content))
    forge_manifest(folder, "state.json")


@pytest.mark.parametrize("path, value, field", STATE_FIELDS,  # ids the same in every process (pytest-xdist's)
                         ids=[(f"{field} removed" if value is MISSING else f"{field}={value!r}")[:60]
                              for _, value, field in STATE_FIELDS])
def test_a_state_json_field_that_is_not_what_pairface_writes_is_one_error_line_naming_it(data, trained, tmp_path,
                                                                                        path, value, field):
    """Every field a resume reads, with a valid checksum: refused before anything uses it (the random streams
    otherwise end in a traceback from random.setstate), the line naming the file and the field."""
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    forge_state(run / FOLDER, path, value)
    before = file_states(run)
    status, stderr = run_here(data, run, "max_steps=4", resume=True)
    assert status == 1 and "Traceback" not in stderr
    line = only_line(stderr)
    assert line.startswith(f"error: checkpoint {run / FOLDER} is damaged ({run / FOLDER / 'state.json'}: field "
                           f"'{field}' "), line
    assert_nothing_lost(before, run)


def test_on_the_same_world_size_a_forged_random_stream_is_one_line_not_random_setstates_traceback(data, tmp_path):
    """The resume that puts every rank's streams back (one process, as saved): Python's random state with its
    position past the 624 words, which random.setstate refuses with a ValueError, is refused first, by its field."""
    run = tmp_path / "run"
    assert run_here(data, run, "max_steps=1") == (0, "")
    folder = run / "checkpoint-000000001"
    forge_state(folder, ("ranks", 0, "rng", "python", 1, 624), 625)
    before = file_states(run)
    status, stderr = run_here(data, run, "max_steps=2", resume=True)
    assert status == 1 and "Traceback" not in stderr
    assert only_line(stderr).startswith(f"error: checkpoint {folder} is damaged ({folder / 'state.json'}: field "
                                        "'ranks[0].rng.python' must be random.getstate()'s [3, ")
    assert_nothing_lost(before, run)


def test_a_run_folder_without_its_pointer_resumes_from_its_newest_complete_folder_after_checking_it(data, trained,
                                                                                                  tmp_path):
    """checkpoint.json removed (by hand, or a first save killed between its rename and the switch): the newest
    complete checkpoint folder is verified file by file and resumed, and the log says so; a damaged one is
    refused like any other."""
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    (run / "checkpoint.json").unlink()
    assert run_here(data, run, "max_steps=5", resume=True) == (0, "")
    log = (run / "training.log").read_text()
    assert f"{run} holds no checkpoint.json: resuming from {run / FOLDER}, its newest complete checkpoint" in log
    # 2 processes' step 2 is step 4 of one's schedule; the log and the checkpoints count on from the shown 2
    assert f"resumed from {run / FOLDER} at global step 2 " in log
    assert json.loads((run / "checkpoint.json").read_text())["global_step"] == 3


def linked_copy(trained: Path, target: Path) -> Path:
    """A copy of the run whose backbone.pth and model.json are links to its folder's, as a save leaves them."""
    run = Path(shutil.copytree(trained, target))
    for name in ("backbone.pth", "model.json"):
        (run / name).unlink()
        os.link(run / FOLDER / name, run / name)
    return run


def test_the_run_folders_own_backbone_is_the_published_one(data, trained, tmp_path):
    """backbone.pth and model.json beside checkpoint.json are the published folder's files (one inode): a byte
    changed there is a byte changed in the checkpoint, refused; removed, they are not needed to resume and
    the next save puts them back."""
    changed = linked_copy(trained, tmp_path / "changed")
    inject(changed, "backbone.pth", "flipped", tmp_path / MARKER, trained)
    status, stderr = run_here(data, changed, "max_steps=5", resume=True)
    assert status == 1 and f"{changed / FOLDER / 'backbone.pth'} does not match its checksum" in only_line(stderr)
    run = linked_copy(trained, tmp_path / "run")
    for name in ("backbone.pth", "model.json"):
        (run / name).unlink()
    assert run_here(data, run, "max_steps=5", resume=True) == (0, "")
    # schedule step 5 of one process (max_steps) is the shown step 3 of the 2-process run resumed
    assert os.path.samefile(run / "backbone.pth", run / "checkpoint-000000003" / "backbone.pth")
    assert (run / "model.json").read_bytes() == (run / "checkpoint-000000003" / "model.json").read_bytes()
