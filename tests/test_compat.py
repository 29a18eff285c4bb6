"""utils/compat.py: what differs between torch releases, on the torch this runs on (the compatibility tier
runs this file on the oldest supported torch and on 2.11 too).

Centre rows are saved and loaded as row blocks at explicit offsets in either of the two forms
utils/compat.py picks between (torch's checkpointable-tensor attributes where torch has them, else a
ShardedTensor), and the files of one form must load through the other: a checkpoint written under
one torch resumes under another.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import train
from partial_fc import class_range
from tests.distributed_helpers import run_world
from tools import export_onnx
from utils import compat

TOTAL_ROWS, WIDTH = 7, 3
WHOLE = torch.arange(TOTAL_ROWS * WIDTH, dtype=torch.float64).view(TOTAL_ROWS, WIDTH)
# both forms where this torch has the attributes' protocol, else the ShardedTensor alone
FORMS = [True, False] if compat.checkpointable_attributes() else [False]


def _block(rows: torch.Tensor, first_row: int, attributes: bool) -> torch.Tensor:
    """compat.row_block in the form asked for."""
    return compat.row_block(rows, TOTAL_ROWS, first_row, attributes)


def _save_blocks(rank: int, world_size: int, folder: str) -> None:
    """Each rank saves its rows of WHOLE (uneven split: 4 + 3 on two ranks), once in each form."""
    start, count = class_range(TOTAL_ROWS, rank, world_size)
    for attributes in FORMS:
        rows = WHOLE[start:start + count].clone()
        dcp.save({"centres": _block(rows, start, attributes)},
                 storage_writer=FileSystemWriter(f"{folder}/{attributes}"), **compat.dcp_group())
    # No rank tears its group down while a peer is still in DCP's last collective: torch 2.4's gloo then
    # aborts the process ("terminate called without an active exception", seen once in four runs).
    dist.barrier()


def _load_blocks(rank: int, world_size: int, folder: str) -> dict:
    """{(saved form, loading form): the rows this rank read}, each read into a tensor of its own."""
    start, count = class_range(TOTAL_ROWS, rank, world_size)
    loaded = {}
    for saved in FORMS:
        for loading in FORMS:
            rows = torch.full((count, WIDTH), -1.0, dtype=torch.float64)
            dcp.load({"centres": _block(rows, start, loading)}, storage_reader=FileSystemReader(f"{folder}/{saved}"),
                     **compat.dcp_group())
            loaded[saved, loading] = rows
    dist.barrier()  # as in _save_blocks
    return loaded


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("blocks"))
    run_world(_save_blocks, 2, folder)
    return folder


def test_rows_saved_by_two_processes_load_on_three_in_every_form(saved_on_two):
    """Three ranks (3 + 2 + 2 rows) read across the two writers' blocks (4 + 3), in place."""
    for rank, loaded in enumerate(run_world(_load_blocks, 3, saved_on_two)):
        start, count = class_range(TOTAL_ROWS, rank, 3)
        assert sorted(loaded) == sorted((s, lo) for s in FORMS for lo in FORMS)
        for forms, rows in loaded.items():
            assert torch.equal(rows, WHOLE[start:start + count]), (rank, forms)


def test_rows_saved_by_two_processes_load_whole_in_one_without_a_process_group(saved_on_two):
    for saved in FORMS:
        whole = torch.zeros(TOTAL_ROWS, WIDTH, dtype=torch.float64)
        dcp.load({"centres": whole}, storage_reader=FileSystemReader(f"{saved_on_two}/{saved}"), **compat.dcp_group())
        assert torch.equal(whole, WHOLE), saved


def test_a_row_block_loads_into_the_memory_it_was_made_from():
    rows = torch.zeros(3, WIDTH, dtype=torch.float64)
    for attributes in FORMS:
        block = _block(rows, 4, attributes)
        assert not hasattr(rows, "global_offsets")  # the attributes go on a new tensor object, not on `rows`
        local = block if attributes else block.local_shards()[0].tensor
        local.fill_(2.0)
        assert rows.eq(2.0).all()
        rows.zero_()


def _older_torch(monkeypatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.3.1+cu121")


def test_an_older_torch_is_refused_by_train_py_in_one_line(monkeypatch, capsys, tmp_path):
    _older_torch(monkeypatch)
    assert train.main([str(tmp_path / "absent.py")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: torch 2.3.1+cu121 is older than pairface supports: "
                                                   "it needs torch >= 2.4 (torch.get_autocast_dtype"), err


def test_an_older_torch_is_refused_by_the_tools_in_one_line(monkeypatch, capsys, tmp_path):
    _older_torch(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        export_onnx.main(["--model", str(tmp_path / "absent.pth"), "--network", "r18"])
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it needs torch >= 2.4" in err and "pip install -r requirements.txt" in err


def test_this_torch_is_supported_and_its_version_is_read():
    compat.require_supported_torch()
    assert compat.torch_version() >= compat.TORCH_FLOOR
