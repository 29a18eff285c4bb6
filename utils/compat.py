"""Every difference between the torch releases pairface supports, found by feature detection, in one place.

Supported: torch 2.4 (``TORCH_FLOOR``) and later, with the torchvision of each. What differs (the
releases named are those checked: the floor 2.4.1, the GPU machine's 2.11.0, this project's 2.14.1),
and what is used where:

- collectives into one flat tensor: ``all_gather_single``/``reduce_scatter_single`` (2.14, which
  deprecates the older names) or ``all_gather_into_tensor``/``reduce_scatter_tensor`` (2.4, 2.11);
- DistributedDataParallel without buffer broadcasts (each rank keeps its BatchNorm statistics):
  ``forward_sync_buffers=False`` (2.14) or ``broadcast_buffers=False`` (2.4, 2.11; deprecated in 2.14);
- DCP's ``no_dist`` keyword (2.11, 2.14; 2.4 infers it) and its index's
  ``_StorageInfo.transform_descriptors`` (absent in 2.4);
- a checkpoint tensor that is a block of rows of a larger matrix at a given offset: torch's
  checkpointable-tensor attributes (``torch.distributed.checkpoint.protocol``, 2.14) or a
  ShardedTensor with one local shard (2.4, 2.11; built without a process group);
- ONNX export with a dynamic batch: torch.export's exporter (``dynamo=True, dynamic_shapes``: 2.11,
  2.14) or the TorchScript one (``dynamic_axes``: 2.4);
- a half-precision GEMM with a float32 result: ``torch.mm(..., out_dtype=torch.float32)`` where the
  device has that kernel (CUDA with 2.11, 2.14), else the GEMM in float32.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import re

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from utils.errors import ConfigError

TORCH_FLOOR = (2, 4)
# What the floor is for: torch.get_autocast_dtype(device) and torch.amp.is_autocast_available (2.4).
FLOOR_FEATURE = "torch.get_autocast_dtype(device_type) for the autocast precision of the margin softmax's GEMMs"


def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch imported, from its version string (local suffixes like +cu130 ignored)."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def require_supported_torch() -> None:
    """ConfigError (one line, with the fix) when this torch is older than pairface supports."""
    if torch_version() >= TORCH_FLOOR and hasattr(torch, "get_autocast_dtype"):
        return
    floor = ".".join(map(str, TORCH_FLOOR))
    raise ConfigError(f"torch {torch.__version__} is older than pairface supports: it needs torch >= {floor} "
                      f"({FLOOR_FEATURE}); install torch>={floor} with its torchvision, e.g. "
                      "pip install -r requirements.txt")


# --- collectives ------------------------------------------------------------------------------------

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """Every rank's `tensor` concatenated along dim 0 into `out` (world_size times its rows)."""
    _all_gather(out, tensor, group=group)


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """This rank's block of dim 0 of the sum over ranks of `tensor` into `out`."""
    _reduce_scatter(out, tensor, group=group)


# --- DistributedDataParallel ---------------------------------------------------------------------

def ddp_without_buffer_sync(module: torch.nn.Module, device_ids: list[int] | None) -> DistributedDataParallel:
    """`module` in DDP, its buffers never broadcast by forward (each rank keeps its own statistics)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return DistributedDataParallel(module, device_ids=device_ids, forward_sync_buffers=False)
    return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)


# --- torch.distributed.checkpoint ----------------------------------------------------------------

@functools.cache
def _dcp_takes_no_dist() -> bool:
    """Whether dcp.save takes `no_dist` (older releases infer it). Asked at the first save or load, not at
    import: importing DCP costs most of a second of CPU that a refused start or a test's subprocess never needs."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 (lazy: DCP's import cost, see above)
    return "no_dist" in inspect.signature(dcp.save).parameters

# What DCP warns at every save and load in a process without a process group, in each release's words.
DCP_ALONE_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized"


# What releases that deprecate ShardedTensor warn when DCP reads a row block's size (2.11 among them).
SHARDED_TENSOR_WARNING = "Please use DTensor instead and we are deprecating ShardedTensor"


def dcp_group(group=None) -> dict:
    """dcp.save's and dcp.load's keywords for `group` (None: the default one), or for one process without
    a process group."""
    if _dcp_takes_no_dist():
        return {"process_group": group, "no_dist": not dist.is_initialized()}
    return {"process_group": group}


def dcp_storage_transforms(info: object) -> object:
    """The transforms DCP's index records for one stored item (a field of _StorageInfo in later releases;
    none before, where items are stored as they are)."""
    return getattr(info, "transform_descriptors", None)


# --- checkpoint shards -----------------------------------------------------------------------------

@functools.cache
def checkpointable_attributes() -> bool:
    """Whether this torch's DCP reads a block's place from attributes of the tensor (the newer protocol; else
    a ShardedTensor carries it). Asked at the first save or load: the lookup imports DCP."""
    return importlib.util.find_spec("torch.distributed.checkpoint.protocol") is not None


def row_block(rows: torch.Tensor, total_rows: int, first_row: int, attributes: bool | None = None) -> torch.Tensor:
    """`rows` as what torch.distributed.checkpoint saves and loads as rows first_row.. of a (total_rows, ...)
    matrix: a block at an explicit offset, so that the blocks of one run can be any split (uneven, unlike
    DTensor's) and a run on another split reads its rows from whichever blocks hold them. Loading into
    the result writes into `rows`' memory."""
    global_shape = (total_rows, *rows.shape[1:])
    offsets = (first_row, *[0] * (rows.dim() - 1))
    local = rows.detach()  # a new tensor object on the same memory: nothing set here reaches a parameter
    if checkpointable_attributes() if attributes is None else attributes:
        local.global_shape = global_shape
        local.global_offsets = (offsets,)
        local.local_offsets = ((0,) * rows.dim(),)
        local.local_sizes = (tuple(rows.shape),)
        return local
    return _sharded_tensor(local, global_shape, offsets)


def row_block_rows(block: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a row_block (what the training state keeps after a load); any other tensor
    as it is."""
    return block.local_shards()[0].tensor if hasattr(block, "local_shards") else block


def _sharded_tensor(local: torch.Tensor, global_shape: tuple, offsets: tuple) -> torch.Tensor:
    """A ShardedTensor whose one local shard is `local` at row offsets[0]; built without a process group
    (ShardedTensorBase checks nothing across ranks), which DCP's planners never ask of it."""
    from torch.distributed._shard.metadata import ShardMetadata  # noqa: PLC0415 (older torch only)
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensorBase  # noqa: PLC0415 (older torch only)
    from torch.distributed._shard.sharded_tensor.metadata import (  # noqa: PLC0415 (older torch only)
        ShardedTensorMetadata,
        TensorProperties,
    )

    def block(first: int, count: int) -> ShardMetadata:
        return ShardMetadata(shard_offsets=[first, *offsets[1:]], shard_sizes=[count, *global_shape[1:]],
                             placement=f"rank:{rank}/{local.device}")

    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = block(offsets[0], local.shape[0])
    # The whole matrix must be covered: the rows before and after ours stand as one block each. DCP saves
    # and loads the local shard alone and joins the ranks' blocks from what each wrote; the others'
    # split is theirs to say.
    end = offsets[0] + local.shape[0]
    others = [block(first, count) for first, count in ((0, offsets[0]), (end, global_shape[0] - end)) if count]
    properties = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_metadata=[mine, *others], size=torch.Size(global_shape),
                                     tensor_properties=properties)
    sharded = ShardedTensorBase._init_from_local_shards_and_global_metadata([Shard(local, mine)], metadata)
    # What ShardedTensor's own constructors set and its size() (which DCP's load planner calls) reads.
    sharded._process_group = dist.group.WORLD if dist.is_initialized() else None
    sharded._init_rrefs, sharded._sharded_tensor_id, sharded._remote_shards = False, None, {}
    return sharded


# --- ONNX export ---------------------------------------------------------------------------------

def export_onnx_file(model: torch.nn.Module, example: torch.Tensor, path: str, input_name: str, output_name: str,
                     opset: int) -> None:
    """Write `model` to the ONNX file `path`, its one input and output named, dim 0 of both dynamic."""
    if "dynamic_shapes" in inspect.signature(torch.onnx.export).parameters:
        program = torch.onnx.export(model, (example,), input_names=[input_name], output_names=[output_name],
                                    dynamic_shapes=({0: torch.export.Dim("batch")},), opset_version=opset,
                                    dynamo=True, verbose=False)
        program.save(path)
        return
    torch.onnx.export(model, (example,), path, input_names=[input_name], output_names=[output_name],
                      dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}}, opset_version=opset,
                      verbose=False)


# --- GEMMs with a float32 result ------------------------------------------------------------------

@functools.cache
def _half_gemm_with_float32_result(device_type: str) -> bool:
    """Whether torch.mm(half, half, out_dtype=torch.float32) runs on this device type."""
    if device_type != "cuda" or "dtype" not in torch.ops.aten.mm.overloads():
        return False
    if not torch.cuda.is_available():  # a plan for a GPU made without one: torch has the kernel
        return True
    probe = torch.zeros(1, 1, dtype=torch.bfloat16, device=device_type)
    try:
        torch.mm(probe, probe, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def matmul_float32_result(a: torch.Tensor, b: torch.Tensor, gemm_dtype: torch.dtype) -> torch.Tensor:
    """a @ b (2-D, float32 or float64) with a result in their dtype, never rounded to half precision: for
    float32 inputs, computed in `gemm_dtype` where the device has a half-precision GEMM that writes its
    float32 accumulator, else in the inputs' own precision. A cosine rounded to bfloat16 would be off by
    up to 2^-9: a quarter of a logit at s = 64."""
    if a.dtype == b.dtype == torch.float32 and _half_gemm_with_float32_result(a.device.type):
        return torch.mm(a.to(gemm_dtype), b.to(gemm_dtype), out_dtype=torch.float32)
    return a @ b


def half_gemm_inputs(device_type: str) -> bool:
    """Whether matmul_float32_result casts its inputs to half precision on this device type (the memory
    plan counts those casts)."""
    return _half_gemm_with_float32_result(device_type)
