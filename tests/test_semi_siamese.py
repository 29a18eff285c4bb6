"""Semi-siamese training (`sst`: prototype_queue.py, training/semi_siamese.py) against independent references.

- FaceX-Zoo's own SST step, its code read from the fetched repository at run time (never copied here): its
  training_mode/semi-siamese_training/train.py's train_one_epoch (probe/gallery swap, shuffled BN, SGD step,
  momentum update) and head/SST_Prototype.py (queue, labels, AM-Softmax), in float64 on one process, three steps
  (the third wraps the queue), against ours from the same start. The only edit to their text: `.cuda()` calls
  dropped (this machine has no GPU). Twice: r18 with BatchNorm, its probe embedding each view in its own forward as
  theirs does (the gallery's shuffled BatchNorm, the queue and the momentum update are ours); and train.py's whole
  step (both views through the backbone in one batch, as DESIGN.md has it) with a network without BatchNorm, for
  which the two are the same function.
- 2 and 3 processes: the queue's loss, per-view losses, every probe's gradient and the queue after two steps (both
  enqueue modes, ArcFace), and the gallery's shuffled-BN features, against a dense float64 reference written here.
- a skipped step (non-finite loss) enqueues nothing and leaves the gallery as it was.
- train.py with sst: a run stopped after 2 steps and resumed for a third is the uninterrupted run bit for bit
  (queue, pointer, gallery weights included), and a queue written by 2 processes resumes on 3 and 1 (every slot,
  pointer, gallery). The dry run plans rank 0's slots and the gallery; a wrong sst key is one error line.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import json
import logging
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

import train
from backbones import get_model
from checkpoint.pointer import POINTER_NAME
from checkpoint.sharded import restore_state, save_state
from losses import CombinedMarginLoss
from partial_fc import PartialFC
from prototype_queue import DRAW_SEED, PrototypeQueue
from tests.distributed_helpers import run_world
from tests.run_helpers import assert_same_run, run_here
from tests.test_train_errors import only_line
from tests.toy_state import INFO, PROGRESS, make_model
from training.components import SavedPosition
from training.semi_siamese import SHUFFLE_SEED, SemiSiamese, semi_siamese
from training.state import TrainingState, build_components, build_optimizer
from training.step import StepOutcome, train_step
from utils.errors import ConfigError
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


FACEX_BATCH, FACEX_DIM, FACEX_SEED, FACEX_STEPS, ALPHA = 4, 16, 5, 3, 0.9
FACEX_QUEUE = 2 * FACEX_BATCH  # the third step's slots wrap to the start
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}  # FaceX-Zoo's train.py's optimizer


class FaceXZoo:
    """FaceX-Zoo's SST training from `backbone`'s weights and the queue `start` (D, Q), one train_one_epoch per step
    (its loss logged by its AverageMeter), the view it enqueues drawn by Python's `random` as `heads` says."""

    def __init__(self, backbone: nn.Module, start: torch.Tensor, heads: list[bool]):
        self.code = facex_namespace()
        self.probe, self.gallery = copy.deepcopy(backbone), copy.deepcopy(backbone)
        self.prototype = self.code["SST_Prototype"](feat_dim=FACEX_DIM, queue_size=FACEX_QUEUE, scale=S,
                                                    loss_type="am_softmax", margin=M)
        self.prototype.queue = start.t().clone()
        self.code["moving_average"](self.probe, self.gallery, 0)
        self.probe.train()
        self.gallery.eval().apply(self.code["train_BN"])
        self.optimizer = torch.optim.SGD(self.probe.parameters(), **SGD)
        self.conf = SimpleNamespace(alpha=ALPHA, print_freq=1000, writer=SimpleNamespace(add_scalar=lambda *a: None),
                                    save_freq=1000, epoches=1000, out_dir=None)
        random.seed(python_seed_drawing(heads))

    def step(self, number: int, images: torch.Tensor, labels: torch.Tensor) -> float:
        views = normalize(images).double()
        meter = self.code["AverageMeter"]()
        self.code["train_one_epoch"]([(views[:, 0], views[:, 1], labels)], self.probe, self.gallery, self.prototype,
                                     self.optimizer, nn.CrossEntropyLoss(), number + 1, self.conf, meter)
        return meter.avg


def facex_inputs() -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """Each step's records (uint8), the labels, and which view our queue enqueues each step (prototype_queue.py's
    draw from the seed and the step)."""
    images = torch.randint(0, 256, (FACEX_STEPS, FACEX_BATCH, 2, 3, 112, 112), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    heads = [torch.rand((), generator=torch.Generator().manual_seed(FACEX_SEED * DRAW_SEED + step)).item() > 0.5
             for step in range(FACEX_STEPS)]
    return images, torch.arange(FACEX_BATCH), heads


def assert_same_as_facex(ours: SemiSiamese, theirs: FaceXZoo) -> None:
    """The pointer, every slot, and the probe's and the gallery's every tensor."""
    assert ours.queue.pointer == theirs.prototype.index
    torch.testing.assert_close(ours.queue.queue, theirs.prototype.queue.t(), rtol=1e-9, atol=1e-12)
    for mine, facex_net in ((ours.backbone, theirs.probe), (ours.gallery, theirs.gallery)):
        for (name, value), their in zip(mine.state_dict().items(), facex_net.state_dict().values(), strict=True):
            torch.testing.assert_close(value, their, rtol=1e-9, atol=1e-12,
                                       msg=lambda text, name=name: f"{name}: {text}")


@contextlib.contextmanager
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.skipif(not FACEX_ZOO.is_dir(), reason=NO_MIRROR)
def test_three_steps_of_the_r18_probe_gallery_and_queue_equal_facex_zoos_in_float64():
    """r18 with BatchNorm: the probe embeds each view in its own forward here, as FaceX-Zoo's does; the gallery's
    shuffled BatchNorm, the swap, the queue and the momentum update are ours."""
    images, labels, heads = facex_inputs()
    with float64_default():
        torch.manual_seed(0)
        backbone = get_model("r18", num_features=FACEX_DIM, width_mult=0.0625)
        sst = SemiSiamese(backbone, PrototypeQueue(CombinedMarginLoss(S, 1.0, 0.0, M), FACEX_DIM, FACEX_QUEUE,
                                                   FACEX_SEED), ALPHA)
    theirs = FaceXZoo(backbone, sst.queue.queue, heads)
    optimizer = torch.optim.SGD(backbone.parameters(), **SGD)
    backbone.train()
    for step in range(FACEX_STEPS):
        expected = theirs.step(step, images[step], labels)
        views = normalize(images[step]).double()
        loss, per_view = sst.loss([backbone(views[:, view]) for view in range(2)], images[step], labels, pfc=None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sst.after_step()
        assert loss.item() == pytest.approx(expected, rel=1e-10), step
        assert per_view.mean().item() == pytest.approx(expected, rel=1e-10)
    assert_same_as_facex(sst, theirs)
    assert not torch.equal(sst.gallery.state_dict()["fc.weight"], backbone.state_dict()["fc.weight"])


class Float64(nn.Module):
    """The step's float32 images in float64."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.double()


@pytest.mark.skipif(not FACEX_ZOO.is_dir(), reason=NO_MIRROR)
def test_three_of_train_steps_equal_facex_zoos_sst_steps_in_float64():
    """train.py's step (training/step.py: both views through the backbone in one batch, the SST loss, the optimizer
    train.py builds, the commit and the momentum update) with a network without BatchNorm, for which one batch and
    FaceX-Zoo's forward per view are the same function."""
    images, labels, heads = facex_inputs()
    state = linear_sst_state()
    sst = semi_siamese(state)
    theirs = FaceXZoo(state.backbone, sst.queue.queue, heads)
    for step in range(FACEX_STEPS):
        expected = theirs.step(step, images[step], labels)
        losses, outcome = train_step(state, [(images[step], labels)], STEP)
        assert outcome == StepOutcome.TAKEN and losses[0].item() == pytest.approx(expected, rel=1e-10), step
    assert_same_as_facex(sst, theirs)
    assert state.pfc.weight.grad is None  # the queue alone: the centres are out of the step


# What train_step reads of the config.
STEP = SimpleNamespace(max_grad_norm=1e9, freeze_backbone=False, freeze_backbone_steps=0)


def linear_sst_state() -> TrainingState:
    """A float64 training state with SST as FaceX-Zoo's train.sh sets it, over a network without BatchNorm."""
    with float64_default():
        torch.manual_seed(0)
        backbone = nn.Sequential(Float64(), nn.Flatten(), nn.Linear(3 * 112 * 112, FACEX_DIM))
        pfc = PartialFC(CombinedMarginLoss(S, 1.0, 0.0, M), FACEX_DIM, FACEX_BATCH, seed=FACEX_SEED)
        optimizer = build_optimizer(SimpleNamespace(lr=SGD["lr"], backbone_lr_mult=1.0, optimizer="sgd",
                                                    momentum=SGD["momentum"], weight_decay=SGD["weight_decay"]),
                                    backbone, pfc)
        state = TrainingState(backbone=backbone, ddp_backbone=backbone, pfc=pfc, optimizer=optimizer,
                              scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                              scaler=torch.amp.GradScaler("cpu", enabled=False), precision=None)
        state.components = build_components(state, {**SST_CONFIG, "sst_queue_size": FACEX_QUEUE, "sst_enqueue": "one",
                                                    "batch_size": FACEX_BATCH, "sst_momentum": ALPHA})
    return state


def test_a_skipped_step_enqueues_nothing_and_leaves_the_gallery_as_it_was():
    images, labels, _ = facex_inputs()
    state = linear_sst_state()
    sst = semi_siamese(state)
    assert train_step(state, [(images[0], labels)], STEP)[1] == StepOutcome.TAKEN
    queue, pointer, gallery = sst.queue.queue.clone(), sst.queue.pointer, copy.deepcopy(sst.gallery.state_dict())
    with torch.no_grad():
        state.backbone[2].weight[0, 0] = torch.nan  # every probe feature NaN: a non-finite loss
    assert train_step(state, [(images[1], labels)], STEP)[1] == StepOutcome.LOSS_NONFINITE
    assert torch.equal(sst.queue.queue, queue) and sst.queue.pointer == pointer and sst.queue.step == 1
    assert all(torch.equal(value, gallery[name]) for name, value in sst.gallery.state_dict().items())
    state.before_step()  # the next step forgets the skipped step's gallery features
    assert sst.queue.pending == []


# --- 2 and 3 processes against a dense float64 reference -------------------------------------------------------

BATCH, DIM, QUEUE, SEED, ARC_S, ARC_M = 2, 8, 13, 3, 16.0, 0.5  # 13 slots: uneven over 2 and 3 ranks; slots wrap
STEPS, IMAGE = 2, 4  # 4 x 4 images through a linear gallery with BatchNorm


def step_inputs(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch's probes (N, 2, D) and both views' gallery features (2, N, D) near them: every rank
    takes its rows of the same draw."""
    generator = torch.Generator().manual_seed(100 + step)
    probes = torch.randn(BATCH * world_size, 2, DIM, generator=generator, dtype=torch.float64)
    return probes, probes.flip(1).transpose(0, 1) + 0.3 * torch.randn(2, BATCH * world_size, DIM,
                                                                      generator=generator, dtype=torch.float64)


def tiny_gallery() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * IMAGE * IMAGE, DIM), nn.BatchNorm1d(DIM)).double()


def records(world_size: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH * world_size, 2, 3, IMAGE, IMAGE), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(9))


def _queue_in_world(rank: int, world_size: int) -> dict:
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    out: dict = {}
    for enqueue in ("one", "both"):
        queue = PrototypeQueue(CombinedMarginLoss(ARC_S, 1.0, ARC_M, 0.0), DIM, QUEUE, SEED, enqueue=enqueue).double()
        steps = [{"queue": queue.queue.clone()}]
        for step in range(STEPS):
            probes, galleries = step_inputs(step, world_size)
            local = probes[mine].clone().requires_grad_(True)
            loss, per_view = queue(local.unbind(1), galleries.unbind(0))
            loss.backward()
            queue.commit()
            steps.append({"loss": loss.detach(), "per_view": per_view, "grad": local.grad,
                          "queue": queue.queue.clone(), "pointer": queue.pointer})
        out[enqueue] = steps
    torch.manual_seed(0)
    sst = SemiSiamese(tiny_gallery(), PrototypeQueue(CombinedMarginLoss(), DIM, QUEUE, SEED), 0.9)
    out["gallery"] = {"features": sst.gallery_features(records(world_size)[mine]),
                      "state": copy.deepcopy(sst.backbone.state_dict())}
    return out


@pytest.fixture(scope="module", params=[2, 3])
def world(request) -> tuple[int, list]:
    return request.param, run_world(_queue_in_world, request.param)


def reference_steps(initial: torch.Tensor, enqueue: str, world_size: int) -> list[dict]:
    """The queue's loss, per-view losses, probe gradients and queue after each step, densely: the whole queue in
    one matrix, ArcFace's cos(theta + m) written out, autograd for the gradients."""
    queue, pointer, n = initial.clone(), 0, BATCH * world_size
    steps = []
    for step in range(STEPS):
        probes, galleries = step_inputs(step, world_size)
        probes.requires_grad_(True)
        gallery = nn.functional.normalize(galleries, dim=-1)
        slots = [(pointer + j) % QUEUE for j in range(n)]
        losses = []
        for view in range(2):
            keys = queue.clone()
            keys[slots] = gallery[1 - view]  # the other view's gallery at the step's slots: each sample's target
            # cosines: the queue's rows are unit vectors up to their float32 start's rounding
            cos = nn.functional.normalize(probes[:, view], dim=-1) @ nn.functional.normalize(keys, dim=-1).t()
            target = torch.cos(torch.acos(cos[range(n), slots]) + ARC_M)
            logits = (ARC_S * cos).index_put((torch.arange(n), torch.tensor(slots)), ARC_S * target)
            losses.append(nn.functional.cross_entropy(logits, torch.tensor(slots)))
        loss = (losses[0] + losses[1]) / 2
        (grad,) = torch.autograd.grad(loss, probes)
        heads = torch.rand((), generator=torch.Generator().manual_seed(SEED * DRAW_SEED + step)).item() > 0.5
        for features in (gallery if enqueue == "both" else [gallery[0] if heads else gallery[1]]):
            queue[[(pointer + j) % QUEUE for j in range(n)]] = features
            pointer = (pointer + n) % QUEUE
        steps.append({"loss": loss.detach(), "per_view": torch.stack(losses).detach(), "grad": grad,
                      "queue": queue.clone(), "pointer": pointer})
    return steps


def test_the_queue_on_several_processes_equals_a_dense_float64_reference(world):
    world_size, ranks = world
    for enqueue in ("one", "both"):
        initial = torch.cat([rank[enqueue][0]["queue"] for rank in ranks])
        assert initial.shape == (QUEUE, DIM)
        for step, expected in enumerate(reference_steps(initial, enqueue, world_size), start=1):
            ours = [rank[enqueue][step] for rank in ranks]
            where = f"{enqueue}, step {step}"
            for rank, mine in enumerate(ours):
                torch.testing.assert_close(mine["loss"], expected["loss"], rtol=1e-12, atol=0, msg=where)
                torch.testing.assert_close(mine["per_view"], expected["per_view"], rtol=1e-12, atol=0, msg=where)
                # The all-gather's backward scales by the world size, which DDP's average of the backbone's
                # gradients undoes (partial_fc.py)
                torch.testing.assert_close(mine["grad"] / world_size, expected["grad"][rank * BATCH:(rank + 1) * BATCH],
                                           rtol=1e-10, atol=1e-14, msg=where)
                assert mine["pointer"] == expected["pointer"], where
            torch.testing.assert_close(torch.cat([mine["queue"] for mine in ours]), expected["queue"], rtol=1e-12,
                                       atol=1e-15, msg=where)


def test_the_initial_queue_is_the_same_on_any_number_of_processes(world):
    world_size, ranks = world
    alone = PrototypeQueue(CombinedMarginLoss(), DIM, QUEUE, SEED).double().queue
    assert torch.equal(torch.cat([rank["one"][0]["queue"] for rank in ranks]), alone)
    torch.testing.assert_close(alone.norm(dim=1), torch.ones(QUEUE, dtype=torch.float64))


def test_the_gallery_embeds_the_global_batch_shuffled_across_processes(world):
    """Each rank's BatchNorm batch is its slice of one permutation of the global batch (drawn from the seed and the
    step): the reference embeds each slice in its own forward and puts the rows back in the batch's order."""
    world_size, ranks = world
    net = tiny_gallery()
    net.load_state_dict(ranks[0]["gallery"]["state"])
    images = records(world_size)
    generator = torch.Generator().manual_seed(SEED * SHUFFLE_SEED)
    expected = [None, None]
    for view in (1, 0):  # the last view first, as FaceX-Zoo's step
        order = torch.randperm(BATCH * world_size, generator=generator)
        features = torch.empty(BATCH * world_size, DIM, dtype=torch.float64)
        for rank in range(world_size):
            rows = order[rank * BATCH:(rank + 1) * BATCH]
            features[rows] = net(normalize(images[rows, view]).double()).detach()
        expected[view] = features
    for rank in ranks:
        for view in range(2):
            torch.testing.assert_close(rank["gallery"]["features"][view], expected[view], rtol=1e-12, atol=1e-14)
    assert not torch.allclose(expected[0], net(normalize(images[:, 0]).double()).detach())  # one batch: not that


# --- checkpoints: resume bit for bit, reshard 2 -> 3 and 1 ------------------------------------------------------

SST_SETS = ["sst=True", "sst_queue_size=12", "sst_centre_weight=0.25", "sst_momentum=0.5"]


def sst_state(run: Path) -> dict:
    """The queue (all slots), the gallery's tensors and the position of a run's published checkpoint."""
    folder = run / json.loads((run / POINTER_NAME).read_text())["directory"]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, f"{tmp}/whole.pt")
        whole = torch.load(f"{tmp}/whole.pt", weights_only=True)
    return {"queue": whole["sst_queue"], "gallery": whole["sst_gallery"],
            "position": json.loads((folder / "state.json").read_text())["run"]["sst_position"]}


def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(data, tmp_path):
    assert run_here(data, tmp_path / "whole", *SST_SETS, "max_steps=3") == (0, "")
    assert run_here(data, tmp_path / "split", *SST_SETS, "max_steps=2") == (0, "")
    assert run_here(data, tmp_path / "split", *SST_SETS, "max_steps=3", resume=True) == (0, "")
    assert_same_run(tmp_path / "split", tmp_path / "whole")
    split, whole = sst_state(tmp_path / "split"), sst_state(tmp_path / "whole")
    assert whole["position"]["pointer"] == 3 * 4 % 12 and whole["position"]["step"] == 3
    assert split["position"] == whole["position"]
    assert torch.equal(split["queue"], whole["queue"])
    assert split["gallery"].keys() == whole["gallery"].keys()
    assert all(torch.equal(split["gallery"][name], whole["gallery"][name]) for name in whole["gallery"])


SST_CONFIG = {"sst": True, "freeze_backbone_steps": 0, "batch_size": 2, "gradient_acc": 1, "sst_centre_weight": 0.0,
              "sst_queue_size": 17, "view_weights": None, "sst_enqueue": "both", "compile_margin_softmax": False,
              "sst_momentum": 0.9}


def toy_with_queue(seed: int) -> tuple[SimpleNamespace, SemiSiamese]:
    model = make_model("sgd", seed=seed)
    model.components = build_components(model, SST_CONFIG)
    return model, model.components[-1]


def _save_queue(rank: int, world_size: int, folder: str) -> dict:
    model, sst = toy_with_queue(seed=1)
    for step in range(2):  # 2 steps x 2 micro-batches x 2 views x 4 features through 17 slots: they wrap
        probes, galleries = (torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(step)) for _ in range(2))
        sst.queue(probes.unbind(0), galleries.repeat(1, world_size, 1).unbind(0))
        sst.queue(probes.unbind(0), galleries.repeat(1, world_size, 1).unbind(0))  # a second micro-batch
        sst.gallery(torch.randn(5, 4))  # BatchNorm statistics move
        model.backbone[0].weight.data += 1.0
        sst.after_step()
    save_state(folder, model, PROGRESS, SavedPosition({"skipped": rank}), INFO, {"lr": 0.1})
    return {"queue": sst.queue.queue.clone(), "gallery": copy.deepcopy(sst.gallery.state_dict()),
            "position": sst.queue.position_dict()}


def _restore_queue(rank: int, world_size: int, folder: str) -> dict:
    model, sst = toy_with_queue(seed=2)  # another queue and gallery: everything must come from the checkpoint
    restore_state(Path(folder) / POINTER_NAME, INFO, model)
    return {"queue": sst.queue.queue.clone(), "gallery": sst.gallery.state_dict(),
            "position": sst.queue.position_dict()}


def test_a_queue_written_by_two_processes_resumes_on_three_and_one(tmp_path):
    saved = run_world(_save_queue, 2, str(tmp_path))
    assert [rank["queue"].shape[0] for rank in saved] == [9, 8]
    whole = torch.cat([rank["queue"] for rank in saved])
    for restored in (run_world(_restore_queue, 3, str(tmp_path)), [_restore_queue(0, 1, str(tmp_path))]):
        assert torch.equal(torch.cat([rank["queue"] for rank in restored]), whole)
        for rank in restored:
            assert rank["position"] == saved[0]["position"] and rank["position"]["pointer"] == 32 % 17
            assert all(torch.equal(rank["gallery"][name], value) for name, value in saved[0]["gallery"].items())


@pytest.mark.parametrize(("sets", "message"), [
    (["num_views=1"], "config key 'sst' needs two views per record (a probe and a gallery photo of each identity), "
                      "not num_views=1; set num_views=2"),
    (["sst_queue_size=3"], "config key 'sst_queue_size' (3) is smaller than the 4 gallery features a step of one "
                           "process enqueues; raise it (FaceX-Zoo: 16384)"),
    (["sst_momentum=1.0"], "config key 'sst_momentum' must be in [0, 1), not 1.0; e.g. sst_momentum=0.999"),
])
def test_a_wrong_sst_key_is_one_error_line_naming_it(data, tmp_path, sets, message):
    status, stderr = run_here(data, tmp_path / "run", "sst=True", *sets)
    assert status == 1 and only_line(stderr) == f"error: {message}"


def test_the_dry_run_plans_rank_0s_queue_slots_and_a_whole_gallery_network(capsys):
    """400 slots over 3 processes: rank 0 holds 134; the gallery is the backbone's parameters and buffers."""
    status = train.main(["configs/lfw_r18_sst.py", "--dry-run", "--json", "--world-size", "3",
                         "--set", "num_classes=50", "--set", "sst_queue_size=400"])
    memory = json.loads(capsys.readouterr().out)["memory"]
    backbone = get_model("r18", num_features=128, width_mult=0.125)
    assert status == 0 and memory["prototype_queue"] == 134 * 128 * 4
    assert memory["gallery_network"] == sum(t.numel() * t.element_size() for t in backbone.state_dict().values())
    assert memory["queue_logits"] > 2 * 134 * 128 * 4  # both views' copies of the slots, and more


def _too_small_a_queue(rank: int, world_size: int) -> str:
    model = make_model("sgd")
    with pytest.raises(ConfigError) as error:
        build_components(model, {**SST_CONFIG, "batch_size": 4, "gradient_acc": 1, "sst_queue_size": 15})
    return str(error.value)


def test_a_queue_smaller_than_what_a_step_of_every_process_enqueues_stops_every_rank_before_a_step():
    assert run_world(_too_small_a_queue, 2) == [
        "config key 'sst_queue_size' (15) is smaller than the 16 gallery features a step of 2 process(es) enqueues; "
        "raise it to at least that (a multiple of it keeps FaceX-Zoo's layout), or run fewer processes"] * 2
