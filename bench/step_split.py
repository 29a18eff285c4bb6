"""Where a training step's time goes, per network and view count, and how far it is from the hardware:
images/s; the step split into data (the batch's copy to the device), backbone forward, PartialFC (its
forward and backward: from the embeddings to their gradient), backbone backward and optimizer (unscale,
clip, the worst outcome over the ranks, the step, the LR); and MFU, the step's useful FLOPs per second over
the GEMM rate measured in the same run (a large matmul in the step's dtype). The backbone's FLOPs are counted at 112x112
by torch's FlopCounterMode on the meta device, three times the forward's for a training step (forward,
the input's and the weights' gradients; checkpointing's recomputation is not useful work).

    python -m bench.bench_train --split                                   # CPU, tiny r18 at width 0.25
    python -m bench.bench_train --split --device cuda --networks r50 r100 vit_b --views 1 2 \\
        --width-mult 1 --embedding-size 512 --batch-size 128 --classes 100000 --fp16 --steps 20
    python -m bench.bench_train --split --tiny --networks r50 r100 vit_b   # that command's path, CPU, tiny shapes

Marks are CUDA events on a GPU (recorded in module and gradient hooks, read once per step after a
synchronize) and perf_counter on a CPU, where every kernel has finished when its call returns. The marks
follow each other, so the phases add up to the step (tests/test_step_split.py checks that they do).

Switches, each measured on and off in the same run (`--switches`), applied by training's own keys
(channels_last, compile_backbone, bf16: training/speedups.py): channels_last (ResNets: the backbone's
weights in NHWC, so its convolutions run NHWC), bf16 (autocast to bfloat16 without a GradScaler, against
the run's own precision), compile (torch.compile of the backbone; its compile time, the first step's
seconds beyond a steady step's, in a column of its own, the kernels cached in TORCHINDUCTOR_CACHE_DIR,
by default a folder of the temporary directory, so a second run reads them), cudagraphs (the same compiled
with mode="reduce-overhead": its forward and backward replayed as CUDA graphs, the step's shapes being
static; a GPU only), and the backbone's optimizer
kernel (fused, training's, against foreach and the per-tensor loop), timed as the backbone's parameter
update alone (the centres' update is PartialFC's own).

On a CPU, channels_last and compile are not measured for a narrow ResNet that oneDNN would crash on in NHWC
(training/speedups.py says which convolution); the row says so instead of killing the run. GPUs do not run
oneDNN.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from backbones import get_model
from bench.floor import gemm_rate, seconds
from training.config import load_config
from training.speedups import onednn_nhwc_crash
from training.state import TrainingState, build_training_state, wrap_for_the_step
from training.step import train_step
from utils.device import configure_numerics

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("data", "backbone fwd", "PartialFC", "backbone bwd", "optimizer")
EDGES = ("start", "data", "embeddings", "gradient", "backward", "end")  # the marks between the phases
SWITCHES = ("channels_last", "bf16", "compile", "cudagraphs")
COMPILED = {"compile": "default", "cudagraphs": "reduce-overhead"}  # switch -> torch.compile's mode
BASELINE = "baseline"
# --tiny: the shapes of a rehearsal (the command's code path on a CPU in seconds, not a measurement)
TINY = {"width_mult": 0.0625, "embedding_size": 32, "batch_size": 2, "classes": 50, "steps": 1}
SPLIT_WIDTH = 0.25  # --split's width unless given: the narrowest r18 whose channels_last runs on a CPU


def training_flops_per_image(network: str, width_mult: float, embedding_size: int) -> float:
    """FLOPs of one image's training step through the backbone: 3x its forward at 112x112, counted on the meta
    device (no memory, no arithmetic) by torch's own FLOP formulas."""
    with torch.device("meta"):
        backbone = get_model(network, num_features=embedding_size, width_mult=width_mult).eval()
        image = torch.empty(1, 3, 112, 112)
    with FlopCounterMode(display=False) as counter:
        backbone(image)
    return 3.0 * counter.get_total_flops()


class Marks:
    """Named points in a step: CUDA events on a GPU, perf_counter on a CPU; seconds between them. Cleared
    every step, so a hook that did not fire is an error, not last step's time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[name] = event
        else:
            self.points[name] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float:
        missing = [name for name in (start, end) if name not in self.points]
        if missing:
            raise RuntimeError(f"the step passed no '{missing[0]}' mark: a hook of bench/step_split.py did not fire")
        if self.cuda:
            return self.points[start].elapsed_time(self.points[end]) / 1e3
        return self.points[end] - self.points[start]


def instrument(state: TrainingState, marks: Marks) -> None:
    """Marks from hooks: the backbone's forward ends (with the batch's normalisation before it, the backbone
    forward phase), the embeddings' gradient arrives (PartialFC done), the last parameter gradient of the
    backbone is accumulated (its backward done: every firing re-marks, the last one stands)."""

    def forward_done(_module, _inputs, output):
        marks.mark("embeddings")
        if output.requires_grad:
            output.register_hook(lambda grad: marks.mark("gradient"))

    state.ddp_backbone.register_forward_hook(forward_done)
    for parameter in state.backbone.parameters():
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(lambda _: marks.mark("backward"))


def not_run_here(network: str, switch: str, args, device: torch.device) -> str | None:
    """Why `switch` is not measured for `network` here, or None: channels_last is for ResNets, CUDA graphs for GPUs,
    and on a CPU a narrow ResNet in NHWC (channels_last, or compiled: inductor runs convolutions NHWC) would crash
    oneDNN (training/speedups.py)."""
    if switch == "channels_last" and not network.startswith("r"):
        return "ResNets only"
    if switch == "cudagraphs" and device.type != "cuda":
        return "not run on this CPU: CUDA graphs need a GPU"
    if switch not in ("channels_last", "compile"):
        return None
    with torch.device("meta"):
        backbone = get_model(network, num_features=args.embedding_size, width_mult=args.width_mult)
    crash = onednn_nhwc_crash(backbone, device)
    if crash:
        return (f"not run on this CPU: oneDNN's NHWC backward of {crash} corrupts the heap; width >= {SPLIT_WIDTH} "
                "runs, or a GPU")
    return None


def build(args, network: str, views: int, switches: frozenset[str], device: torch.device):
    """(state, cfg, host batch) of one configuration, switches applied as training would apply them."""
    precision = ["bf16=True", "fp16=False"] if "bf16" in switches else [f"fp16={args.fp16}", "bf16=False"]
    compiled = [f"compile_backbone={COMPILED[switch]!r}" for switch in switches & COMPILED.keys()]
    cfg = load_config(ROOT / "configs" / "synthetic_pair.py", [
        f"network={network}", f"network_kwargs={{'width_mult': {args.width_mult}}}",
        f"embedding_size={args.embedding_size}", f"num_views={views}", *precision, f"batch_size={args.batch_size}",
        "num_epoch=1000", "optimizer=sgd", f"channels_last={'channels_last' in switches}", *compiled])
    configure_numerics(device, cfg.tf32, cfg.deterministic)
    state = build_training_state(cfg, args.classes, device, steps_per_epoch=1000)
    wrap_for_the_step(state, cfg, device)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.batch_size, views, 3, 112, 112), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, args.classes, (args.batch_size,), generator=generator)
    if device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    return state, cfg, (images, labels)


def measure(args, network: str, views: int, switches: frozenset[str], device: torch.device) -> dict:
    """Median seconds per phase and of the whole step over `args.steps` steps after a first one, and the
    compile seconds (the first step's beyond a steady step's) where the backbone is compiled."""
    state, cfg, (images, labels) = build(args, network, views, switches, device)
    marks = Marks(device)
    instrument(state, marks)

    def step() -> dict[str, float]:
        marks.points.clear()
        marks.mark("start")
        batch = [(images.to(device, non_blocking=True), labels.to(device, non_blocking=True))]
        marks.mark("data")
        train_step(state, batch, cfg)
        marks.mark("end")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        split = {phase: marks.seconds(a, b) for phase, a, b in zip(PHASES, EDGES[:-1], EDGES[1:], strict=True)}
        split["step"] = marks.seconds("start", "end")
        return split

    first = seconds(step, device)
    steps = [step() for _ in range(args.steps)]
    result = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    compiled = bool(switches & COMPILED.keys())
    result["compile"] = first - result["step"] if compiled else None
    if compiled:
        # Forget this case's graphs: the next case's shapes would otherwise count as a recompilation of the
        # same forward, compiled with dynamic shapes and within dynamo's cache limit, and keep this model alive.
        torch._dynamo.reset()
    return result


def optimizer_kernels(args, network: str, device: torch.device) -> dict[str, float]:
    """Seconds of the backbone's SGD update (momentum, weight decay) per kernel choice: fused, foreach, loop."""
    backbone = get_model(network, num_features=args.embedding_size, width_mult=args.width_mult).to(device)
    parameters = [p for p in backbone.parameters() if p.requires_grad]
    for p in parameters:
        p.grad = torch.randn_like(p)
    per_kernel = {}
    for kernel, options in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("loop", {"foreach": False})):
        optimizer = torch.optim.SGD(parameters, lr=0.1, momentum=0.9, weight_decay=5e-4, **options)
        optimizer.step()  # momentum buffers made outside the timing
        per_kernel[kernel] = statistics.median(seconds(optimizer.step, device) for _ in range(max(args.steps, 3)))
    return per_kernel


def header(args, device: torch.device, rates: dict) -> list[str]:
    """The lines above the table: what ran, where, and how loaded the machine was."""
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.2f} at the start")
    gemm = ", ".join(f"{str(dtype).removeprefix('torch.')} {rate / 1e9:.1f}" for dtype, rate in rates.items())
    lines = [f"step split: width {args.width_mult}, embedding {args.embedding_size}, B={args.batch_size} records, "
             f"{args.classes} classes, fp16={args.fp16}, torch {torch.__version__}, {where}; median of "
             f"{args.steps} step(s) after one; GEMM GFLOP/s measured here: {gemm}"]
    if set(args.switches) & COMPILED.keys():
        lines.append(f"compile cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    lines.append(f"{'network':<8}{'views':>6} {'switch':<14}{'images/s':>10}{'x base':>8}{'step ms':>10}"
                 + "".join(f"{phase.replace(' ', '_') + '_ms':>16}" for phase in PHASES)
                 + f"{'MFU':>7}{'compile_s':>11}")
    return lines


def row(network: str, views: int, name: str, result: dict, base: float, images_per_second: float, mfu: float) -> str:
    """One measured line of the table (tests/test_step_split.py parses it)."""
    compile_seconds = f"{result['compile']:.1f}" if result["compile"] is not None else "-"
    return (f"{network:<8}{views:>6} {name:<14}{images_per_second:>10.1f}{base / result['step']:>7.2f}x"
            f"{result['step'] * 1e3:>10.2f}" + "".join(f"{result[phase] * 1e3:>16.2f}" for phase in PHASES)
            + f"{mfu:>7.1%}{compile_seconds:>11}")


def report(args, device: torch.device) -> None:
    """The split table per network, view count and switch, then the optimizer kernels, printed as measured."""
    if set(args.switches) & COMPILED.keys():
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "pairface-bench-inductor"))
    defaults = load_config(ROOT / "configs" / "synthetic_pair.py", [])
    # the GEMM rate under training's numerics (float32 matmuls in TF32 on a GPU, by default)
    configure_numerics(device, defaults.tf32, defaults.deterministic)
    precision = torch.float16 if args.fp16 and device.type == "cuda" else torch.float32
    rates = {precision: gemm_rate(device, precision)}
    if "bf16" in args.switches:
        rates[torch.bfloat16] = gemm_rate(device, torch.bfloat16)
    print("\n".join(header(args, device, rates)), flush=True)
    for network in args.networks:
        flops = training_flops_per_image(network, args.width_mult, args.embedding_size)
        for views in args.views:
            base = None
            for name in (BASELINE, *args.switches):
                problem = not_run_here(network, name, args, device) if name != BASELINE else None
                if problem:
                    print(f"{network:<8}{views:>6} {name:<14}{problem}", flush=True)
                    continue
                switches = frozenset() if name == BASELINE else frozenset([name])
                result = measure(args, network, views, switches, device)
                base = base or result["step"]
                images_per_second = args.batch_size * views / result["step"]
                rate = rates[torch.bfloat16 if "bf16" in switches else precision]
                print(row(network, views, name, result, base, images_per_second, images_per_second * flops / rate),
                      flush=True)
        kernels = optimizer_kernels(args, network, device)
        print(f"{network} backbone SGD update: " + ", ".join(
            f"{kernel} {seconds * 1e3:.2f} ms ({seconds / kernels['fused']:.2f}x fused)"
            for kernel, seconds in kernels.items()), flush=True)
    if device.type == "cpu":
        print("CPU figures rank the switches on this CPU only. The GPU's: `python -m bench.bench_train --split "
              "--device cuda --networks r50 r100 vit_b --views 1 2 --width-mult 1 --embedding-size 512 "
              "--batch-size 128 --classes 100000 --fp16 --steps 20` on the GPU machine, a call per group of "
              "switches (docs/gpu.md).")


def add_options(parser: argparse.ArgumentParser) -> None:
    """The split's own options on bench_train's parser."""
    parser.add_argument("--split", action="store_true", help="the step split, MFU and the switches (this module)")
    parser.add_argument("--networks", nargs="+", default=["r18"], help="with --split")
    parser.add_argument("--views", nargs="+", type=int, default=[1, 2], help="with --split")
    parser.add_argument("--switches", nargs="*", default=list(SWITCHES), choices=SWITCHES,
                        help="with --split: each measured on and off")
    parser.add_argument("--tiny", action="store_true", help="with --split: tiny shapes on the CPU unless given, a "
                        "rehearsal of a command's code path, not a measurement: "
                        + ", ".join(f"{key}={value}" for key, value in TINY.items()))

