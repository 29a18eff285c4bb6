"""Training log: rank 0 writes `output/training.log` and stdout in arcface_torch's style, and
TensorBoard scalars under `output/tensorboard`; other ranks report warnings and errors on stderr, and
add their errors to training.log."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch

from utils.distributed import is_main, rank
from utils.metrics import Metrics

LOG_NAME = "training.log"
LOG_FORMAT = "Training: %(asctime)s-%(message)s"
FILE_ONLY = {"file_only": True}  # `extra=` of a line for training.log alone: what would crowd the terminal


def _not_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


class _RunLog(logging.FileHandler):
    """training.log, told apart from the terminal's handlers so that a line can go to the file alone."""


def setup_logging(output_dir: str) -> logging.Logger:
    """Configure the root logger for this process (idempotent: earlier handlers are replaced)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    run_log = _RunLog(os.path.join(output_dir, LOG_NAME), delay=True)  # other ranks open it for an error only
    if is_main():
        root.setLevel(logging.INFO)
        terminal = logging.StreamHandler(sys.stdout)
        terminal.addFilter(_not_file_only)
        handlers = [run_log, terminal]
        formatter = logging.Formatter(LOG_FORMAT)
    else:
        root.setLevel(logging.WARNING)
        run_log.setLevel(logging.ERROR)
        handlers = [logging.StreamHandler(sys.stderr), run_log]
        formatter = logging.Formatter(f"Training[rank {rank()}]: %(asctime)s-%(message)s")
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    return root


def log_to_file_only(message: str) -> None:
    """`message` as an error in training.log alone, when this process writes one: for lines already
    printed on the terminal (`error: ...`), so that the log says why the run ended."""
    record = logging.getLogger("train").makeRecord("train", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _RunLog):
            handler.handle(record)


def format_duration(seconds: float) -> str:
    """Upstream prints whole hours ("Required: 3 hours"); short runs need minutes or seconds."""
    if seconds >= 3600:
        return f"{seconds / 3600:.0f} hours"
    if seconds >= 60:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds:.0f} seconds"


class SpeedLogger:
    """Every `frequent` steps: one log line and its scalars in `metrics` (TensorBoard, W&B; rank 0 only).

    Speed counts training time only: time spent inside `paused()` (verification, checkpoints) is
    left out, so a verification pass does not show up as a slow step as it does upstream. Losses
    are summed where they are (on the GPU in training) and read only on logging steps, so that a
    normal step never waits for the device because of the log.
    """

    def __init__(self, frequent: int, total_steps: int, global_batch: int, num_views: int,
                 metrics: Metrics | None = None, start_step: int = 0) -> None:
        self.frequent = frequent
        self.total_steps = total_steps
        self.global_batch = global_batch
        self.num_views = num_views
        self.metrics = metrics
        self._loss_sum: torch.Tensor | float = 0.0  # [loss, loss of view 1..V] summed over the steps seen
        self._loss_count = 0
        self._first_step = start_step
        self._last_step = start_step
        self._train_seconds = 0.0
        self._window_seconds = 0.0
        self._tic = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._clock()
        try:
            yield
        finally:
            self._tic = time.perf_counter()

    def _clock(self) -> None:
        now = time.perf_counter()
        self._window_seconds += now - self._tic
        self._tic = now

    def __call__(self, global_step: int, losses: torch.Tensor, epoch: int, lr: float,
                 grad_scale: Callable[[], float] | None = None) -> str | None:
        """Record one step's [loss, loss of view 1..V]; on logging steps return (and log) the line.
        `grad_scale` (fp16) is asked for the scale on logging steps only."""
        self._loss_sum = self._loss_sum + losses.detach()
        self._loss_count += 1
        if global_step % self.frequent != 0 or not is_main():
            return None
        self._clock()
        steps = global_step - self._last_step
        self._train_seconds += self._window_seconds
        samples_per_sec = steps * self.global_batch / max(self._window_seconds, 1e-9)
        eta = self._train_seconds / max(global_step - self._first_step, 1) * (self.total_steps - global_step)
        loss, *view_losses = (self._loss_sum / self._loss_count).tolist()
        views = " ".join(f"v{i + 1} {value:.2f}" for i, value in enumerate(view_losses))
        line = (f"Speed {samples_per_sec:.2f} samples/sec {samples_per_sec * self.num_views:.2f} images/sec   "
                f"Loss {loss:.4f} ({views})   LR {lr:.4f}   Epoch: {epoch}   Global Step: {global_step}   ")
        if grad_scale is not None:
            line += f"Fp16 Grad Scale: {grad_scale():.0f}   "
        line += f"Required: {format_duration(max(eta, 0.0))}"
        logging.info(line)
        if self.metrics is not None:
            self.metrics.add_scalar("loss", loss, global_step)
            for i, value in enumerate(view_losses):
                self.metrics.add_scalar(f"loss_view{i + 1}", value, global_step)
            self.metrics.add_scalar("learning_rate", lr, global_step)
            self.metrics.add_scalar("samples_per_sec", samples_per_sec, global_step)
        self._loss_sum, self._loss_count = 0.0, 0
        self._last_step = global_step
        self._window_seconds = 0.0
        return line
