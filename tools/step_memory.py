"""What real training steps allocate, by item of the memory plan: the reference the plan is checked
against (tests/test_memory_plan.py) and compared with (bench/bench_scale.py, gpu_acceptance/gpu_check.py).

    python -m tools.step_memory configs/synthetic_pair.py --set network=r18 --case "batch_size=16" \\
        --case "batch_size=32 bf16=True" [--device cuda] [--json]

Per case the training state and loader are built as train.py builds them, and optimizer steps run
(`training.step.train_step`) until one was taken; the step after it is measured. Markers at the
step's edges, around each micro-batch's backbone forward (module hooks) and where the embeddings'
gradient arrives (a tensor hook) split it into the plan's moments; the device's own accounting gives
the bytes alive at each marker and the peak between two: the CUDA caching allocator's statistics on
a GPU, torch.profiler's record of every CPU allocation on a CPU (its allocation events carry their
sizes and times). On a CPU the kernels' own workspace (scratch a kernel frees before it returns, whose
size depends on the CPU's instruction set) is kept apart from the tensors, which are what the plan
counts: it is the one item, `kernel_workspace`, that the plan has no figure for. The tensors the plan
sizes by arithmetic (parameters, gradients, optimizer state) are measured as they are, and DDP's
buckets as DDP records them. Under torchrun every rank measures; rank 0's figures are printed.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch._C._profiler import _EventType
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.hooks import RemovableHandle

from dataset import build_dataset, build_loader
from training.config import load_config
from training.ema import BackboneEMA
from training.memory_plan import memory_plan
from training.semi_siamese import semi_siamese
from training.state import TrainingState, build_training_state, wrap_for_the_step
from training.step import StepOutcome, train_step
from utils.cli import exit_on_user_error
from utils.distributed import init_distributed, is_main, rank, world

MAX_STEPS = 12  # steps run until one was taken (fp16 skips its first ones: the grad scale backs off)

@dataclass
class _Marks:
    """Bytes alive at each marker, and the peak since the marker before (itself included); on a CPU also
    the peak of kernel workspace since the marker before (its bytes are not in `live` and `peak`)."""

    device: torch.device
    # On a GPU, what was allocated before the recording started (another case's, the process's): the CPU's
    # profile sees only what is allocated while it records, and on either device a case counts its own bytes.
    before: int = 0
    names: list[str] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    workspace: list[int] = field(default_factory=list)

    def mark(self, name: str) -> None:
        self.names.append(name)
        if self.device.type == "cuda":
            self.live.append(torch.cuda.memory_allocated(self.device) - self.before)
            self.peak.append(torch.cuda.max_memory_allocated(self.device) - self.before)
            self.workspace.append(0)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with record_function(name):  # read back from the profile (_read_profile)
                pass

    def at(self, name: str) -> int:
        return self.live[self.names.index(name)]

    def peak_between(self, first: str, last: str) -> int:
        """The largest amount alive from marker `first` to marker `last`."""
        start, end = self.names.index(first), self.names.index(last)
        return max([self.live[start], *self.peak[start + 1:end + 1]])

    def workspace_between(self, first: str, last: str) -> int:
        """The most kernel workspace held at once from marker `first` to marker `last`."""
        start, end = self.names.index(first), self.names.index(last)
        return max(self.workspace[start + 1:end + 1], default=0)

    def read_profile(self, recorded: profile) -> None:
        """Live bytes and peaks from a CPU profile's allocation events (frees are negative allocations),
        tensors and kernel workspace apart (_kernel_workspace)."""
        times = {}
        events = []
        stack = list(recorded.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
                events.append(event)
            elif event.name in self.names:
                times[event.name] = event.start_time_ns
        events.sort(key=lambda event: event.start_time_ns)
        workspace = _kernel_workspace(events)
        alive = highest = held = most_held = 0
        position = 0
        for name in self.names:
            while position < len(events) and events[position].start_time_ns < times[name]:
                size = events[position].typed[1].alloc_size
                if id(events[position]) in workspace:
                    held += size
                    most_held = max(most_held, held)
                else:
                    alive += size
                    highest = max(highest, alive)
                position += 1
            self.live.append(alive)
            self.peak.append(highest)
            self.workspace.append(most_held)
            highest, most_held = alive, held


# ATen ops that only allocate: a tensor made by one of them belongs to the kernel that called it.
_FACTORIES = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                        "aten::new_empty_strided", "aten::zeros", "aten::zeros_like", "aten::new_zeros",
                        "aten::resize_"})


def _kernel_workspace(events: list) -> set[int]:
    """The allocation events (their ids) of kernel workspace: memory an ATen kernel takes for itself and
    gives back before it returns (oneDNN's scratchpads and packed operands of a bf16/fp16 GEMM or
    convolution, the im2col columns of a convolution without a oneDNN path). Which kernel runs, and so
    how much it takes, depends on the CPU (AVX512-BF16, AMX, ...), not on a tensor the plan counts: it is
    measured apart. `events` in time order. What outlives the kernel that made it (its output, the
    inputs of the ops that follow) is a tensor, whatever allocated it."""
    opened = {}
    workspace = set()
    for event in events:
        fields = event.typed[1]
        if fields.alloc_size > 0:
            opened[fields.ptr] = event
            continue
        allocation = opened.pop(fields.ptr, None)
        kernel = allocation.parent if allocation is not None else None
        while kernel is not None and kernel.name in _FACTORIES:
            kernel = kernel.parent
        if kernel is not None and kernel.name.startswith("aten::") and event.start_time_ns <= kernel.end_time_ns:
            workspace.update((id(allocation), id(event)))
    return workspace


@contextmanager
def _recording(device: torch.device) -> Iterator[_Marks]:
    marks = _Marks(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        marks.before = torch.cuda.memory_allocated(device)
        yield marks
        return
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        yield marks
    marks.read_profile(recorded)


def _nbytes(tensors) -> int:
    """Bytes of the tensors' storage (a sparse one's: its indices and values)."""
    return sum(_nbytes([tensor._indices(), tensor._values()]) if tensor.is_sparse else tensor.untyped_storage().nbytes()
               for tensor in tensors)


def _hook_markers(state: TrainingState, marks: _Marks, inputs: list[int], gradients: dict) -> list[RemovableHandle]:
    """Markers around every backbone forward and where its output's gradient arrives; the size of each
    forward's input (the normalised batch, made just before); each parameter's gradient size. Returns the
    hooks' handles: a parameter's hook is held by torch's C++ side, out of reach of Python's cycle
    collector, and `gradients` holds the parameter, so until they are removed a case's parameters outlive
    it (on a GPU, where the allocator's figures count every byte alive, the first H200 run's vit_b total
    included the 2.07 GiB of the r50 case measured before it: its million centres and its weights)."""
    calls = []  # one entry per forward: markers are numbered from 1 across steps

    def before(module, args) -> None:
        calls.append(None)
        inputs.append(_nbytes(args[:1]))
        marks.mark(f"forward {len(calls)}")

    def after(module, inputs, output) -> None:
        number = len(calls)
        marks.mark(f"forward end {number}")
        output.register_hook(lambda grad: marks.mark(f"softmax end {number}"))

    handles = [state.backbone.register_forward_pre_hook(before), state.backbone.register_forward_hook(after)]
    if sst := semi_siamese(state):  # the queue's softmax ends before the centres' starts
        handles.append(sst.queue.register_forward_hook(lambda *args: marks.mark(f"queue end {len(calls)}")))
    for parameter in [*state.backbone.parameters(), state.pfc.weight]:
        if parameter.requires_grad:
            handles.append(parameter.register_post_accumulate_grad_hook(
                lambda p: gradients.__setitem__(p, _nbytes([p.grad]))))
    return handles


def _ddp_bucket_bytes(state: TrainingState) -> int:
    """The bytes of DDP's gradient buckets, as DDP itself records them (0 without DDP). Not read from the
    allocator: DDP's constructor also broadcasts the weights through a flat buffer that gloo's own thread
    frees when it gets to it, so the bytes alive just after the constructor are not the buckets' alone."""
    if not isinstance(state.ddp_backbone, DistributedDataParallel):
        return 0
    sizes = state.ddp_backbone._get_ddp_logging_data()["bucket_sizes"]  # bytes per bucket, comma-separated
    return sum(int(size) for size in sizes.split(",") if size.strip())


def measure(cfg: SimpleNamespace, device: torch.device) -> dict[str, int]:
    """Bytes by plan item, and the total (the second step's peak), of this process in a real run of `cfg`."""
    dataset = build_dataset(cfg.rec, num_views=cfg.num_views, view_source=cfg.view_source,
                            num_classes=cfg.num_classes, flip=cfg.flip, seed=cfg.seed, num_samples=cfg.num_image)
    loader = build_loader(dataset, cfg.batch_size, rank=rank(), world_size=world(), seed=cfg.seed, num_workers=0,
                          device=device)
    gradients: dict[torch.Tensor, int] = {}
    inputs: list[int] = []
    with _recording(device) as marks:
        state = build_training_state(cfg, dataset.num_classes, device, len(loader) // cfg.gradient_acc)
        wrap_for_the_step(state, cfg, device)
        hooks = _hook_markers(state, marks, inputs, gradients)
        marks.mark("built")
        torch.manual_seed(cfg.seed + 1 + rank())
        taken = False
        for measured_step, micro_batches in enumerate(loader.steps(0, MAX_STEPS, cfg.gradient_acc)):
            # Tensors left in reference cycles by the last step are garbage, freed whenever the cycle collector
            # next runs: collected now, so that what the step starts with is the same on every run.
            gc.collect()
            marks.mark(f"step {measured_step}")
            outcome = train_step(state, micro_batches, cfg)[1]
            marks.mark(f"step {measured_step} end")
            if taken:  # the optimizer state exists: this step was the one measured
                break
            taken = outcome == StepOutcome.TAKEN
        optimizer_state = {parameter: _nbytes(value for value in state.optimizer.state[parameter].values()
                                              if value.shape == parameter.shape)
                           for parameter in state.optimizer.state}
        for hook in hooks:
            hook.remove()
    backbone = list(state.backbone.parameters())
    last = (measured_step + 1) * cfg.gradient_acc  # the measured step's last micro-batch
    centre_gradient = gradients.get(state.pfc.weight, 0)  # none: SST without its centre loss
    sst = semi_siamese(state)
    # With SST the queue's softmax (and the gallery's pass before it) comes first, then the centres'
    classifier = f"queue end {last}" if sst else f"forward end {last}"
    # The forward's input, normalised just before the backbone is called, is held through the backward.
    start = marks.at(f"forward {last}") - inputs[last - 1]
    items = {
        "class_centres": _nbytes([state.pfc.weight]),
        "centre_gradient": centre_gradient,
        "centre_optimizer_state": optimizer_state.get(state.pfc.weight, 0),
        "backbone_parameters": _nbytes(backbone) + _nbytes(state.backbone.buffers()) + _nbytes(state.bn_buffers),
        "backbone_optimizer_state": sum(optimizer_state.get(p, 0) for p in backbone),
        "ddp_gradient_buckets": _ddp_bucket_bytes(state),
        "backbone_ema": sum(_nbytes([*c.average.parameters(), *c.average.buffers()]) for c in state.components
                            if isinstance(c, BackboneEMA)),
        "activations": marks.at(f"forward end {last}") - start,
        "prototype_queue": _nbytes([sst.queue.queue]) if sst else 0,
        "gallery_network": _nbytes([*sst.gallery.parameters(), *sst.gallery.buffers()]) if sst else 0,
        "queue_logits": marks.peak_between(f"forward end {last}", classifier) - marks.at(f"forward end {last}")
        if sst else 0,
        "logits_buffer": marks.peak_between(classifier, f"softmax end {last}") - marks.at(classifier),
        "backbone_gradients": sum(gradients.get(p, 0) for p in backbone),
    }
    # What the backbone adds above the start of its forward; with one micro-batch the centre gradient
    # appears in between (the softmax's backward), with more it was there before.
    after_softmax = marks.peak_between(f"softmax end {last}", f"step {measured_step} end") - start
    items["backbone_backward"] = max(marks.peak_between(f"forward {last}", f"forward end {last}") - start,
                                     after_softmax - (centre_gradient if cfg.gradient_acc == 1 else 0))
    # Everything else alive when the step starts: the batches, and scalars (grad scaler, optimizer steps). Counted
    # from what was alive once the state was built, less what the first step made to keep (the optimizer state, the
    # room for BatchNorm statistics); not as what is alive less the persistent items' sizes, because what DDP's
    # constructor leaves for a gloo thread to free (its broadcast's flat buffer, when that thread happens to drop
    # the last reference) is freed outside this thread's profile: it would never show as freed, and count here.
    made_by_first_step = (items["centre_optimizer_state"] + items["backbone_optimizer_state"]
                          + _nbytes(state.bn_buffers))
    items["batch"] = marks.at(f"step {measured_step}") - marks.at("built") - made_by_first_step
    items["total"] = marks.peak_between(f"step {measured_step}", f"step {measured_step} end")
    # Not planned, and 0 on a GPU (the caching allocator's figures include it): what this CPU's kernels add
    # on top of the tensors at some moment of the step.
    items["kernel_workspace"] = marks.workspace_between(f"step {measured_step}", f"step {measured_step} end")
    return items


def compare(cfg: SimpleNamespace, device: torch.device) -> dict[str, dict[str, int | None]]:
    """{"plan": bytes by item (rank 0 only, planned before anything is built), "measured": bytes by item}."""
    plan = memory_plan(cfg, cfg.num_classes, world()) if is_main() else {}
    return {"plan": plan, "measured": measure(cfg, device)}


def table(case: str, result: dict[str, dict[str, int | None]]) -> str:
    """Plan, measured and their ratio per item, in MiB."""
    lines = [f"{case}", f"  {'item':<26}{'plan MiB':>12}{'measured MiB':>14}{'plan/measured':>15}"]
    for item, measured in result["measured"].items():
        planned = result["plan"].get(item)
        ratio = f"{planned / measured:15.3f}" if planned is not None and measured else f"{'-':>15}"
        shown = f"{planned / 2 ** 20:12.3f}" if planned is not None else f"{'-':>12}"
        lines.append(f"  {item:<26}{shown}{measured / 2 ** 20:14.3f}{ratio}")
    return "\n".join(lines)


def ratios(result: dict[str, dict[str, int | None]]) -> str:
    """One line: the total planned and measured, and plan/measured of every item measured above zero."""
    plan, measured = result["plan"], result["measured"]
    items = ", ".join(f"{item.replace('_', ' ')} {plan[item] / measured[item]:.2f}" for item in measured
                      if item != "total" and measured[item] and plan.get(item) is not None)
    return (f"total plan {plan['total'] / 2 ** 30:.2f} GiB / peak {measured['total'] / 2 ** 30:.2f} GiB = "
            f"{plan['total'] / measured['total']:.2f}; {items}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for every case")
    parser.add_argument("--case", action="append", default=[], metavar="'KEY=VALUE ...'",
                        help="one measured configuration: overrides separated by spaces (repeatable)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", action="store_true", help="one JSON object per case and line")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    with exit_on_user_error():
        init_distributed(device, timeout_minutes=10)
        for case in args.case or [""]:
            result = compare(load_config(args.config, [*args.set, *case.split()]), device)
            if is_main():
                print(json.dumps({"case": case, **result}) if args.json else table(case or "(as configured)", result),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
