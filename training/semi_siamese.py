"""Semi-Siamese Training (config key `sst`): the gallery network and the prototype queue as one component.

The gallery network is a momentum copy of the backbone (the probe network): it starts as the backbone the first
step finds (a fresh start's, or the one a bare backbone.pth or a checkpoint trained without SST put there), and after
every optimizer step taken each parameter moves ``gallery <- m * gallery + (1 - m) * probe`` (`sst_momentum`,
FaceX-Zoo's alpha; no warm-up, unlike the EMA of training/ema.py, which averages for export). It runs without
gradient, in eval mode but for its BatchNorm layers, which normalise with the statistics of their batch (MoCo's
and FaceX-Zoo's gallery). That batch is shuffled across the global batch ("shuffled BN", MoCo): every rank
gathers every rank's images, all draw one permutation from the seed and the step, and each embeds its slice of
the permuted batch: a sample's gallery feature is normalised with the statistics of other samples than its probe
feature, so that batch statistics cannot carry the positive's identity (MoCo's guard). On one process the shuffle
is within the batch, as FaceX-Zoo's draws it (its DataParallel then splits the batch over the GPUs). The features
of the whole global batch come back to every rank in the batch's order: the prototype queue (prototype_queue.py)
enqueues them all.

The loss: the queue's, or with `sst_centre_weight` w > 0, ``(1 - w) * queue loss + w * class-centre loss``.

In a checkpoint: the queue as row blocks of the (sst_queue_size, D) matrix (so a resume on another number of
processes reads its slots from whichever files hold them), the gallery's parameters and BatchNorm statistics
(one rank's: the gallery never uses its running statistics, it normalises with its batch's), and the pointer, the
draw position and the margin state as JSON.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from partial_fc import PartialFC
from prototype_queue import PrototypeQueue
from training.components import Component
from training.fields import field, integer, json_list, json_object, number
from utils.compat import all_gather_into, row_block
from utils.distributed import is_initialized, rank, world
from utils.errors import ConfigError
from utils.image import normalize

log = logging.getLogger(__name__)

SHUFFLE_SEED = 104_729  # keeps the BatchNorm shuffles apart from the other streams of the same seed
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class SemiSiamese(Component):
    keys = ("sst_queue", "sst_gallery", "sst_position")
    tensor_keys = ("sst_queue", "sst_gallery")

    def __init__(self, backbone: nn.Module, queue: PrototypeQueue, momentum: float, centre_weight: float = 0.0):
        self.backbone, self.queue, self.momentum, self.centre_weight = backbone, queue, momentum, centre_weight
        self.gallery = copy.deepcopy(backbone).requires_grad_(False).eval()
        self.shuffles = torch.Generator()  # the BatchNorm shuffles' stream, seeded as each step begins
        self.started = False  # whether the gallery holds this run's weights (a checkpoint's, or those followed so far)
        for module in self.gallery.modules():
            if isinstance(module, BATCH_NORMS):
                module.train()

    @classmethod
    def build(cls, state, config: Mapping) -> SemiSiamese | None:
        if not config.get("sst"):
            return None
        if config["freeze_backbone_steps"] and not config["sst_centre_weight"]:
            raise ConfigError("config key 'freeze_backbone_steps' leaves semi-siamese training nothing to train (its "
                              "queue has no weights); set sst_centre_weight above 0 or freeze_backbone_steps=0")
        pfc: PartialFC = state.pfc
        queue = PrototypeQueue(pfc.margin_loss, pfc.embedding_size, config["sst_queue_size"], pfc.seed,
                               config["view_weights"], config["sst_enqueue"], config["compile_margin_softmax"])
        written = queue.slots_per_step(config["batch_size"]) * config["gradient_acc"]
        if written > queue.queue_size:  # before any step: every rank says it alike
            raise ConfigError(f"config key 'sst_queue_size' ({queue.queue_size}) is smaller than the {written} gallery "
                              f"features a step of {world()} process(es) enqueues; raise it to at least that (a "
                              "multiple of it keeps FaceX-Zoo's layout), or run fewer processes")
        return cls(state.backbone, queue.to(pfc.weight.device), config["sst_momentum"], config["sst_centre_weight"])

    def loss(self, probes: Sequence[torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
             pfc: PartialFC) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, each view's queue cross-entropy, detached) of this rank's probe features of both views, given
        the records they came from, (B, 2, 3, H, W) uint8. Collective."""
        if not self.started:  # the parameters alone, as FaceX-Zoo's start (its running statistics go unused)
            torch._foreach_copy_(*self._parameters())
            self.started = True
        loss, per_view = self.queue(probes, self.gallery_features(images))
        if self.centre_weight:
            centre_loss, _ = pfc(probes, labels)
            loss = (1.0 - self.centre_weight) * loss + self.centre_weight * centre_loss
        return loss, per_view

    def gallery_features(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Each view's gallery features of the global batch (N, D), ordered (rank, sample), the same on every rank,
        from this rank's records (B, V, 3, H, W) uint8, through shuffled BatchNorm. Collective."""
        batch = images.shape[0]
        everyone = _gathered(images)
        if not self.queue.pending:  # the step's first forward: its shuffles drawn from the seed and the step
            self.shuffles = torch.Generator().manual_seed(self.queue.seed * SHUFFLE_SEED + self.queue.step)
        generator = self.shuffles
        dtype = next(self.gallery.parameters()).dtype
        features = []
        with torch.no_grad():
            # The last view first, as FaceX-Zoo's step embeds them: the order in which the BatchNorm running
            # statistics move (which the gallery never uses: it normalises with its batch's)
            for view in reversed(range(images.shape[1])):
                order = torch.randperm(everyone.shape[0], generator=generator).to(images.device)
                mine = order[rank() * batch:(rank() + 1) * batch]
                shuffled = _gathered(self.gallery(normalize(everyone[mine, view]).to(dtype)))
                features.insert(0, torch.empty_like(shuffled).index_copy_(0, order, shuffled))
        return features

    def before_step(self) -> None:
        self.queue.discard()

    def after_step(self) -> None:
        self.queue.commit()
        with torch.no_grad():
            torch._foreach_lerp_(*self._parameters(), 1.0 - self.momentum)  # gallery + (1 - m) * (probe - gallery)

    def state_dict(self) -> dict:
        return {"sst_queue": self.queue.queue, "sst_gallery": self._gallery_tensors(),
                "sst_position": self.queue.position_dict()}

    def shard(self, path: tuple[str, ...], tensor: torch.Tensor) -> torch.Tensor:
        return self._queue_block(tensor) if path[0] == "sst_queue" else tensor

    def template(self, saved: Mapping[str, tuple]) -> dict:
        """The queue's rows and the gallery's tensors, loaded in place (absent from a checkpoint without SST)."""
        present = {fqn.split(".", 1)[0] for fqn in saved}
        both = {"sst_queue": self._queue_block(self.queue.queue), "sst_gallery": self._gallery_tensors()}
        return {key: value for key, value in both.items() if key in present}

    def load_state_dict(self, saved: Mapping) -> None:
        """DCP loaded the queue and the gallery in place; a checkpoint without them (trained without SST) leaves
        the gallery to start from the backbone it holds at the first step, and the queue afresh."""
        if "sst_gallery" not in saved:
            log.info("the checkpoint holds no semi-siamese state (sst was off): the gallery network starts as its "
                     "backbone, the prototype queue afresh")
            return
        self.queue.load_position_dict(saved["sst_position"])
        self.started = True

    @classmethod
    def check(cls, section: Mapping, where: str) -> None:
        if "sst_position" not in section:
            return
        at = f"{where}.sst_position"
        position = json_object(section["sst_position"], at)
        for key in ("pointer", "step", "margin_step"):
            integer(field(position, key, at), f"{at}.{key}", low=0)
        for index, value in enumerate(json_list(field(position, "margin_state", at), f"{at}.margin_state")):
            number(value, f"{at}.margin_state[{index}]")

    def _parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the gallery's parameters, the backbone's), detached, in the same order."""
        return [p.detach() for p in self.gallery.parameters()], [p.detach() for p in self.backbone.parameters()]

    def _gallery_tensors(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self.gallery.state_dict(keep_vars=True).items()}

    def _queue_block(self, rows: torch.Tensor) -> torch.Tensor:
        return row_block(rows, self.queue.queue_size, self.queue.slot_start)


def semi_siamese(state) -> SemiSiamese | None:
    """The run's semi-siamese component, None where `sst` is off."""
    return next((component for component in state.components if isinstance(component, SemiSiamese)), None)


def _gathered(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's rows in rank order (no gradient)."""
    if not is_initialized():
        return rows
    out = rows.new_empty((rows.shape[0] * world(), *rows.shape[1:]))
    all_gather_into(out, rows.contiguous())
    return out
