"""Semi-siamese training (`sst`: prototype_queue.py, training/semi_siamese.py) against independent references.

- FaceX-Zoo's own SST step, its code read from the fetched repository at run time (never copied here): its
  training_mode/semi-siamese_training/train.py's train_one_epoch (probe/gallery swap, shuffled BN, SGD step,
  momentum update) and head/SST_Prototype.py (queue, labels, AM-Softmax), in float64 on one process, three steps
  (the third wraps the queue), against ours built from the same start. The only edit to their text: `.cuda()`
  calls dropped (this machine has no GPU). Their probe network embeds each view in its own forward, as ours is
  called here; train.py's step embeds both views in one (DESIGN.md), which the runs below cover.
- 2 and 3 processes: the queue's loss, per-view losses, every probe's gradient and the queue after two steps (both
  enqueue modes, ArcFace), and the gallery's shuffled-BN features, against a dense float64 reference written here.
- train.py with sst: a run resumed after every step is the uninterrupted run bit for bit (queue, pointer, gallery
  weights included), and a queue written by 2 processes resumes on 3 and 1 (every slot, pointer, gallery).
"""
from __future__ import annotations

import ast
import copy
import json
import logging
import math
import random
import re
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from backbones import get_model
from checkpoint.pointer import POINTER_NAME
from checkpoint.sharded import restore_state, save_state
from losses import CombinedMarginLoss
from prototype_queue import DRAW_SEED, PrototypeQueue
from tests.distributed_helpers import run_world
from tests.run_helpers import assert_same_run, run_here
from tests.test_train_errors import only_line
from tests.toy_state import INFO, PROGRESS, make_model
from training.components import SavedPosition
from training.semi_siamese import SHUFFLE_SEED, SemiSiamese
from training.state import build_components
from utils.image import normalize

FACEX_ZOO = Path("/work/.mirror/JDAI-CV+FaceX-Zoo/repo")  # the `fetch github:JDAI-CV/FaceX-Zoo` git directory
NO_MIRROR = (f"FaceX-Zoo's git mirror is not at {FACEX_ZOO} (CI runs on the machine that fetched it; elsewhere "
             "fetch github:JDAI-CV/FaceX-Zoo there): the equality with its SST step needs its code")
S, M = 32.0, 0.35  # FaceX-Zoo's head_conf.yaml for SST_Prototype: am_softmax at scale 32, margin 0.35


def facex_source(path: str) -> str:
    """A file of FaceX-Zoo's newest fetched commit, with `.cuda()` calls dropped."""
    text = subprocess.run(["git", "-C", str(FACEX_ZOO), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout
    return re.sub(r"\.cuda\(\)", "", text)


def facex_namespace() -> dict:
    """FaceX-Zoo's SST_Prototype, AverageMeter and train.py's step functions (its imports of datasets,
    tensorboardX and the evaluator left out: only the functions are executed)."""
    namespace: dict = {"__name__": "facex_zoo"}
    exec(compile(facex_source("head/SST_Prototype.py"), "facex_zoo_SST_Prototype.py", "exec"), namespace)
    exec(compile(facex_source("utils/AverageMeter.py"), "facex_zoo_AverageMeter.py", "exec"), namespace)
    train = ast.parse(facex_source("training_mode/semi-siamese_training/train.py"))
    functions = [node for node in train.body if isinstance(node, ast.FunctionDef) and node.name in
                 ("get_lr", "moving_average", "train_BN", "shuffle_BN", "train_one_epoch")]
    namespace.update(torch=torch, logger=logging.getLogger("facex_zoo"))
    exec(compile(ast.Module(body=functions, type_ignores=[]), "facex_zoo_train.py", "exec"), namespace)
    return namespace


def python_seed_drawing(heads: list[bool]) -> int:
    """A seed of Python's `random` whose first draws say `random.random() > 0.5` as `heads` does."""
    generator = random.Random()
    for seed in range(10_000):
        generator.seed(seed)
        if [generator.random() > 0.5 for _ in heads] == heads:
            return seed
    raise AssertionError(f"no seed below 10000 draws {heads}")


@pytest.mark.skipif(not FACEX_ZOO.is_dir(), reason=NO_MIRROR)
def test_three_steps_equal_facex_zoos_sst_steps_in_float64():
    facex = facex_namespace()
    batch, dim, seed, steps, alpha = 4, 16, 5, 3, 0.9
    queue_size = 2 * batch  # the third step's slots wrap to the start
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        backbone = get_model("r18", num_features=dim, width_mult=0.0625)
        probe_net, gallery_net = copy.deepcopy(backbone), copy.deepcopy(backbone)
        sst = SemiSiamese(backbone, PrototypeQueue(CombinedMarginLoss(S, 1.0, 0.0, M), dim, queue_size, seed), alpha)
        prototype = facex["SST_Prototype"](feat_dim=dim, queue_size=queue_size, scale=S, loss_type="am_softmax",
                                           margin=M)
    finally:
        torch.set_default_dtype(previous)
    prototype.queue = sst.queue.queue.t().clone()  # the same start: our seeded queue
    facex["moving_average"](probe_net, gallery_net, 0)
    probe_net.train()
    gallery_net.eval().apply(facex["train_BN"])
    sgd = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}  # their train.py's optimizer
    theirs_sgd, ours_sgd = torch.optim.SGD(probe_net.parameters(), **sgd), torch.optim.SGD(backbone.parameters(), **sgd)
    conf = SimpleNamespace(alpha=alpha, print_freq=1000, writer=SimpleNamespace(add_scalar=lambda *args: None),
                           save_freq=1000, epoches=1000, out_dir=None)
    images = torch.randint(0, 256, (steps, batch, 2, 3, 112, 112), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    labels = torch.arange(batch)
    heads = [torch.rand((), generator=torch.Generator().manual_seed(seed * DRAW_SEED + step)).item() > 0.5
             for step in range(steps)]  # which view our queue enqueues each step: prototype_queue.py's draw
    random.seed(python_seed_drawing(heads))
    backbone.train()
    for step in range(steps):
        views = normalize(images[step]).double()
        meter = facex["AverageMeter"]()
        facex["train_one_epoch"]([(views[:, 0], views[:, 1], labels)], probe_net, gallery_net, prototype,
                                 theirs_sgd, nn.CrossEntropyLoss(), step + 1, conf, meter)
        probes = [backbone(views[:, view]) for view in range(2)]
        loss, per_view = sst.loss(probes, images[step], labels, pfc=None)
        ours_sgd.zero_grad()
        loss.backward()
        ours_sgd.step()
        sst.after_step()
        assert loss.item() == pytest.approx(meter.avg, rel=1e-10), step
        assert per_view.mean().item() == pytest.approx(meter.avg, rel=1e-10)
        assert sst.queue.pointer == prototype.index
        torch.testing.assert_close(sst.queue.queue, prototype.queue.t(), rtol=1e-9, atol=1e-12)
    for ours, facex_net in ((backbone, probe_net), (sst.gallery, gallery_net)):
        for (name, mine), their in zip(ours.state_dict().items(), facex_net.state_dict().values(), strict=True):
            torch.testing.assert_close(mine, their, rtol=1e-9, atol=1e-12, msg=lambda text, name=name: f"{name}: {text}")
    assert not torch.equal(sst.gallery.state_dict()["fc.weight"], backbone.state_dict()["fc.weight"])
