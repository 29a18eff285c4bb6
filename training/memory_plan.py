"""What one training process holds on its device, in bytes, from the configuration alone: no GPU, no
data, seconds for any network. `train.py CONFIG --dry-run` prints it (with `--device-memory`, whether
it fits and what would); a run's start-up log warns with the same numbers when it exceeds the device.

Items, by how they are counted:
- arithmetic: class_centres, centre_gradient, centre_optimizer_state (rank 0's rows: it holds the most);
  logits_buffer, PartialFC's own peak above what was alive when it started (the (N, C) buffer and what
  lives beside it, from partial_fc.py's buffers in turn); batch, the step's micro-batches and the one
  the loader stages ahead.
- the network on the meta device: backbone_parameters (with its BatchNorm statistics twice: a skipped
  step puts them back), backbone_gradients, backbone_optimizer_state, ddp_gradient_buckets (DDP's flat
  copy of the gradients, with more than one process), backbone_ema (with ema_decay: the averaged copy of
  the backbone, its parameters and buffers).
- semi-siamese training (sst): prototype_queue (rank 0's slots, arithmetic), gallery_network (the backbone's
  momentum copy, as backbone_ema); queue_logits, the queue's softmax of both views above the activations (its two
  (N, slots) buffers and copies of the queue, the gathered probes, the step's gallery features waiting for the
  commit); the queue's backward is counted in logits_buffer, with the centres' softmax (which may be alive then).
  Without its centre loss (sst_centre_weight 0) the centres get no gradient, no optimizer state, no logits.
- traced on fake tensors (training/backbone_trace.py): activations, what the backbone's forward leaves for
  the backward, held while the softmax runs; backbone_backward, the backbone's forward and backward at
  their peak (activations, their gradients, parameter gradients).

The items are not all alive at once. `PERSISTENT` ones are held throughout; the step peaks at one of the
`MOMENTS`, the softmax or the backbone's backward (with gradient_acc > 1, the last micro-batch's, with
the gradients of those before it: `ACCUMULATED`): total = persistent + the larger moment. A new item is
one entry in `memory_plan` and its name in one of these (an item in none is shown beside the total,
not in it: host_checkpoint_staging, the host memory an async save's copy of the state holds).
tests/test_memory_plan.py compares every item and the total with what real steps allocate.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from margin_families import centres_per_class, family_named
from partial_fc import class_range
from training.backbone_trace import backbone_memory, inference_memory
from training.state import precision
from utils.compat import half_gemm_inputs
from utils.errors import ConfigError
from utils.image import IMAGE_SIZE

FLOAT32, HALF, INDEX = 4, 2, 8
IMAGE_BYTES = 3 * IMAGE_SIZE * IMAGE_SIZE  # one uint8 view
MAX_PROCESSES = 8192
GIB = 2 ** 30

PERSISTENT = ("class_centres", "centre_optimizer_state", "backbone_parameters", "backbone_optimizer_state",
              "ddp_gradient_buckets", "backbone_ema", "prototype_queue", "gallery_network", "batch")
MOMENTS = {"at the softmax": ("activations", "queue_logits", "logits_buffer"),
           "in the backbone's backward": ("centre_gradient", "backbone_backward")}
SEMI_SIAMESE = ("prototype_queue", "gallery_network", "queue_logits")  # items of a run with sst alone
ACCUMULATED = {"at the softmax": ("centre_gradient", "backbone_gradients"),
               "in the backbone's backward": ("backbone_gradients",)}


def memory_plan(cfg: SimpleNamespace, num_classes: int | None, world_size: int) -> dict[str, int | None]:
    """Bytes per process (rank 0) by item, and the total: the step's peak. Classifier items are None when
    the number of classes is unknown (num_classes None: read from the data); the total then leaves them out."""
    backbone = backbone_memory(cfg.network, cfg.network_kwargs, cfg.embedding_size, cfg.dropout, precision(cfg),
                               cfg.num_views)
    states = _optimizer_states(cfg)
    plan: dict[str, int | None] = dict.fromkeys(("class_centres", "centre_gradient", "centre_optimizer_state",
                                                 "logits_buffer"))
    centres_trained = not cfg.sst or cfg.sst_centre_weight > 0
    if num_classes is not None:
        rows = class_range(num_classes, 0, world_size)[1]
        centres = rows * centres_per_class(cfg) * cfg.embedding_size * FLOAT32
        forward, backward = _softmax_peaks(cfg, rows, world_size)
        # The step's autocast ends between the softmax's forward and backward, freeing the backbone's
        # weight casts that no backward keeps (under checkpointing): the backward peaks above less.
        columns = _sampled_columns(cfg, rows, world_size)
        # Sampled: a sparse gradient, the sampled rows and their indices (micro-batches' unions: at most their sum)
        gradient = centres if columns is None else cfg.gradient_acc * columns * centres_per_class(cfg) * (
            cfg.embedding_size * FLOAT32 + INDEX)
        logits = max(forward, backward - backbone.released(cfg.batch_size)) if centres_trained else 0
        plan.update(class_centres=centres, centre_gradient=gradient if centres_trained else 0,
                    centre_optimizer_state=states * centres if centres_trained else 0,
                    logits_buffer=logits + _queue_backward(cfg, world_size))
    plan.update(
        backbone_parameters=backbone.parameters + 2 * backbone.buffers,
        backbone_optimizer_state=states * backbone.trainable,
        ddp_gradient_buckets=backbone.trainable if world_size > 1 else 0,
        backbone_ema=backbone.parameters + backbone.buffers if cfg.ema_decay else 0,
        **_semi_siamese(cfg, world_size, backbone.parameters + backbone.buffers),
        batch=(cfg.gradient_acc + 1) * cfg.batch_size * (cfg.num_views * IMAGE_BYTES + INDEX),
        activations=backbone.held(cfg.batch_size),
        backbone_backward=backbone.peak(cfg.batch_size),
        backbone_gradients=backbone.trainable,
    )
    plan["total"] = _known(plan, _persistent(cfg)) + max(_known(plan, items) for items in _moments(cfg).values())
    plan["host_checkpoint_staging"] = _staging_bytes(cfg, plan, backbone.parameters + backbone.buffers,
                                                     backbone.parameters)
    return plan


def _staging_bytes(cfg: SimpleNamespace, plan: dict[str, int | None], backbone_state: int,
                   backbone_parameters: int) -> int | None:
    """Host memory (not in the device total) for an async save's copy of the state: the centres, the
    backbone's state_dict and both optimizer states (with ema_decay, the trained parameters too: backbone.pth
    holds the averages; with sst, the queue and the gallery network), held from the first save on
    (checkpoint/checkpointer.py)."""
    if not (cfg.async_save and cfg.save_all_states):
        return 0
    if plan["class_centres"] is None:
        return None
    trained = backbone_parameters if cfg.ema_decay else 0
    return (plan["class_centres"] + plan["centre_optimizer_state"] + backbone_state + plan["backbone_optimizer_state"]
            + trained + plan["prototype_queue"] + plan["gallery_network"])


def _semi_siamese(cfg: SimpleNamespace, world_size: int, gallery: int) -> dict[str, int]:
    """The SST items (prototype_queue.py, training/semi_siamese.py): 0 without sst. queue_logits is the larger of
    the gallery's pass (the global batch's records gathered, one view of this rank's slice embedded without
    gradient, the other view's features) and the queue's softmax that follows it."""
    if not cfg.sst:
        return dict.fromkeys(("prototype_queue", "gallery_network", "queue_logits"), 0)
    slots, d = class_range(cfg.sst_queue_size, 0, world_size)[1], cfg.embedding_size
    n = cfg.batch_size * world_size  # rows of one view
    forward = inference_memory(cfg.network, cfg.network_kwargs, cfg.embedding_size, cfg.dropout, precision(cfg))
    # the global batch's records (one process: its own, already counted) and this rank's slice of a view
    gathered = ((n * cfg.num_views if world_size > 1 else 0) + cfg.batch_size) * IMAGE_BYTES
    gallery_pass = gathered + forward.peak(cfg.batch_size) + (2 * n * d + n) * FLOAT32  # features, the permutation
    per_view = slots * d + n * slots + 2 * slots  # the queue's copy, the (N, slots) buffer, the slots' norms
    probes = (2 * 2 * cfg.batch_size + 2 * n) * d  # both views stacked and normalised, then gathered
    # the gallery features as the gallery gave them, and normalised for each micro-batch until the commit
    waiting = 2 * n * d * (1 + cfg.gradient_acc)
    return {"prototype_queue": slots * d * FLOAT32, "gallery_network": gallery,
            "queue_logits": max(gallery_pass, (2 * per_view + probes + waiting) * FLOAT32)}


def _queue_backward(cfg: SimpleNamespace, world_size: int) -> int:
    """What the queue's softmax allocates in its backward above what its forward holds (one view at a time: the
    slots' scaled 1/norms and the probes' gradient); counted with the centres' buffers, which may be alive then."""
    if not cfg.sst:
        return 0
    return (class_range(cfg.sst_queue_size, 0, world_size)[1] + cfg.batch_size * world_size * cfg.embedding_size) \
        * FLOAT32


def _persistent(cfg: SimpleNamespace) -> tuple[str, ...]:
    """The items held throughout the step (the SST ones only with sst)."""
    return _of_this_run(PERSISTENT, cfg)


def _moments(cfg: SimpleNamespace) -> dict[str, tuple[str, ...]]:
    """The items alive at each moment a step can peak."""
    moments = {when: _of_this_run(items, cfg) for when, items in MOMENTS.items()}
    if cfg.gradient_acc == 1:
        return moments
    return {when: items + ACCUMULATED[when] for when, items in moments.items()}


def _of_this_run(items: tuple[str, ...], cfg: SimpleNamespace) -> tuple[str, ...]:
    return items if cfg.sst else tuple(item for item in items if item not in SEMI_SIAMESE)


def _known(plan: dict[str, int | None], items: tuple[str, ...]) -> int:
    return sum(plan[item] or 0 for item in items)


def _optimizer_states(cfg: SimpleNamespace) -> int:
    """Tensors the optimizer keeps per parameter: AdamW's two moments, SGD's momentum (none without)."""
    if cfg.optimizer == "adamw":
        return 2
    return 1 if cfg.momentum else 0


def _softmax_peaks(cfg: SimpleNamespace, rows: int, world_size: int) -> tuple[int, int]:
    """PartialFC's peaks in its forward and in its backward, above what was alive when it started, from
    the buffers partial_fc.py allocates in turn. N rows: every rank's embeddings of every view; C columns:
    the centres of the step (sampled: every positive class, topped up to sample_rate of the rows).

    With K sub-centres the GEMMs have C*K columns: the forward's (N, C*K) cosines shrink to (N, C) through
    their max (and its int64 indices, kept as uint8), the backward spreads the (N, C) gradient back to
    (N, C*K). A family may keep more (N, C) buffers through the forward (its negatives_buffers: CurricularFace's
    negatives' derivative)."""
    local = cfg.batch_size * cfg.num_views
    n, d, k = local * world_size, cfg.embedding_size, centres_per_class(cfg)
    sampled_columns = _sampled_columns(cfg, rows, world_size)
    sampled = sampled_columns is not None
    columns = rows if sampled_columns is None else sampled_columns
    nc, nd = n * columns * FLOAT32, n * d * FLOAT32
    nck, cd = nc * k, columns * k * d * FLOAT32
    # The views stacked and normalised, the normalised rows of every rank, the centres' norms and 1/norms,
    # and when sampling the sampled indices and centres: all alive through the softmax's backward.
    beside = (2 * local * d * FLOAT32 + nd + 2 * columns * k * FLOAT32
              + (columns * k * (INDEX + d * FLOAT32) if sampled else 0))
    if k > 1:  # the uint8 index of each class's sub-centre, from the max's forward to the backward
        beside += n * columns
    reduced = nck + nc + 2 * nc if k > 1 else nc  # the max: its input, its values and int64 indices at once
    negatives = nc * family_named(cfg.margin_family).negatives_buffers
    spread = nck if k > 1 else 0  # the backward's (N, C*K) gradient beside the (N, C) one
    filter_mask = n * columns if cfg.interclass_filtering_threshold > 0 else 0  # the (N, C) boolean mask
    if cfg.fp16 or cfg.bf16:  # the backward's GEMMs in half precision, their results brought to float32
        # The cosines' GEMM writes float32: from half-precision casts of its inputs where the device has such a
        # GEMM (CUDA, the device `auto` picks when there is one), else in float32 without casts.
        casts = (nd + cd) * HALF // FLOAT32 if half_gemm_inputs("cuda" if torch.cuda.is_available() else "cpu") else 0
        forward = max(casts + nck, reduced, nc + negatives + filter_mask)
        gemms = nc + spread + (nck + nd + cd) * HALF // FLOAT32 + nd + cd
    else:
        forward = max(reduced, nc + negatives + filter_mask)
        gemms = nc + spread + nd + cd
    projection = 4 * columns * k * FLOAT32  # the normalisation's backward: a few values per centre
    return beside + forward, beside + max(gemms, nc + spread + nd + cd + projection)


def _sampled_columns(cfg: SimpleNamespace, rows: int, world_size: int) -> int | None:
    """The centres a step samples of `rows` (at most: the step's labels may be fewer), None without sampling."""
    num_sample = int(cfg.sample_rate * rows)
    if cfg.sample_rate >= 1.0 or num_sample >= rows:
        return None
    return max(num_sample, min(rows, cfg.batch_size * world_size))


def most_processes(cfg: SimpleNamespace) -> int | None:
    """With semi-siamese training, the most processes whose step the prototype queue holds: a step of W processes
    enqueues batch_size * gradient_acc * W gallery features (twice that with sst_enqueue="both"), and a queue
    smaller than one step would overwrite features of that very step. None without sst: no such bound."""
    if not cfg.sst:
        return None
    return cfg.sst_queue_size // _enqueued_per_process(cfg, cfg.batch_size)


def _enqueued_per_process(cfg: SimpleNamespace, batch_size: int) -> int:
    return batch_size * cfg.gradient_acc * (2 if cfg.sst_enqueue == "both" else 1)


def check_world_size(cfg: SimpleNamespace, world_size: int) -> None:
    """A ConfigError when the prototype queue cannot hold one step of `world_size` processes (the start of such a
    run refuses it in the same words: training/semi_siamese.py)."""
    most = most_processes(cfg)
    if most is not None and world_size > most:
        enqueued = _enqueued_per_process(cfg, cfg.batch_size) * world_size
        fewer = f"plan for at most {most} process(es)" if most else "lower batch_size"
        raise ConfigError(f"config key 'sst_queue_size' ({cfg.sst_queue_size}) is smaller than the {enqueued} gallery "
                          f"features a step of {world_size} process(es) enqueues; raise it to at least that, or "
                          f"{fewer}")


@dataclass(frozen=True)
class Fit:
    """Whether a plan fits in `available` bytes per process, and what would."""

    available: int
    total: int
    largest_batch_size: int  # at the planned number of processes; 0: not even one record
    fewest_processes: int | None  # at the configured batch size; None: no number of processes
    most_processes: int | None = None  # the most whose step the prototype queue holds (sst); None: no such bound

    @property
    def fits(self) -> bool:
        return self.total <= self.available


def fit(cfg: SimpleNamespace, num_classes: int, world_size: int, available: int) -> Fit:
    """The plan against `available` bytes: the largest batch_size whose plan fits on `world_size`
    processes, and the fewest processes on which the configured batch_size fits."""
    def total(batch_size: int, processes: int) -> int:
        return memory_plan(SimpleNamespace(**{**vars(cfg), "batch_size": batch_size}), num_classes,
                           processes)["total"]

    def queue_holds(batch_size: int, processes: int) -> bool:
        return not cfg.sst or _enqueued_per_process(cfg, batch_size) * processes <= cfg.sst_queue_size

    # Not a bisection: more processes hold fewer centres each, but the softmax's rows (the global batch) grow.
    most = most_processes(cfg)
    fewest = next((processes for processes in range(1, min(num_classes, MAX_PROCESSES, most or MAX_PROCESSES) + 1)
                   if total(cfg.batch_size, processes) <= available), None)
    largest = _largest(lambda batch_size: queue_holds(batch_size, world_size)
                       and total(batch_size, world_size) <= available)
    return Fit(available, total(cfg.batch_size, world_size), largest, fewest, most)


def _largest(fits) -> int:
    """The largest n >= 1 with fits(n) (fits: true up to some n, false beyond), 0 if none."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def device_bytes(device: torch.device) -> int:
    """What one process may use: its GPU's memory, or on a CPU this machine's RAM shared by its local processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_processes


def describe(plan: dict[str, int | None], cfg: SimpleNamespace) -> str:
    """The plan as aligned lines of GiB, grouped by when the items are alive."""
    alive = _moments(cfg)
    groups = {"held throughout": _persistent(cfg), **alive}
    shown = {item for items in groups.values() for item in items} | {"total", *SEMI_SIAMESE}
    width = max(len(key) for key in plan) + 2
    lines = []
    for when, items in groups.items():
        lines.append(f"  {when}:")
        lines += [f"    {item.replace('_', ' '):<{width}}{_amount(plan[item])}" for item in items]
    peak = max(alive, key=lambda when: _known(plan, alive[when]))
    lines.append(f"  {'total':<{width + 2}}{_amount(plan['total'])}  (the step's peak: held throughout + {peak})")
    lines += [f"  {key.replace('_', ' '):<{width + 2}}{_amount(value)}  (not in the total on its own)"
              for key, value in plan.items() if key not in shown]
    return "\n".join(lines)


def _amount(value: int | None) -> str:
    return "unknown (set num_classes)" if value is None else f"{value / GIB:10.3f} GiB"


# What shrinks each item, for the one line that names the item dominating a plan that does not fit.
_SAMPLING = "lower sample_rate (now {sample_rate:g})"
_MORE_PROCESSES = "more processes (each holds its share of the centres)"
_SMALLER_BATCH = "a smaller batch_size with gradient_acc keeping the global batch"
_SMALLER_NETWORK = "a smaller network, or fp16/bf16"
_SMALLER_QUEUE = "a smaller sst_queue_size, or more processes (each holds its share of the queue)"
REMEDIES = {"class_centres": _MORE_PROCESSES, "centre_optimizer_state": _MORE_PROCESSES,
            "centre_gradient": _SAMPLING, "logits_buffer": _SAMPLING, "activations": _SMALLER_BATCH,
            "backbone_backward": _SMALLER_BATCH, "batch": _SMALLER_BATCH, "backbone_parameters": _SMALLER_NETWORK,
            "backbone_optimizer_state": _SMALLER_NETWORK, "backbone_gradients": _SMALLER_NETWORK,
            "ddp_gradient_buckets": _SMALLER_NETWORK, "backbone_ema": _SMALLER_NETWORK,
            "prototype_queue": _SMALLER_QUEUE, "queue_logits": _SMALLER_QUEUE, "gallery_network": _SMALLER_NETWORK}


def dominant_item(plan: dict[str, int | None], cfg: SimpleNamespace) -> str:
    """The largest item alive at the step's peak."""
    alive = _moments(cfg)
    peak = max(alive, key=lambda when: _known(plan, alive[when]))
    return max((item for item in (*_persistent(cfg), *alive[peak]) if plan[item] is not None),
               key=lambda item: plan[item])


def describe_fit(result: Fit, cfg: SimpleNamespace, world_size: int, plan: dict[str, int | None]) -> str:
    """One line: fits or not in the memory available, the largest batch and fewest processes that fit, and when
    it does not fit, what shrinks the item that dominates the plan."""
    largest = (f"the largest batch_size that fits on {world_size} process(es) is {result.largest_batch_size}"
               if result.largest_batch_size else
               f"not even batch_size 1 fits on {world_size} process(es)")
    if result.fewest_processes:
        processes = f"batch_size {cfg.batch_size} fits from {result.fewest_processes} processes on"
        if result.most_processes is not None:
            processes += f" (up to {result.most_processes}, the most whose step sst_queue_size holds)"
    elif result.most_processes is not None:
        processes = (f"no number of processes up to {result.most_processes} (the most whose step sst_queue_size="
                     f"{cfg.sst_queue_size} holds) fits batch_size {cfg.batch_size}")
    else:
        processes = f"no number of processes fits batch_size {cfg.batch_size} (the backbone's share alone is too large)"
    if result.fits:
        return (f"fits: {result.total / GIB:.2f} GiB of {result.available / GIB:.2f} GiB per process; "
                f"{largest}; {processes}")
    item = dominant_item(plan, cfg)
    return (f"does not fit: {result.total / GIB:.2f} GiB planned, {result.available / GIB:.2f} GiB per process; "
            f"{largest}, or {processes}; the largest item is {item.replace('_', ' ')} "
            f"({plan[item] / GIB:.2f} GiB): try {REMEDIES[item].format(sample_rate=cfg.sample_rate)}")
