"""What one training process holds, in bytes, computed from the configuration alone.

The classifier's share is exact arithmetic on PartialFC's buffers (its centre rows, their gradient
and optimizer state, the (N, C) logits buffer of one forward with the temporaries around it); the
backbone's is its parameters, gradients and optimizer state, counted on the meta device (nothing is
allocated). Activations of the backbone are not included: they depend on the network's internals and
the batch, not on the number of identities. `train.py CONFIG --dry-run` prints the plan; a run's
start-up log warns when it exceeds the device. The total is the device's; `host_checkpoint_staging`
is host memory on top of it.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from backbones import get_model
from partial_fc import COLUMN_CHUNK_ELEMENTS, class_range

FLOAT32 = 4


def memory_plan(cfg: SimpleNamespace, num_classes: int | None, world_size: int) -> dict[str, int | None]:
    """Bytes per process (rank 0, which holds the most centres), by item, and the total. Classifier
    items are None when the number of classes is unknown (num_classes None: read from the data)."""
    states = _optimizer_states(cfg)
    backbone = _backbone_parameters(cfg) * FLOAT32
    plan: dict[str, int | None] = {"class_centres": None, "centre_gradient": None, "centre_optimizer_state": None,
                                   "logits_buffer": None}
    if num_classes is not None:
        rows = class_range(num_classes, 0, world_size)[1]
        centres = rows * cfg.embedding_size * FLOAT32
        plan.update(class_centres=centres, centre_gradient=centres, centre_optimizer_state=states * centres,
                    logits_buffer=_softmax_bytes(cfg, rows, world_size))
    plan.update(backbone_parameters=backbone, backbone_gradients=backbone, backbone_optimizer_state=states * backbone)
    plan["total"] = sum(value for value in plan.values() if value is not None)
    plan["host_checkpoint_staging"] = _staging_bytes(cfg, plan)
    return plan


def _staging_bytes(cfg: SimpleNamespace, plan: dict[str, int | None]) -> int | None:
    """Host memory (not in the device total) for an async save's copy of the state: the centres, the
    backbone and both optimizer states, held from the first save on (checkpoint/background.py)."""
    if not (cfg.async_save and cfg.save_all_states):
        return 0
    if plan["class_centres"] is None:
        return None
    return sum(plan[key] for key in ("class_centres", "centre_optimizer_state", "backbone_parameters",
                                     "backbone_optimizer_state"))


def _optimizer_states(cfg: SimpleNamespace) -> int:
    """Tensors the optimizer keeps per parameter: AdamW's two moments, SGD's momentum (none without)."""
    if cfg.optimizer == "adamw":
        return 2
    return 1 if cfg.momentum else 0


def processes_that_fit(cfg: SimpleNamespace, num_classes: int, world_size: int, available: int) -> int | None:
    """A process count (world_size doubled until it fits) whose plan fits in `available` bytes; None if
    even 8192 processes do not (the backbone alone is too large)."""
    candidate = world_size
    while candidate <= 8192:
        if memory_plan(cfg, num_classes, candidate)["total"] <= available:
            return candidate
        candidate *= 2
    return None


def _softmax_bytes(cfg: SimpleNamespace, rows: int, world_size: int) -> int:
    """One forward's (N, C) float32 buffer over the sampled columns, with what lives beside it at its peak:
    the GEMM's half-precision result under fp16/bf16, the chunked exp temporaries, and with sampling the
    gathered centres and their gradient."""
    samples = cfg.batch_size * cfg.num_views * world_size  # every rank's embeddings of every view
    # Sampling keeps int(sample_rate * rows) centres, or every positive class of the step when they are more
    # (sample_rate 0: only those): at most one per label of the global batch, in the worst case all on this rank.
    labels = cfg.batch_size * world_size
    columns = rows if cfg.sample_rate >= 1.0 else min(rows, max(int(cfg.sample_rate * rows), labels))
    logits = samples * columns * FLOAT32
    half_copy = samples * columns * 2 if cfg.fp16 or cfg.bf16 else 0
    chunk = min(samples * columns, COLUMN_CHUNK_ELEMENTS) * FLOAT32
    sampled_centres = 2 * columns * cfg.embedding_size * FLOAT32 if columns < rows else 0
    return logits + max(half_copy, chunk) + sampled_centres


def _backbone_parameters(cfg: SimpleNamespace) -> int:
    with torch.device("meta"):
        model = get_model(cfg.network, num_features=cfg.embedding_size, dropout=cfg.dropout, **cfg.network_kwargs)
    return sum(p.numel() for p in model.parameters())


def device_bytes(device: torch.device) -> int:
    """What one process may use: its GPU's memory, or on a CPU this machine's RAM shared by its local processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_processes


def describe(plan: dict[str, int | None]) -> str:
    """The plan as aligned lines of GiB."""
    width = max(len(key) for key in plan)
    lines = []
    for key, value in plan.items():
        amount = "unknown (set num_classes)" if value is None else f"{value / 2 ** 30:10.3f} GiB"
        lines.append(f"  {key.replace('_', ' '):<{width}}  {amount}")
    return "\n".join(lines)
