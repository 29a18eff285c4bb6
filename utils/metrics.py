"""Where a run's scalars go: TensorBoard under `output/tensorboard` (rank 0), and with `using_wandb`
Weights & Biases too, as arcface_torch does it (run name `<yymmdd_HHMM>_GPU<rank>[_<suffix>]`, the
config attached, `backbone.pth` uploaded as a model artifact with `save_artifacts`).

wandb is an optional extra: only a run that asks for it imports it. `WANDB_MODE=offline` keeps
everything under `output/wandb` without a network.
"""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

from utils.distributed import is_main, rank
from utils.errors import ConfigError

PLACEHOLDER_KEY = "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"  # arcface_torch's base.py: not a key


class Metrics:
    """add_scalar(tag, value, step) to every sink this process has; log_artifact; close."""

    def __init__(self, tensorboard=None, wandb_run=None) -> None:
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({tag: value}, step=step)

    def log_artifact(self, path: Path, name: str) -> None:
        """Upload a weights file as a W&B model artifact (with save_artifacts; nothing otherwise)."""
        if self.wandb_run is not None and self.wandb_run.config.get("save_artifacts"):
            import wandb  # noqa: PLC0415 (optional extra: only runs that log to W&B need it)

            artifact = wandb.Artifact(f"{self.wandb_run.name}_{name}", type="model")
            artifact.add_file(str(path))
            self.wandb_run.log_artifact(artifact)

    def close(self) -> None:
        """Flush and close every sink (also when the run stops on an error)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def open_metrics(cfg: SimpleNamespace, resumed_at: int | None = None) -> Metrics:
    """This process's sinks: TensorBoard on rank 0; W&B on rank 0, or on every rank with wandb_log_all.

    `resumed_at`: the (shown) step a resumed run continues from. What an earlier start logged after it (steps
    it trained again, or a window cut short by a stop) is purged from TensorBoard's view, so that every step
    has one point, this run's."""
    tensorboard = None
    if is_main():
        # a quarter of a second to import; a start refused before its steps never needs it
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

        tensorboard = SummaryWriter(log_dir=os.path.join(cfg.output, "tensorboard"),
                                    purge_step=None if resumed_at is None else resumed_at + 1)
    wandb_run = _wandb_run(cfg) if cfg.using_wandb and (is_main() or cfg.wandb_log_all) else None
    return Metrics(tensorboard, wandb_run)


def _wandb_run(cfg: SimpleNamespace):
    try:
        import wandb  # noqa: PLC0415 (optional extra: only runs that log to W&B need it)
    except ImportError:
        raise ConfigError("using_wandb=True needs the wandb package; install it with `pip install wandb`, or set "
                          "using_wandb=False") from None
    if cfg.wandb_key and cfg.wandb_key != PLACEHOLDER_KEY and os.environ.get("WANDB_MODE") != "offline":
        wandb.login(key=cfg.wandb_key)
    name = f"{datetime.now():%y%m%d_%H%M}_GPU{rank()}" + (f"_{cfg.suffix_run_name}" if cfg.suffix_run_name else "")
    try:
        return wandb.init(entity=cfg.wandb_entity, project=cfg.wandb_project, name=name, notes=cfg.notes,
                          resume="auto" if cfg.wandb_resume else None, dir=cfg.output, config=vars(cfg))
    except wandb.Error as error:
        raise ConfigError(f"Weights & Biases refused the run ({error}); check wandb_key, wandb_entity and "
                          "wandb_project, or run with WANDB_MODE=offline") from None
