"""The margin families through PartialFC: sub-center ArcFace, AdaFace, CurricularFace, ElasticFace (Arc, Cos, +).

Each family is compared, over 3 steps in a row (its state carried from step to step), with a dense
single-process float64 reference written below from the paper's formula, sharing no code with
losses.py or partial_fc.py: the loss, the gradient of every backbone parameter (so of every view's
embeddings) after DDP's averaging, every centre's gradient, and the family's state after each step. On
1 process without a process group and with a gloo group of one (this process: no spawn), and on 2 gloo
processes (7 classes: shards of 4 and 3), V = 1..3, sampling off and on. All 2-process facts come from
one spawn (a module fixture): starting processes costs more than every check together.

Then, on one process, each family against a re-derivation of its authors' public head (written here from
reading their code: the AdaFace, CurricularFace and ElasticFace repositories, insightface's sub-center
symbol), as a second, independent reference; and the family's state through a checkpoint written on 2
processes and restored on 1, bit for bit.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from checkpoint.pointer import POINTER_NAME
from checkpoint.sharded import restore_state, save_state
from losses import AdaFaceMargin, CombinedMarginLoss, CurricularMargin, ElasticMargin, GlobalRows, Margin, MarginFamily
from partial_fc import PartialFC, initial_centres
from tests.distributed_helpers import run_world
from tests.test_partial_fc import assert_float64_close
from tools.check_pfc import make_backbone
from training.components import SavedPosition
from training.state import build_components
from utils import distributed
from utils.lr_scheduler import build_scheduler

S = 64.0
IN_FEATURES, EMBEDDING = 32, 16
STEPS = 3
# Fast EMAs (the papers use 0.01): after 3 steps the state is far from where it started, and matters.
FAMILIES = {
    "subcenter": dict(make=lambda: CombinedMarginLoss(S, 1.0, 0.5, 0.0), k=3),
    "adaface": dict(make=lambda: AdaFaceMargin(S, m=0.4, h=0.333, t_alpha=0.7), k=1),
    "curricular": dict(make=lambda: CurricularMargin(S, m=0.5, alpha=0.7), k=1),
    "elastic_arc": dict(make=lambda: ElasticMargin(S, "arc", m=0.5, std=0.1), k=1),
    "elastic_cos": dict(make=lambda: ElasticMargin(S, "cos", m=0.35, std=0.1), k=1),
    "elastic_arc_plus": dict(make=lambda: ElasticMargin(S, "arc", m=0.5, std=0.1, plus=True), k=1),
    "elastic_cos_plus": dict(make=lambda: ElasticMargin(S, "cos", m=0.35, std=0.1, plus=True), k=1),
}
SETTINGS = {"exact": (7, 1.0), "sampled": (41, 0.3)}  # (num_classes, sample_rate)
CASES = [(name, views, setting) for name in FAMILIES for views in (1, 2, 3) for setting in SETTINGS]


# --- the dense references, from the papers ---------------------------------------------------------

def elastic_draws(seed: int, step: int, samples: int, views: int, m: float, std: float) -> torch.Tensor:
    """ElasticFace's documented stream: G * V float32 normals from a CPU generator seeded with
    seed * 1_000_003 + step, sample g's view v taking draw g * V + v; (G, V)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return (torch.randn(samples * views, generator=generator) * std + m).view(samples, views).double()


def dense_family_loss(name: str, raw: torch.Tensor, labels: torch.Tensor, centres: torch.Tensor, state: list,
                      step: int, seed: int, k: int) -> tuple[torch.Tensor, list]:
    """(loss, state after this step): raw features (G, V, D) before normalisation, centres (C*K, D) with class
    c's sub-centres at rows c*K .. c*K + K - 1, the family's state before the step."""
    family = FAMILIES[name]["make"]()
    samples, views, _ = raw.shape
    unit = raw / raw.norm(dim=-1, keepdim=True)
    unit_centres = centres / centres.norm(dim=1, keepdim=True)
    cos = torch.einsum("gvd,cd->gvc", unit, unit_centres)
    if k > 1:  # sub-center ArcFace: a class's cosine is its nearest sub-centre's
        cos = cos.reshape(samples, views, -1, k).amax(dim=-1)
    is_target = F.one_hot(labels, cos.shape[-1]).bool()[:, None, :].expand_as(cos)
    target = (cos * is_target).sum(dim=-1)  # (G, V)
    negatives = cos
    if name == "subcenter":
        target_logit = S * torch.cos(torch.acos(target) + 0.5)
    elif name == "adaface":
        norms = raw.norm(dim=-1).detach().clamp(0.001, 100.0)
        alpha = family.t_alpha
        mean = alpha * norms.mean() + (1 - alpha) * state[0]
        std = alpha * norms.std() + (1 - alpha) * state[1]
        state = [mean, std]
        quality = torch.clamp(family.h * (norms - mean) / (std + 1e-3), -1.0, 1.0)
        theta = torch.acos(target.clamp(-1 + 1e-3, 1 - 1e-3))
        angle = torch.clamp(theta - family.m * quality, 1e-3, math.pi - 1e-3)
        target_logit = S * (torch.cos(angle) - family.m - family.m * quality)
    elif name == "curricular":
        t = family.alpha * target.detach().mean() + (1 - family.alpha) * state[0]
        state = [t]
        with_margin = torch.cos(torch.acos(target) + family.m)
        assert bool((torch.acos(target) + family.m < math.pi).all()), "the test data stays clear of the fallback"
        hard = (cos > with_margin.detach()[..., None]) & ~is_target
        negatives = torch.where(hard, cos * (t + cos), cos)
        target_logit = S * with_margin
    else:
        margins = elastic_draws(seed, step, samples, views, family.m, family.std)
        if family.plus:  # the k-th largest target cosine of the batch takes the k-th smallest margin
            flat = target.detach().reshape(-1)
            place = torch.empty_like(flat, dtype=torch.long)
            place[torch.argsort(-flat)] = torch.arange(flat.numel())
            margins = torch.sort(margins.reshape(-1))[0][place].view(samples, views)
        if family.kind == "arc":
            target_logit = S * torch.cos(torch.acos(target) + margins)
        else:
            target_logit = S * (target - margins)
    logits = torch.where(is_target, target_logit[..., None], S * negatives)
    loss = sum(F.cross_entropy(logits[:, v], labels) for v in range(views)) / views
    return loss, [float(value) for value in state]


def initial_state(name: str) -> list:
    return {"adaface": [20.0, 100.0], "curricular": [0.0]}.get(name, [])


# --- PartialFC on every rank, the reference on rank 0 ------------------------------------------------

def family_against_dense(name: str, views: int, setting: str, seed: int, batch: int = 4,
                         compile_margin_softmax: bool = False) -> dict:
    """STEPS PartialFC steps on every rank of this world (the backbone in DDP when there is a process group);
    on rank 0 {"step i: tensor": (pairface's, the reference's)}, {} elsewhere."""
    num_classes, sample_rate = SETTINGS[setting]
    k = FAMILIES[name]["k"]
    rank, world_size = distributed.rank(), distributed.world()
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(world_size * batch, views, IN_FEATURES, generator=gen, dtype=torch.float64)
              for _ in range(STEPS)]
    labels = [torch.randint(0, num_classes, (world_size * batch,), generator=gen) for _ in range(STEPS)]
    torch.manual_seed(seed)
    reference_backbone = make_backbone(IN_FEATURES, EMBEDDING).double()
    backbone = make_backbone(IN_FEATURES, EMBEDDING).double()
    backbone.load_state_dict(reference_backbone.state_dict())
    model = torch.nn.parallel.DistributedDataParallel(backbone) if distributed.is_initialized() else backbone
    pfc = PartialFC(FAMILIES[name]["make"](), EMBEDDING, num_classes, sample_rate=sample_rate, seed=seed,
                    num_subcenters=k, compile_margin_softmax=compile_margin_softmax).double()
    mine = slice(rank * batch, (rank + 1) * batch)
    taken = []
    for step in range(STEPS):
        for parameter in [*backbone.parameters(), pfc.weight]:
            parameter.grad = None
        features = model(inputs[step][mine].reshape(batch * views, IN_FEATURES)).view(batch, views, -1)
        loss, _ = pfc(features.unbind(1), labels[step][mine])
        loss.backward()
        taken.append(dict(loss=loss.detach(), centres=pfc.weight.grad.detach().clone(),
                          backbone=[p.grad.clone() for p in backbone.parameters()],
                          state=pfc.margin_state.tolist(), sampled=pfc.last_sampled_classes))
    shards = distributed.gather_objects(taken)
    if rank != 0:
        return {}
    assert all(other_rank[i]["state"] == taken[i]["state"] for other_rank in shards for i in range(STEPS)), \
        "every rank keeps the same margin state"
    result = {}
    state = initial_state(name)
    for step in range(STEPS):
        centres = initial_centres(seed, 0, num_classes * k, EMBEDDING).double().requires_grad_(True)
        used, used_labels = centres, labels[step]
        sampled = [shard[step]["sampled"] for shard in shards]
        if sampled[0] is not None:  # the reference restricted to the classes PartialFC sampled (all K of each)
            subset = torch.cat(sampled)
            rows = (subset[:, None] * k + torch.arange(k)).reshape(-1)
            used, used_labels = centres[rows], torch.searchsorted(subset, labels[step])
        features = reference_backbone(inputs[step].reshape(-1, IN_FEATURES)).view(world_size * batch, views, -1)
        ref_loss, state = dense_family_loss(name, features, used_labels, used, state, step, seed, k)
        grads = torch.autograd.grad(ref_loss, [centres, *reference_backbone.parameters()])
        actual = [taken[step]["loss"], torch.cat([shard[step]["centres"] for shard in shards]),
                  *taken[step]["backbone"]]
        names = ["loss", "centres.grad", *(f"backbone.{n}.grad" for n, _ in backbone.named_parameters())]
        for what, a, e in zip(names, actual, [ref_loss.detach(), *grads], strict=True):
            result[f"step {step}: {what}"] = (a, e)
        result[f"step {step}: state"] = (torch.tensor(taken[step]["state"], dtype=torch.float64),
                                         torch.tensor(state, dtype=torch.float64))
    return result


def _all_cases() -> list[dict]:
    return [family_against_dense(name, views, setting, seed=seed) for seed, (name, views, setting) in
            enumerate(CASES)]


def _everything_distributed(rank: int, world_size: int, folder: str) -> dict:
    """All multi-process facts from one spawn: starting processes costs more than the checks."""
    return dict(cases=_all_cases(), checkpoint=_save_state_in_world(folder))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("margin_state")
    return folder, run_world(_everything_distributed, 2, str(folder))


@pytest.fixture
def gloo_group_of_one():
    """This process as a gloo world of one, for the test's duration."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def assert_cases(results: list[dict]) -> None:
    for (name, views, setting), result in zip(CASES, results, strict=True):
        assert result, "rank 0 reports the comparison"
        for what, (actual, expected) in result.items():
            assert_float64_close(actual, expected, f"{name}, {views} views, {setting}: {what}")


def test_one_process_without_a_process_group_equals_the_dense_references():
    assert_cases(_all_cases())


def test_one_gloo_process_under_ddp_equals_the_dense_references(gloo_group_of_one):
    assert distributed.is_initialized()
    assert_cases(_all_cases())


def test_two_gloo_processes_with_an_uneven_class_split_equal_the_dense_references(world2):
    assert_cases(world2[1][0]["cases"])


def test_the_families_states_move_so_the_state_comparisons_can_fail(world2):
    for (name, _, _), result in zip(CASES, world2[1][0]["cases"]):
        if initial_state(name):
            assert not torch.equal(result["step 2: state"][1], torch.tensor(initial_state(name)).double()), name


# --- the state through a checkpoint, across world sizes --------------------------------------------

CHECKPOINT_INFO = {"network": "toy", "network_kwargs": {}, "embedding_size": EMBEDDING, "num_classes": 7,
                   "num_subcenters": 2}


def _toy_state(margin, seed: int) -> SimpleNamespace:
    torch.manual_seed(seed)
    backbone = torch.nn.Linear(IN_FEATURES, EMBEDDING)
    pfc = PartialFC(margin, EMBEDDING, 7, seed=seed, num_subcenters=2)
    optimizer = torch.optim.SGD([{"params": list(backbone.parameters())}, {"params": [pfc.weight]}], lr=0.1,
                                momentum=0.9)
    model = SimpleNamespace(backbone=backbone, pfc=pfc, optimizer=optimizer,
                            scheduler=build_scheduler(optimizer, 0, 10),
                            scaler=torch.amp.GradScaler("cpu", enabled=False))
    model.components = build_components(model, {})
    return model


def _save_state_in_world(folder: str) -> dict:
    """Two AdaFace steps with 2 sub-centres per class, saved; what rank 0 holds (centres gathered)."""
    model = _toy_state(AdaFaceMargin(S, t_alpha=0.3), seed=1)
    gen = torch.Generator().manual_seed(distributed.rank())
    for _ in range(2):
        model.optimizer.zero_grad()
        loss, _ = model.pfc(model.backbone(torch.randn(4, IN_FEATURES, generator=gen)), torch.tensor([0, 3, 5, 6]))
        loss.backward()
        model.optimizer.step()
    save_state(folder, model, {"global_step": 2, "steps_per_epoch": 10, "nonfinite_total": 0},
               SavedPosition({"skipped": 0}), CHECKPOINT_INFO, {})
    centres = distributed.gather_objects(model.pfc.weight.detach().clone())
    return {"state": model.pfc.margin_state.clone(), "step": model.pfc.margin_step,
            "centres": None if centres is None else torch.cat(centres)}


def test_the_margin_state_and_sub_centres_written_on_two_processes_resume_on_one_bit_for_bit(world2):
    folder, ranks = world2
    saved = ranks[0]["checkpoint"]
    model = _toy_state(AdaFaceMargin(S, t_alpha=0.3), seed=9)  # another start: everything must come from the file
    restore_state(Path(folder) / POINTER_NAME, CHECKPOINT_INFO, model)
    assert torch.equal(model.pfc.margin_state, saved["state"])
    assert model.pfc.margin_step == saved["step"] == 2
    assert torch.equal(model.pfc.weight.detach(), saved["centres"]) and saved["centres"].shape == (14, EMBEDDING)
    assert not torch.equal(saved["state"], torch.tensor([20.0, 100.0]))


def test_a_checkpoint_of_another_family_leaves_the_state_at_its_start(world2, caplog):
    folder, _ = world2
    model = _toy_state(CurricularMargin(S), seed=9)
    restore_state(Path(folder) / POINTER_NAME, CHECKPOINT_INFO, model)
    assert model.pfc.margin_state.tolist() == [0.0]
    assert "trained with AdaFaceMargin" in caplog.text


# --- against the authors' public heads --------------------------------------------------------------
# Each function below re-derives, from reading the authors' code, what their head computes from the same
# features, centres and labels (one process, one view: their heads know neither ranks nor views). Their
# centres are the columns of a (D, C) kernel; ours are its transpose.

def authors_adaface(raw, labels, kernel, buffers, m, h, s, t_alpha):
    """mk-minchul/AdaFace head.py, AdaFace.forward: every cosine clamped to +-(1 - 1e-3), the norm clipped to
    [0.001, 100] and detached, the EMAs updated first, then the angular margin -m*z (its angle clipped to
    [eps, pi - eps]) and the additive m + m*z on the target column."""
    eps = 1e-3
    embeddings, norms = raw / raw.norm(dim=1, keepdim=True), raw.norm(dim=1, keepdim=True)
    cosine = (embeddings @ (kernel / kernel.norm(dim=0, keepdim=True))).clamp(-1 + eps, 1 - eps)
    safe = norms.clip(0.001, 100).detach()
    buffers["mean"] = safe.mean() * t_alpha + (1 - t_alpha) * buffers["mean"]
    buffers["std"] = safe.std() * t_alpha + (1 - t_alpha) * buffers["std"]
    scaler = torch.clip((safe - buffers["mean"]) / (buffers["std"] + eps) * h, -1, 1)
    one_hot = F.one_hot(labels, kernel.shape[1]).to(cosine.dtype)
    angle = torch.clip(cosine.acos() + one_hot * (-m * scaler), min=eps, max=math.pi - eps)
    return (angle.cos() - one_hot * (m + m * scaler)) * s


def authors_curricular(raw, labels, kernel, buffers, m, s):
    """HuangYG123/CurricularFace head/metrics.py, CurricularFace.forward: cos(theta + m) through sqrt, the
    fallback target - m*sin(m) past cos(pi - m), t updated first with rate 0.01, every column whose cosine
    exceeds the target's cos(theta + m) modulated (the target's own then overwritten)."""
    cos = ((raw / raw.norm(dim=1, keepdim=True)) @ (kernel / kernel.norm(dim=0, keepdim=True))).clamp(-1, 1)
    target = cos.gather(1, labels[:, None])
    with_margin = target * math.cos(m) - torch.sqrt(1.0 - target ** 2) * math.sin(m)
    final = torch.where(target > math.cos(math.pi - m), with_margin, target - math.sin(math.pi - m) * m)
    buffers["t"] = target.detach().mean() * 0.01 + (1 - 0.01) * buffers["t"]
    cos = torch.where(cos > with_margin, cos * (buffers["t"] + cos), cos)
    return torch.scatter(cos, 1, labels[:, None], final) * s


def authors_elastic(raw, labels, kernel, margins, kind, s):
    """fdbtrs/ElasticFace utils/losses.py, ElasticArcFace / ElasticCosFace.forward (plus=False), with the
    row margins given: theirs come from torch.normal, ours from the stream a test cannot share with theirs."""
    cos = ((raw / raw.norm(dim=1, keepdim=True)) @ (kernel / kernel.norm(dim=0, keepdim=True))).clamp(-1, 1)
    m_hot = F.one_hot(labels, kernel.shape[1]).to(cos.dtype) * margins[:, None]
    if kind == "arc":
        return (cos.acos() + m_hot).cos() * s
    return (cos - m_hot) * s


def authors_subcenter(raw, labels, kernel, k, m2, s):
    """insightface recognition/subcenter_arcface/train_parall.py, get_symbol_arcface with loss_K = k: the
    normalised features against every normalised sub-centre (C*K, class-major), the (B, C, K) max, then
    ArcFace's margin on the target column. (mxnet's L2Normalization adds 1e-10 under its root: left out.)"""
    fc7 = (raw / raw.norm(dim=1, keepdim=True)) @ (kernel / kernel.norm(dim=0, keepdim=True))
    fc7 = fc7.reshape(raw.shape[0], -1, k).max(dim=2).values
    one_hot = F.one_hot(labels, fc7.shape[1]).to(fc7.dtype)
    return (fc7 + (torch.cos(torch.acos(fc7 * one_hot) + m2) * one_hot - fc7 * one_hot)) * s


AUTHORS = {
    "adaface": lambda: AdaFaceMargin(S, m=0.4, h=0.333, t_alpha=0.5),
    "curricular": lambda: CurricularMargin(S, m=0.5, alpha=0.01),  # the authors' rate, fixed in their code
    "elastic_arc": lambda: ElasticMargin(S, "arc", m=0.5, std=0.05),
    "elastic_cos": lambda: ElasticMargin(S, "cos", m=0.35, std=0.05),
    "subcenter": lambda: CombinedMarginLoss(S, 1.0, 0.5, 0.0),
}


@pytest.mark.parametrize("name", AUTHORS)
def test_each_family_equals_its_authors_head_on_the_same_features_centres_and_labels(name):
    batch, num_classes, seed = 6, 9, 3
    k = 3 if name == "subcenter" else 1
    margin = AUTHORS[name]()
    pfc = PartialFC(margin, EMBEDDING, num_classes, seed=seed, num_subcenters=k).double()
    kernel = pfc.weight.detach().t().clone().requires_grad_(True)
    buffers = {name: torch.tensor(value, dtype=torch.float64) for name, value in (("mean", 20.0), ("std", 100.0),
                                                                                   ("t", 0.0))}
    gen = torch.Generator().manual_seed(seed)
    for step in range(STEPS):
        raw = (torch.randn(batch, EMBEDDING, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
        labels = torch.randint(0, num_classes, (batch,), generator=gen)
        pfc.weight.grad = None
        loss, _ = pfc(raw, labels)
        loss.backward()
        grad_raw = raw.grad
        their_raw = raw.detach().requires_grad_(True)
        if name == "adaface":
            logits = authors_adaface(their_raw, labels, kernel, buffers, margin.m, margin.h, S, margin.t_alpha)
            their_state = [buffers["mean"], buffers["std"]]
        elif name == "curricular":
            logits = authors_curricular(their_raw, labels, kernel, buffers, margin.m, S)
            their_state = [buffers["t"]]
        elif name == "subcenter":
            logits, their_state = authors_subcenter(their_raw, labels, kernel, k, margin.m2, S), []
        else:
            margins = elastic_draws(seed, step, batch, 1, margin.m, margin.std).view(-1)
            logits, their_state = authors_elastic(their_raw, labels, kernel, margins, margin.kind, S), []
        their_loss = F.cross_entropy(logits, labels)
        their_grad_raw, their_grad_kernel = torch.autograd.grad(their_loss, [their_raw, kernel])
        for what, ours, theirs in (("loss", loss.detach(), their_loss.detach()), ("features.grad", grad_raw,
                                   their_grad_raw), ("centres.grad", pfc.weight.grad, their_grad_kernel.t()),
                                   ("state", pfc.margin_state, torch.stack(their_state) if their_state else
                                    torch.zeros(0, dtype=torch.float64))):
            where = f"{name}, step {step}: {what}"
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12 * max(1.0, float(theirs.abs().sum())),
                                       msg=lambda text, where=where: f"{where}: {text}")


class WarmupCosFace(MarginFamily, Margin):
    """A family written as one class against the protocols alone (a margin warm-up, a known recipe): CosFace
    whose margin grows linearly over the first ``warmup`` forwards, its state the forwards counted so far."""

    def __init__(self, s: float, m: float, warmup: int):
        self.s, self.m, self.warmup = s, m, warmup

    def initial_state(self) -> list[float]:
        return [0.0]

    def bind(self, state: torch.Tensor, rows: GlobalRows, target_cos: torch.Tensor | None) -> Margin:
        state += 1.0
        self.current = self.m * min(1.0, float(state[0]) / self.warmup)
        return self

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        return self.s * (cos - self.current)


def test_a_new_family_is_one_class_that_partial_fc_runs_unchanged():
    batch, num_classes, m, warmup = 5, 6, 0.4, 2
    pfc = PartialFC(WarmupCosFace(S, m, warmup), EMBEDDING, num_classes, seed=4).double()
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        raw = torch.randn(batch, EMBEDDING, generator=gen, dtype=torch.float64).requires_grad_(True)
        labels = torch.randint(0, num_classes, (batch,), generator=gen)
        pfc.weight.grad = None
        loss, _ = pfc(raw, labels)
        loss.backward()
        their_raw = raw.detach().requires_grad_(True)
        centres = pfc.weight.detach().clone().requires_grad_(True)
        cos = F.normalize(their_raw) @ F.normalize(centres).t()
        margin = m * min(1.0, (step + 1) / warmup)
        their_loss = F.cross_entropy(S * (cos - margin * F.one_hot(labels, num_classes).double()), labels)
        grads = torch.autograd.grad(their_loss, [their_raw, centres])
        for what, ours, theirs in (("loss", loss.detach(), their_loss.detach()), ("features.grad", raw.grad, grads[0]),
                                   ("centres.grad", pfc.weight.grad, grads[1]),
                                   ("state", pfc.margin_state, torch.tensor([step + 1.0], dtype=torch.float64))):
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12, msg=lambda text, w=what: f"{w}: {text}")


# --- each family's margin at the edges, on given cosines (no PartialFC) --------------------------------

def bound(family: MarginFamily, rows: GlobalRows, target_cos: torch.Tensor | None = None) -> Margin:
    """The family's margin for one forward, its state in float64 from its start."""
    return family.bind(torch.tensor(family.initial_state(), dtype=torch.float64), rows, target_cos)


@pytest.mark.parametrize("name", ["adaface", "curricular", "elastic_arc", "elastic_cos"])
def test_a_target_cosine_of_exactly_one_or_minus_one_gives_a_finite_logit_and_gradient(name):
    """Rounding makes a cosine of exactly +-1 happen (a centre equal to its feature): the angle's derivative is
    infinite there, so the angular families clamp the cosine before acos."""
    family = {"adaface": AdaFaceMargin(S), "curricular": CurricularMargin(S),
              "elastic_arc": ElasticMargin(S, "arc"), "elastic_cos": ElasticMargin(S, "cos")}[name]
    cos = torch.tensor([-1.0, 1.0, -1.0, 1.0, 0.3, -0.3], dtype=torch.float64, requires_grad=True)
    rows = GlobalRows(1, 1, 6, norms=torch.tensor([1.0, 1.0, 30.0, 30.0, 10.0, 20.0], dtype=torch.float64))
    logit = bound(family, rows, cos.detach()).target_logit(cos)
    logit.sum().backward()
    assert torch.isfinite(logit).all() and torch.isfinite(cos.grad).all(), (logit, cos.grad)


def test_adaface_clips_the_norms_quality_to_plus_or_minus_one_and_the_shifted_angle_to_zero_pi():
    """The formula of AdaFaceMargin's docstring in float64 by hand, on norms whose quality z passes -1 and +1
    (h = 1, the EMAs at this batch's mean and std: t_alpha = 1) and on cosines whose shifted angle theta - m z
    leaves [eps, pi - eps]."""
    s, m, h, eps = S, 0.4, 1.0, 1e-3
    norms = [1.0, 25.0, 25.0, 25.0, 25.0, 25.0, 25.0, 50.0]
    cosines = [-1.0, 0.3, -0.2, 0.1, 0.5, 0.7, -0.6, 1.0]
    mean = sum(norms) / len(norms)
    std = math.sqrt(sum((n - mean) ** 2 for n in norms) / (len(norms) - 1))
    quality = [h * (n - mean) / (std + eps) for n in norms]
    z = [min(1.0, max(-1.0, q)) for q in quality]
    theta = [math.acos(min(1 - eps, max(-1 + eps, c))) for c in cosines]
    shifted = [t - m * zi for t, zi in zip(theta, z)]
    expected = [s * (math.cos(min(math.pi - eps, max(eps, a))) - m - m * zi) for a, zi in zip(shifted, z)]
    assert quality[0] < -1 and quality[-1] > 1 and shifted[0] > math.pi - eps and shifted[-1] < eps  # it can tell
    rows = GlobalRows(1, 1, len(norms), norms=torch.tensor(norms, dtype=torch.float64))
    logit = bound(AdaFaceMargin(s, m=m, h=h, t_alpha=1.0), rows).target_logit(torch.tensor(cosines,
                                                                                           dtype=torch.float64))
    torch.testing.assert_close(logit, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-10)


def test_curricular_falls_back_past_pi_and_a_tie_with_a_threshold_is_not_hard_as_in_the_authors_head():
    """The authors' head: target ``cos(theta + m)`` only where ``cos > cos(pi - m)`` (a strict >), else
    ``cos - m sin m``; a negative is hard only where ``c_j > cos(theta_y + m)`` (strict); a target cosine
    rounded past +-1 counts as +-1."""
    s, m = S, 0.5
    margin = bound(CurricularMargin(s, m=m, alpha=1.0), GlobalRows(1, 1, 2),
                   torch.tensor([1.0 + 1e-9, -1.0 - 1e-9], dtype=torch.float64))
    at_pi = math.cos(math.pi - m)
    cosines = [-1.0, -0.99, at_pi, 0.3]
    expected = [s * (c - m * math.sin(m)) if c <= at_pi else s * math.cos(math.acos(c) + m) for c in cosines]
    torch.testing.assert_close(margin.target_logit(torch.tensor(cosines, dtype=torch.float64)),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-10)
    # thresholds: cos(0 + m) for the target at +1, cos(pi + m) = -cos(m) for the one at -1; t is their mean, 0
    negatives = [[math.cos(m), math.cos(m) + 0.01, 0.2], [-math.cos(m), 0.0, -0.95]]
    hard = [[False, True, False], [False, True, False]]
    cos = torch.tensor(negatives, dtype=torch.float64)
    slope = torch.empty_like(cos)
    margin.modulate(cos, slope)
    t = float(margin.t)
    assert abs(t) < 1e-12
    assert cos.tolist() == [[c * (t + c) if h else c for c, h in zip(row, hs)] for row, hs in zip(negatives, hard)]
    assert slope.tolist() == [[t + 2 * c if h else 1.0 for c, h in zip(row, hs)] for row, hs in zip(negatives, hard)]


def test_elastic_takes_the_authors_settings_by_default_and_continues_linearly_past_pi():
    for kwargs, settings in (({}, (64.0, "arc", 0.5, 0.05, False)),
                             (dict(plus=True), (64.0, "arc", 0.5, 0.0175, True)),
                             (dict(kind="cos"), (64.0, "cos", 0.35, 0.05, False)),
                             (dict(kind="cos", plus=True), (64.0, "cos", 0.35, 0.02, True)),
                             (dict(s=30.0, m=0.4, std=0.1, plus=True), (30.0, "arc", 0.4, 0.1, True))):
        family = ElasticMargin(**kwargs)
        assert (family.s, family.kind, family.m, family.std, family.plus) == settings, kwargs
    # std 0: every row's margin is m; past theta = pi - m the logit goes on as cos - cos(pi - m) - 1
    s, m = S, 0.5
    cosines = [-1.0, -0.99, -0.5, 0.3]
    below = -math.cos(m)
    expected = [s * (c - below - 1.0) if c < below else s * math.cos(math.acos(c) + m) for c in cosines]
    margin = bound(ElasticMargin(s, "arc", m=m, std=0.0), GlobalRows(1, 1, len(cosines)))
    torch.testing.assert_close(margin.target_logit(torch.tensor(cosines, dtype=torch.float64)),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_elastic_plus_hands_equal_target_cosines_their_margins_in_row_order():
    """ElasticFace+: the sorted draws go to the rows by decreasing target cosine; rows whose target cosines
    are equal take them in row order (a stable sort: the same margins on any device)."""
    m, std, seed, step = 0.35, 0.1, 3, 2
    targets = [0.5, 0.5, 0.3, 0.5, 0.9, 0.5, 0.5, 0.5] * 3
    draws = sorted(elastic_draws(seed, step, len(targets), 1, m, std).view(-1).tolist())
    by_target = sorted(range(len(targets)), key=lambda row: -targets[row])  # Python's sort is stable
    expected = [0.0] * len(targets)
    for rank, row in enumerate(by_target):
        expected[row] = draws[rank]
    margin = bound(ElasticMargin(S, "cos", m=m, std=std, plus=True),
                   GlobalRows(1, 1, len(targets), seed=seed, step=step), torch.tensor(targets, dtype=torch.float64))
    margins = -margin.target_logit(torch.zeros(len(targets), dtype=torch.float64)) / S  # s (0 - m_i)
    assert margins.tolist() == expected
