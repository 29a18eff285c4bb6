"""The training state: everything an optimizer step changes, built from a configuration alone.

`TrainingState` holds the backbone (and its DistributedDataParallel wrapper), the class centres
(`PartialFC`), one optimizer over both, the LR schedule and the grad scaler, and the components a checkpoint
saves them through (training/components.py), built once with it. `COMPONENTS` is the one registry of every
piece of saved state: those components, the step counter (training/progress.py) and each process's own state
(its random streams, its loader's position); `registry` gives a run's instances of them all, which a save
writes and every importer puts back.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from backbones import get_model
from margin_families import build_margin, centres_per_class
from partial_fc import PartialFC
from training.components import (
    Backbone,
    Centres,
    Component,
    GradScale,
    LoaderPosition,
    MarginState,
    Optimizer,
    RandomStreams,
    Schedule,
)
from training.ema import BackboneEMA
from training.optimizer import RowSparseAdamW, RowSparseSGD
from training.progress import StepCounter
from training.semi_siamese import SemiSiamese
from training.speedups import check_speedups, compiled_for_the_step, to_channels_last
from utils.compat import ddp_without_buffer_sync
from utils.distributed import world
from utils.lr_scheduler import build_scheduler


@dataclass
class TrainingState:
    """Everything a step changes: the networks, their optimizer, schedule and grad scaler."""

    backbone: nn.Module            # the plain backbone (checkpoints, verification)
    ddp_backbone: nn.Module        # what the step calls: the backbone wrapped in DDP when world > 1
    pfc: PartialFC
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    precision: torch.dtype | None  # the autocast type of the step (float16, bfloat16), None for float32
    bn_buffers: list[torch.Tensor] = field(default_factory=list)  # room to keep BatchNorm statistics in
    components: list[Component] = field(init=False)  # what a checkpoint saves: build_components
    config: InitVar[Mapping | None] = None  # the run's config, which says the optional components

    def __post_init__(self, config: Mapping | None) -> None:
        self.components = build_components(self, config or {})

    def before_step(self) -> None:
        """A step begins: the components that hold what a step proposes (the SST queue's features) forget what a
        skipped step left."""
        for component in self.components:
            component.before_step()

    def after_step(self) -> None:
        """An optimizer step was taken: the components that follow the weights (an EMA) follow it."""
        for component in self.components:
            component.after_step()


    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.precision is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.precision)

    def keep_bn_buffers(self) -> None:
        """BatchNorm statistics move in the forward pass, before the loss is known: kept to be put back
        when the step is skipped, so that a non-finite batch leaves the backbone exactly as it was."""
        buffers = list(self.backbone.buffers())
        if len(self.bn_buffers) != len(buffers):
            self.bn_buffers = [torch.empty_like(buffer) for buffer in buffers]
        _copy_all(self.bn_buffers, buffers)

    def restore_bn_buffers(self) -> None:
        _copy_all(list(self.backbone.buffers()), self.bn_buffers)


# The one registry: every piece of saved state, in the order a resume loads it (the backbone first: the
# components that follow it find the checkpoint's weights there), the run's own objects last (registry). A new
# piece of saved state is its component class and its line here.
COMPONENTS: tuple[type[Component], ...] = (
    Backbone,
    BackboneEMA,  # the backbone with ema_decay
    RandomStreams,
    Centres,
    Optimizer,
    Schedule,
    GradScale,
    MarginState,
    SemiSiamese,
    StepCounter,
    LoaderPosition,
)


def build_components(state, config: Mapping) -> list[Component]:
    """The components of `state` (a TrainingState, or anything with its networks, optimizer, schedule and
    scaler) that `config` asks for, in COMPONENTS's order: all but the run's own objects (registry)."""
    return [component for cls in COMPONENTS if (component := cls.build(state, config)) is not None]


def registry(state, counter: StepCounter, loader) -> list[Component]:
    """Every component of a run, in COMPONENTS's order: those built once with `state`, the run's step counter
    and its loader's position (`loader`: a FaceLoader, or any Stateful of a loader's position), which the run
    holds itself and passes with each save and resume, as torchtitan passes its state."""
    return [*state.components, counter, LoaderPosition(loader)]


def restore_components(state, saved: Mapping) -> None:
    """Put every component of `state` back from `saved` (its keys, in the form the components' state_dict gives,
    tensors included), the backbone first. Every importer (pairface's checkpoint, arcface_torch's, an earlier
    version's, a bare backbone) restores through here, so that what a component does on loading holds on every
    path: the optimizer state in its parameters' memory layouts, the EMA's averages from the loaded weights. A
    key the format does not hold is absent, and its component keeps what it has or starts afresh."""
    for component in state.components:
        component.load_state_dict({key: saved[key] for key in component.keys if key in saved})


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One fused copy of every tensor (a backbone may have no buffers at all)."""
    if targets:
        torch._foreach_copy_(targets, sources)


def precision(cfg: SimpleNamespace) -> torch.dtype | None:
    """The one precision switch: arcface_torch's `fp16` (with a GradScaler), or `bf16`."""
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None


def architecture(cfg: SimpleNamespace, num_classes: int, photo_preparation: str | None = None) -> dict:
    """What the saved weights are shaped for (a checkpoint must match it to be resumed by this run: the
    SHAPE_KEYS), and how the training photos were prepared when the data records it; model.json records it
    all beside backbone.pth. Sub-centres are named only when there are several, so that checkpoints of one
    centre per class (arcface_torch's, earlier versions') keep matching."""
    shape = {"network": cfg.network, "network_kwargs": dict(cfg.network_kwargs),
             "embedding_size": cfg.embedding_size, "num_classes": num_classes}
    if centres_per_class(cfg) > 1:
        shape["num_subcenters"] = centres_per_class(cfg)
    return {**shape, **({"photo_preparation": photo_preparation} if photo_preparation else {})}


def describe_margin(cfg: SimpleNamespace) -> str:
    """The margin family and the values it uses, as --dry-run and the start-up log show them."""
    k = centres_per_class(cfg)
    return f"{cfg.margin_family}: {build_margin(cfg)!r}" + (f" over {k} sub-centres per class" if k > 1 else "")


def build_networks(cfg: SimpleNamespace, num_classes: int, device: torch.device) -> tuple[nn.Module, PartialFC]:
    """Backbone and class centres, initialised from cfg.seed alone (the same on any world size)."""
    torch.manual_seed(cfg.seed)
    backbone = get_model(cfg.network, num_features=cfg.embedding_size, dropout=cfg.dropout,
                         **cfg.network_kwargs).to(device)
    check_speedups(cfg, backbone, device)
    to_channels_last(cfg, backbone)
    # On a GPU the label check would make every step wait for the device: deferred to a NaN loss instead. The
    # sampled centres' gradient is sparse, for build_optimizer's update.
    pfc = PartialFC(build_margin(cfg), cfg.embedding_size, num_classes, cfg.sample_rate, view_weights=cfg.view_weights,
                    seed=cfg.seed, defer_label_check=device.type == "cuda",
                    num_subcenters=centres_per_class(cfg), sparse_grad=True,
                    compile_margin_softmax=cfg.compile_margin_softmax).to(device)
    return backbone, pfc


BACKBONE_GROUP, CENTRES_GROUP = 0, 1  # the optimizer's parameter groups; the centres' lr is the scheduled one


def group_lrs(config: Mapping) -> list[float]:
    """Base learning rate of each parameter group: the backbone's scaled by backbone_lr_mult (fine-tuning)."""
    return [config["lr"] * config["backbone_lr_mult"], config["lr"]]


def backbone_frozen(state: TrainingState, cfg: SimpleNamespace) -> bool:
    """Whether the coming step trains the class centres alone: every step with freeze_backbone, else those of
    freeze_backbone_steps (counted on the LR schedule's steps, so that a resume goes on where the warm-up was)."""
    return cfg.freeze_backbone or state.scheduler.last_epoch < cfg.freeze_backbone_steps


def build_optimizer(cfg: SimpleNamespace, backbone: nn.Module, pfc: PartialFC) -> torch.optim.Optimizer:
    """One optimizer, two parameter groups (backbone, centres), the same weight decay (upstream) and the same lr
    unless backbone_lr_mult scales the backbone's.
    Fused: one kernel updates each group in place, where the default one would allocate a centre-sized
    temporary for the weight decay term. The sampled centres' sparse gradient (build_networks) gets the
    same update as its dense equivalent, in one pass over the centres (training/optimizer.py)."""
    backbone_lr, centres_lr = group_lrs(vars(cfg))
    groups = [{"params": list(backbone.parameters()), "lr": backbone_lr}, {"params": list(pfc.parameters())}]
    if cfg.optimizer == "sgd":
        return RowSparseSGD(groups, lr=centres_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True)
    return RowSparseAdamW(groups, lr=centres_lr, weight_decay=cfg.weight_decay, fused=True)


def build_training_state(cfg: SimpleNamespace, num_classes: int, device: torch.device,
                         steps_per_epoch: int) -> TrainingState:
    """Everything a step needs, single-process (`wrap_for_the_step` makes it distributed)."""
    backbone, pfc = build_networks(cfg, num_classes, device)
    optimizer = build_optimizer(cfg, backbone, pfc)
    scheduler = build_scheduler(optimizer, steps_per_epoch * cfg.warmup_epoch, steps_per_epoch * cfg.num_epoch,
                                cfg.lr_power)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16, growth_interval=100)
    return TrainingState(backbone=backbone, ddp_backbone=backbone, pfc=pfc, optimizer=optimizer,
                         scheduler=scheduler, scaler=scaler, precision=precision(cfg), config=vars(cfg))


def wrap_for_the_step(state: TrainingState, cfg: SimpleNamespace, device: torch.device) -> None:
    """What the step calls: the backbone in DDP when world > 1, compiled when compile_backbone asks."""
    if world() > 1:
        state.ddp_backbone = ddp_backbone(state.backbone, device)
    state.ddp_backbone = compiled_for_the_step(cfg, state.ddp_backbone)


def ddp_backbone(backbone: nn.Module, device: torch.device) -> DistributedDataParallel:
    """The backbone in DistributedDataParallel as training runs it: each rank keeps its own BatchNorm statistics
    (arcface_torch's broadcast_buffers=False)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return ddp_without_buffer_sync(backbone, device_ids)
