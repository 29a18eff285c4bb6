"""Host syncs per training step: how often one step of train.py's loop makes the host wait for the device, and where.

    python -m bench.host_syncs                                # CPU: the operations that would wait on a GPU
    python -m bench.host_syncs --device cuda                  # GPU: what CUDA itself reports as well
    python -m bench.host_syncs --sample-rates 1.0 0.1 0 --precision fp16

A step is all that train.py's loop does for one step, not only `training.step.train_step`: the non-finite
count (and the fp16 grad scale it may read), the log line every `frequent` steps, the stop signals' agreement,
the verification and save checks. `train.main` itself runs, in this process, on a tiny r18 with two views over
synthetic records made on the spot, with `frequent` = `--steps`; counted: from the start of step `--warmup` + 1
to the start of the step after `--steps` more (one log line among them), so neither the run's start nor its last
save is, and the warm-up keeps fp16's first steps out, whose overflows back the initial grad scale off.

On a CPU nothing waits, so `SyncCounter` counts the operations that make the host wait for a GPU:
reading a scalar (`.item()`, `bool()`, `int()`), operations whose output shape depends on the data
(`nonzero` and what is built on it: boolean-mask indexing, `masked_select`, one-argument `where`;
`unique`; `repeat_interleave` without `output_size`), a tensor made from a Python list (a blocking
host-to-device copy when made on a GPU) and blocking copies between host and device. On a GPU,
`torch.cuda.set_sync_debug_mode("warn")` reports every synchronising CUDA call torch makes, with the
line that made it. `training_step` (train_step alone on random batches made on the device) serves the benches
that need a step without the loop (bench/memory_growth.py).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import logging
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
from tools import make_synthetic
from training.config import load_config
from training.state import build_training_state
from training.step import train_step
from utils.device import configure_numerics

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten

# Operations that always make a GPU's host wait, and why.
ALWAYS_SYNC = {
    aten._local_scalar_dense.default: "scalar read",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.equal.default: "equal",
}
INDEXING = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default)


def _reason(func, args, kwargs) -> str | None:
    """Why `func(*args, **kwargs)` makes a GPU's host wait, or None when it does not."""
    if func in ALWAYS_SYNC:
        return ALWAYS_SYNC[func]
    if func in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
        return "boolean-mask indexing"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if func is aten.lift_fresh.default and args[0].dim() > 0:
        return "tensor from host data"
    if func is aten.copy_.default:
        source, target, non_blocking = args[1].device, args[0].device, (args[2:] or [False])[0]
    elif func is aten._to_copy.default:
        source, non_blocking = args[0].device, kwargs.get("non_blocking", False)
        target = torch.device(kwargs.get("device") or source)
    else:
        return None
    if (source.type == "cpu") != (target.type == "cpu") and not (non_blocking or kwargs.get("non_blocking")):
        return "blocking copy between host and device"
    return None


def _caller() -> str:
    """file:line of the innermost project frame outside this module (torch's own frames skipped)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(ROOT) and path != Path(__file__).resolve() and ".venv" not in path.parts:
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "torch"


class SyncCounter(TorchDispatchMode):
    """Records (reason, file:line) of every operation under it that would make a GPU's host wait."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _reason(func, args, kwargs)
        if reason is not None:
            self.syncs.append((reason, _caller()))
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning raised inside, with CUDA's sync debug mode on: each synchronising CUDA call torch makes is one
    (cuda_sync_lines picks them out)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def cuda_sync_lines(caught: list[warnings.WarningMessage]) -> list[tuple[str, str]]:
    """("cuda sync", file:line) of each synchronising CUDA call among `caught` (cuda_warnings)."""
    return [("cuda sync", f"{Path(warning.filename).name}:{warning.lineno}") for warning in caught
            if "synchronizing" in str(warning.message)]


def training_step(device: torch.device, classes: int, batch_size: int, *overrides: str) -> Callable[[], object]:
    """One train_step as GPU training runs it, on a fresh batch of random two-view records each call (made
    on the device from a seeded generator: no host copy, the same batches every run), so that the sampled
    centres change from step to step as in training; a tiny r18 unless config `overrides` (key=value) say
    otherwise."""
    cfg = load_config(ROOT / "configs" / "synthetic_pair.py", [
        "network=r18", "network_kwargs={'width_mult': 0.0625}", "embedding_size=64", "num_views=2", "fp16=False",
        f"batch_size={batch_size}", "num_epoch=1000", *overrides])
    configure_numerics(device, cfg.tf32, cfg.deterministic)
    state = build_training_state(cfg, classes, device, steps_per_epoch=1000)
    state.pfc.defer_label_check = True  # as on a GPU: a bad label poisons the loss instead of a check that waits
    batches = random_batches(device, classes, batch_size)
    return lambda: train_step(state, [next(batches)], cfg)


def random_batches(device: torch.device, classes: int, batch_size: int, seed: int = 0
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images (B, 2, 3, 112, 112) uint8, labels (B,)) on `device`, new ones each time, from `seed`."""
    generator = torch.Generator(device).manual_seed(seed)
    while True:
        images = torch.randint(0, 256, (batch_size, 2, 3, 112, 112), dtype=torch.uint8, generator=generator,
                               device=device)
        yield images, torch.randint(0, classes, (batch_size,), generator=generator, device=device)


def loop_syncs(device: torch.device, data: Path, classes: int, batch_size: int, warmup: int, steps: int,
               *overrides: str) -> tuple[float, float, collections.Counter]:
    """Per step of train.py's loop (module docstring): the operations that wait, the syncs CUDA reported (on a
    GPU), and how often each (reason, file:line) occurred per `steps` steps."""
    counter, started = SyncCounter(), []  # started: (operations, CUDA's warnings) seen when each step began
    with contextlib.ExitStack() as stack:
        caught = stack.enter_context(cuda_warnings()) if device.type == "cuda" else []
        stack.enter_context(counter)
        _train(data, stack.enter_context(tempfile.TemporaryDirectory()),
               lambda: started.append((len(counter.syncs), len(caught))), f"device={device.type}",
               f"num_classes={classes}", f"batch_size={batch_size}", f"max_steps={warmup + steps + 1}",
               f"frequent={steps}", *overrides)
    (first, first_cuda), (end, end_cuda) = started[warmup], started[warmup + steps]
    found = cuda_sync_lines(caught[first_cuda:end_cuda])
    return (end - first) / steps, len(found) / steps, collections.Counter(counter.syncs[first:end] + found)


def _train(data: Path, output: str, step_begins: Callable[[], None], *overrides: str) -> None:
    """train.main on the tiny network, `step_begins()` called as each step of its loop begins (the rest of the
    loop's work for a step follows its train_step), its log kept out of this bench's table (shown if it fails).
    One data worker, as training has: the decoding it does on the host in its own process is no wait for the
    device."""
    argv = [str(ROOT / "configs" / "synthetic_pair.py")]
    for item in [f"rec={data}", f"output={output}", "network=r18", "network_kwargs={'width_mult': 0.0625}",
                 "embedding_size=64", "num_views=2", "num_workers=1", "verbose=1000000", "val_targets=()",
                 "save_every_steps=0", "num_epoch=1000", *overrides]:
        argv += ["--set", item]
    printed, real_step = io.StringIO(), train.train_step

    def marked_step(*args, **kwargs):
        step_begins()
        return real_step(*args, **kwargs)

    train.train_step = marked_step
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            status = train.main(argv)
    finally:
        train.train_step = real_step
        logging.getLogger().handlers.clear()  # train.py's, which write to the finished run's folder
    if status != 0:
        raise SystemExit(f"the training run failed:\n{printed.getvalue()[-3000:]}")


def synthetic_records(folder: Path, records: int) -> Path:
    """At least `records` two-view records of 20 identities in `folder` (tools/make_synthetic.py)."""
    images = 2 * -(-records // 20)  # per identity: two images make a record
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        status = make_synthetic.main(["--output", str(folder), "--identities", "20", "--images-per-identity",
                                      str(images), "--val-identities", "10", "--val-pairs", "20", "--workers", "1"])
    if status != 0:
        raise SystemExit(f"tools/make_synthetic.py failed:\n{printed.getvalue()[-3000:]}")
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sample-rates", type=float, nargs="+", default=[1.0, 0.1, 0.0])
    parser.add_argument("--classes", type=int, default=1000, help="class centres (one process)")
    parser.add_argument("--batch-size", type=int, default=8, help="records per step")
    parser.add_argument("--warmup", type=int, default=12, help="steps before those counted")
    parser.add_argument("--steps", type=int, default=4, help="steps counted (and frequent: one log line among them)")
    parser.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp16",
                        help="the backbone's autocast; fp16 (the GPU recipes') adds the grad scaler")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    precision = [f"fp16={args.precision == 'fp16'}", f"bf16={args.precision == 'bf16'}"]
    print(f"host syncs per training step (train.py's loop): r18 1/16, 2 views, B={args.batch_size}, {args.classes} "
          f"classes, {args.precision}, steps {args.warmup + 1}-{args.warmup + args.steps} (a log line among them), "
          f"{device}")
    print(f"{'sample_rate':>11}  {'ops/step':>8}  {'cuda/step':>9}  where (per step)")
    with tempfile.TemporaryDirectory() as folder:
        # an epoch longer than the run: no epoch-end save among the steps counted
        data = synthetic_records(Path(folder), (args.warmup + args.steps + 1) * args.batch_size)
        for rate in args.sample_rates:
            operations, cuda, seen = loop_syncs(device, data, args.classes, args.batch_size, args.warmup, args.steps,
                                                f"sample_rate={rate}", *precision)
            where = "; ".join(f"{line} {reason} x{count / args.steps:g}"
                              for (reason, line), count in sorted(seen.items()))
            print(f"{rate:>11g}  {operations:>8g}  {cuda if device.type == 'cuda' else '-':>9}  {where or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
