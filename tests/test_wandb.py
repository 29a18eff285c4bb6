"""using_wandb: a real run in wandb's offline mode (no network) logs what TensorBoard gets, and the
backbone as an artifact; without the package, one line says how to install it.

The run file is read back with a reader written here for its container (the LevelDB log format wandb
stores its protobuf records in), not through wandb."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from gpu_acceptance.runs import scalars
from tests.run_helpers import run_here

BLOCK = 32768  # LevelDB log blocks
FULL, LAST = 1, 4


def wandb_records(path: Path):
    """The protobuf Records of a .wandb file: a 7-byte file header, then LevelDB log records
    (crc32c, length, type) in 32 KiB blocks, a record split over blocks as FIRST/MIDDLE/LAST pieces."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415 (wandb is an optional extra)

    raw, position, pieces = path.read_bytes(), 7, b""
    while position + 7 <= len(raw):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < 7:
            position += left_in_block  # a block's tail too short for a header is padding
            continue
        _, length, kind = struct.unpack("<IHB", raw[position:position + 7])
        pieces += raw[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


def test_an_offline_run_logs_the_tensorboard_scalars_and_the_backbone(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    output = tmp_path / "run"
    status, stderr = run_here(data, output, "max_steps=3", "using_wandb=True", "save_artifacts=True",
                              "suffix_run_name='pair'")
    assert status == 0, stderr
    # run.finish() returns once wandb's service has taken the run's end, not once it has written the run file:
    # the file is whole when the service has shut down (as at a training process's exit).
    import wandb  # noqa: PLC0415 (wandb is an optional extra)

    wandb.teardown()
    (run_file,) = output.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[str, dict[int, float]] = {}
    runs, artifacts = [], []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, {})[items["_step"]] = value
        elif kind == "run":
            runs.append(record.run)
        elif kind == "artifact":
            artifacts.append(record.artifact)
    for tag in ("loss", "loss_view1", "loss_view2", "learning_rate", "samples_per_sec"):
        assert history[tag] == pytest.approx(scalars(output, tag), rel=1e-6), tag
    assert runs and runs[0].display_name.endswith("_GPU0_pair") and runs[0].project == "pairface"
    assert [a.type for a in artifacts] == ["model"] and artifacts[0].name.endswith("_Final")


def test_without_the_package_one_line_says_how_to_install_it(data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what a machine without wandb has: import fails
    status, stderr = run_here(data, tmp_path / "run", "max_steps=1", "using_wandb=True")
    assert status == 1
    assert stderr.strip() == ("error: using_wandb=True needs the wandb package; install it with `pip install wandb`, "
                              "or set using_wandb=False")
