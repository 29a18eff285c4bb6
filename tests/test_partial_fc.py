"""PartialFC against a dense single-process float64 reference, on 1 and 2 real gloo processes.

The references share no code with partial_fc.py: tools/check_pfc.dense_reference (a plain
full-softmax cross-entropy written with F.cross_entropy and the closed-form margin) and, for
arcface_torch's two options, `dense_reference_with_options` below. Everything runs in float64, so
every element of the loss and of every gradient must agree to near float64 precision: measured
worst errors are ~1e-15 of a tensor's largest element and ~1e-10 relative on its tiniest elements
(cancellation), so `assert_float64_close` allows 1e-12 relative per element with a floor of 1e-14
of the largest element, still many orders of magnitude below any real mistake.
"""
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import partial_fc
from bench.host_syncs import SyncCounter
from losses import CombinedMarginLoss
from partial_fc import PartialFC, class_range, initial_centres
from tests.distributed_helpers import run_world
from tools.check_pfc import dense_reference, make_backbone
from training.state import build_optimizer
from utils import distributed

ARCFACE, COSFACE = (1.0, 0.5, 0.0), (1.0, 0.0, 0.35)
SCALE = 64.0
IN_FEATURES = 32
CASES = [dict(views=views, margin=margin) for views in (1, 2, 3) for margin in (ARCFACE, COSFACE)]
# arcface_torch's two options, through PartialFC (not only on the margin): each case must match the
# reference with the option and differ from the one without it.
OPTION_CASES = {
    "straight_through": dict(views=2, margin=ARCFACE, straight_through=True),
    "filtering": dict(views=2, margin=COSFACE, threshold=0.2),
    "both_sampled": dict(views=3, margin=ARCFACE, straight_through=True, threshold=0.2, num_classes=41,
                         sample_rate=0.5),
}


def assert_float64_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    floor = 1e-14 * float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=floor, msg=lambda m: f"{what}: {m}")
    assert torch.equal(actual[expected == 0], expected[expected == 0]), f"{what}: zero entries must be exactly zero"


def dense_reference_with_options(views: list[torch.Tensor], labels: torch.Tensor, centres: torch.Tensor,
                                 margin: tuple[float, float, float], s: float, threshold: float = 0.0,
                                 straight_through: bool = False) -> torch.Tensor:
    """check_pfc.dense_reference with arcface_torch's options written out from their definitions:
    `threshold` > 0 sets every non-target cosine above it to 0 (so it gets no gradient);
    `straight_through` keeps the margin's value but takes the target's gradient to be that of s*cos."""
    m1, m2, m3 = margin
    unit_centres = centres / centres.norm(dim=1, keepdim=True)
    is_target = F.one_hot(labels, centres.shape[0]).bool()
    loss = 0.0
    for emb in views:
        cos = (emb / emb.norm(dim=1, keepdim=True)) @ unit_centres.t()
        if threshold > 0:
            cos = torch.where((cos.detach() > threshold) & ~is_target, 0.0, cos)
        target = cos[is_target]  # one per row, in row order
        target_logit = s * (torch.cos(m1 * torch.acos(target) + m2) - m3)
        if straight_through:
            target_logit = s * target + (target_logit - s * target).detach()
        logits = (s * cos).masked_scatter(is_target, target_logit)
        loss = loss + F.cross_entropy(logits, labels) / len(views)
    return loss


def pfc_against_dense(views: int, margin: tuple, num_classes: int = 7, sample_rate: float = 1.0,
                      threshold: float = 0.0, straight_through: bool = False, seed: int = 0, batch: int = 4,
                      embedding_size: int = 16, labels_below: int | None = None,
                      compile_margin_softmax: bool = False) -> dict:
    """One PartialFC step on every rank of the current world (the backbone in DDP when there is a
    process group), on rank 0 {tensor name: (pairface's, the reference's, the reference's without
    the options)}; {} on other ranks. Labels are drawn from [0, labels_below or num_classes).
    With sample_rate 0 the reference is restricted to the step's labels (arcface_torch's meaning), and
    "sampled classes" compares them with the classes PartialFC used."""
    rank, world_size = distributed.rank(), distributed.world()
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(world_size * batch, views, IN_FEATURES, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, labels_below or num_classes, (world_size * batch,), generator=gen)
    torch.manual_seed(seed)
    reference_backbone = make_backbone(IN_FEATURES, embedding_size).double()
    backbone = make_backbone(IN_FEATURES, embedding_size).double()
    backbone.load_state_dict(reference_backbone.state_dict())
    model = torch.nn.parallel.DistributedDataParallel(backbone) if distributed.is_initialized() else backbone

    margin_loss = CombinedMarginLoss(SCALE, *margin, interclass_filtering_threshold=threshold,
                                     straight_through=straight_through)
    pfc = PartialFC(margin_loss, embedding_size, num_classes, sample_rate=sample_rate, seed=seed,
                    compile_margin_softmax=compile_margin_softmax).double()
    mine = slice(rank * batch, (rank + 1) * batch)
    features = model(inputs[mine].reshape(batch * views, IN_FEATURES)).view(batch, views, -1)
    loss, _ = pfc(features.unbind(1), labels[mine])
    loss.backward()

    sampled = pfc.last_sampled_classes
    shards = distributed.gather_objects((pfc.weight.grad.detach(), sampled))
    if rank != 0:
        return {}
    subset = None if sampled is None else torch.cat([classes for _, classes in shards])
    positives = labels.unique() if sample_rate == 0 else None
    ref_features = reference_backbone(inputs.reshape(-1, IN_FEATURES)).view(world_size * batch, views, -1)
    ref_views = list(ref_features.unbind(1))

    def reference(**options):
        centres = initial_centres(seed, 0, num_classes, embedding_size).double().requires_grad_(True)
        used_centres, used_labels = centres, labels
        if subset is not None:  # the reference restricted to the positives, or to the centres PartialFC sampled
            restricted = subset if positives is None else positives
            used_centres, used_labels = centres[restricted], torch.searchsorted(restricted, labels)
        if options:
            ref_loss = dense_reference_with_options(ref_views, used_labels, used_centres, margin, SCALE, **options)
        else:
            ref_loss = dense_reference(ref_views, used_labels, used_centres, margin, SCALE)
        grads = torch.autograd.grad(ref_loss, [centres, *reference_backbone.parameters()], retain_graph=True)
        return [ref_loss.detach(), *grads]

    options = {key: value for key, value in (("threshold", threshold), ("straight_through", straight_through))
               if value}
    expected, plain = reference(**options), reference()
    actual = [loss.detach(), torch.cat([grad for grad, _ in shards]),
              *(p.grad for p in backbone.parameters())]
    names = ["loss", "centres.grad", *(f"backbone.{name}.grad" for name, _ in backbone.named_parameters())]
    result = {name: (a.detach(), e, p) for name, a, e, p in zip(names, actual, expected, plain)}
    if positives is not None:
        result["sampled classes"] = (subset.double(), positives.double(), positives.double())
    return result


def assert_matches_reference(result: dict, what: str) -> None:
    assert result, "rank 0 reports the comparison"
    for name, (actual, expected, _) in result.items():
        assert_float64_close(actual, expected, f"{what}: {name}")


def assert_the_option_matters(result: dict, what: str) -> None:
    """The reference without the option is far from the one with it: PartialFC ignoring the option fails."""
    worst = max(float((expected - plain).abs().max() / expected.abs().max())
                for expected, plain in ((e, p) for _, e, p in result.values()))
    assert worst > 1e-3, f"{what}: the option changes nothing here, so this case could not catch it being ignored"


def _all_cases(num_classes: int, sample_rate: float) -> list[dict]:
    return [pfc_against_dense(**case, num_classes=num_classes, sample_rate=sample_rate, seed=case["views"])
            for case in CASES]


def _option_cases() -> dict[str, dict]:
    return {name: pfc_against_dense(**case, seed=7) for name, case in OPTION_CASES.items()}


def _everything_distributed(rank, world_size):
    """All multi-process facts from one spawn: starting processes costs more than the checks."""
    return dict(exact=_all_cases(7, 1.0),
                sampled=_all_cases(41, 0.3),
                options=_option_cases(),
                # 5 classes on 2 ranks (3 + 2), every label on rank 0's shard: rank 1 samples int(0.3 * 2) = 0 centres
                empty_shard=pfc_against_dense(views=2, margin=ARCFACE, num_classes=5, sample_rate=0.3, labels_below=3),
                positives_only=_positives_only_cases(),
                sampling=_sampling_facts(rank, world_size),
                bad_label=_bad_label_on_rank_one(rank, world_size),
                optimizer_steps={name: steps_against_dense(name) for name in OPTIMIZERS})


@pytest.fixture(scope="module")
def world2():
    return run_world(_everything_distributed, 2)


@pytest.fixture(scope="module")
def world1():
    return run_world(_everything_distributed, 1)


def _assert_all_cases(results: list[dict]) -> None:
    for case, result in zip(CASES, results, strict=True):
        assert_matches_reference(result, f"{case['views']} views, margin {case['margin']}")


def test_world1_without_process_group_equals_dense_reference():
    _assert_all_cases(_all_cases(7, 1.0))


def test_world1_ddp_equals_dense_reference(world1):
    _assert_all_cases(world1[0]["exact"])
    _assert_all_cases(world1[0]["sampled"])


def test_world2_ddp_gradients_equal_dense_reference(world2):
    """7 classes on 2 ranks: shards of 4 and 3 centres."""
    _assert_all_cases(world2[0]["exact"])


def test_sampled_loss_equals_reference_restricted_to_the_subset(world2):
    _assert_all_cases(world2[0]["sampled"])


def test_a_rank_that_samples_no_centre_at_all(world2):
    """Tiny sample rates over many ranks leave a rank without positives no centre: its softmax shard is
    empty (the maximum of no logits is -inf) and the result is still the reference's."""
    assert_matches_reference(world2[0]["empty_shard"], "rank 1 samples no centre")


OPTIMIZERS = {"sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.05), "adamw": dict(lr=0.01, weight_decay=0.05)}


def steps_against_dense(optimizer: str, steps: int = 3, num_classes: int = 60, batch: int = 3, views: int = 2,
                        embedding_size: int = 8, seed: int = 21) -> dict:
    """`steps` training steps at sample_rate 0.1 as training builds them (the centres' gradient sparse, the
    optimizer of build_optimizer), on every rank of the current world; on rank 0 {name: (pairface's, the
    reference's)} for the centres, their optimizer state and the backbone, every row, and {"never sampled":
    rows} (such rows move only by momentum and weight decay). The reference: dense float64 in one process,
    the full (C, D) centre gradient (zero outside the step's sampled classes) and torch's own optimizer."""
    rank, world_size = distributed.rank(), distributed.world()
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(steps, world_size * batch, views, IN_FEATURES, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, num_classes, (steps, world_size * batch), generator=gen)
    torch.manual_seed(seed)
    reference_backbone = make_backbone(IN_FEATURES, embedding_size).double()
    backbone = make_backbone(IN_FEATURES, embedding_size).double()
    backbone.load_state_dict(reference_backbone.state_dict())
    model = torch.nn.parallel.DistributedDataParallel(backbone) if distributed.is_initialized() else backbone
    pfc = PartialFC(CombinedMarginLoss(SCALE, *ARCFACE), embedding_size, num_classes, sample_rate=0.1, seed=seed,
                    sparse_grad=True).double()
    settings = OPTIMIZERS[optimizer]
    cfg = SimpleNamespace(optimizer=optimizer, lr=settings["lr"], momentum=settings.get("momentum", 0.0),
                          weight_decay=settings["weight_decay"], backbone_lr_mult=1.0)
    opt = build_optimizer(cfg, backbone, pfc)
    mine, sampled = slice(rank * batch, (rank + 1) * batch), []
    for step in range(steps):
        features = model(inputs[step, mine].reshape(batch * views, IN_FEATURES)).view(batch, views, -1)
        pfc(features.unbind(1), labels[step, mine])[0].backward()
        assert pfc.weight.grad.is_sparse
        opt.step()
        opt.zero_grad(set_to_none=True)
        sampled.append(pfc.last_sampled_classes)
    state = {name: value for name, value in opt.state[pfc.weight].items() if value.dim() == 2}
    shards = distributed.gather_objects((pfc.weight.detach(), state, sampled))
    if rank != 0:
        return {}

    centres = initial_centres(seed, 0, num_classes, embedding_size).double().requires_grad_(True)
    groups = [{"params": list(reference_backbone.parameters())}, {"params": [centres]}]
    reference_opt = (torch.optim.SGD(groups, foreach=False, **settings) if optimizer == "sgd"
                     else torch.optim.AdamW(groups, foreach=False, **settings))
    for step in range(steps):
        subset = torch.cat([classes[step] for _, _, classes in shards])
        ref_views = reference_backbone(inputs[step].reshape(-1, IN_FEATURES)).view(world_size * batch, views, -1)
        dense_reference(list(ref_views.unbind(1)), torch.searchsorted(subset, labels[step]), centres[subset],
                        ARCFACE, SCALE).backward()
        reference_opt.step()
        reference_opt.zero_grad(set_to_none=True)
    result = {"centres": (torch.cat([weight for weight, _, _ in shards]), centres.detach())}
    for name in shards[0][1]:
        result[f"centres' {name}"] = (torch.cat([s[name] for _, s, _ in shards]), reference_opt.state[centres][name])
    for name, parameter in backbone.named_parameters():
        result[f"backbone.{name}"] = (parameter.detach(), dict(reference_backbone.named_parameters())[name].detach())
    ever = torch.cat([classes for _, _, per_step in shards for classes in per_step]).unique()
    never = torch.ones(num_classes, dtype=torch.bool).index_fill_(0, ever, False).nonzero().squeeze(1)
    return dict(compared=result, never_sampled=never, initial=initial_centres(seed, 0, num_classes, embedding_size))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("world", ["world1", "world2"])
def test_sampled_steps_move_every_row_as_the_dense_reference(request, world, optimizer):
    """Three steps at sample_rate 0.1 with the sparse centre gradient and the optimizer training builds: every
    centre (sampled or not), its optimizer state and the backbone equal those of torch's optimizer stepping a
    dense float64 gradient (zero outside the sampled rows), momentum and weight decay included. Rows never
    sampled moved, by momentum and decay alone: leaving them in place fails."""
    outcome = request.getfixturevalue(world)[0]["optimizer_steps"][optimizer]
    for name, (actual, expected) in outcome["compared"].items():
        assert_float64_close(actual, expected, f"{world} {optimizer}: {name}")
    never = outcome["never_sampled"]
    assert len(never) > 20
    moved = (outcome["compared"]["centres"][1][never] - outcome["initial"][never].double()).abs()
    assert bool((moved > 1e-6 * outcome["initial"][never].abs().double()).all())


def test_the_sparse_centre_gradient_is_the_dense_ones_sampled_rows():
    """sparse_grad=True: the same gradient as the default's dense one, holding the sampled rows alone."""
    grads = []
    for sparse in (False, True):
        torch.manual_seed(9)
        pfc = PartialFC(CombinedMarginLoss(), 8, 50, sample_rate=0.2, sparse_grad=sparse).double()
        views = [torch.randn(6, 8, dtype=torch.float64) for _ in range(2)]
        pfc(views, torch.tensor([0, 3, 3, 17, 25, 49]))[0].backward()
        grads.append(pfc.weight.grad)
    dense, sparse = grads
    assert sparse.is_sparse and not dense.is_sparse
    assert sparse._indices()[0].tolist() == pfc.last_sampled_classes.tolist()
    assert torch.equal(sparse.to_dense(), dense)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_micro_batches_sparse_gradients_step_as_their_dense_sum(optimizer):
    """Two micro-batches per step, each sampling its own centres, some rows in both: autograd sums their sparse
    gradients and the step equals torch's optimizer on the summed dense gradient."""
    settings = OPTIMIZERS[optimizer]
    cfg = SimpleNamespace(optimizer=optimizer, lr=settings["lr"], momentum=settings.get("momentum", 0.0),
                          weight_decay=settings["weight_decay"], backbone_lr_mult=1.0)
    gen = torch.Generator().manual_seed(13)
    batches = [(torch.randn(2, 4, 8, generator=gen, dtype=torch.float64), torch.randint(0, 40, (4,), generator=gen))
               for _ in range(8)]
    centres, repeated = [], 0
    for sparse in (True, False):
        torch.manual_seed(14)
        pfc = PartialFC(CombinedMarginLoss(), 8, 40, sample_rate=0.2, sparse_grad=sparse).double()
        backbone = torch.nn.Linear(8, 8).double()
        opt = build_optimizer(cfg, backbone, pfc) if sparse else (
            torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW)(
            [{"params": backbone.parameters()}, {"params": pfc.parameters()}], foreach=False, **settings)
        for step in range(4):
            drawn = []
            for views, labels in batches[2 * step:2 * step + 2]:
                (pfc([backbone(v) for v in views], labels)[0] / 2).backward()
                drawn.append(set(pfc.last_sampled_classes.tolist()))
            assert pfc.weight.grad.is_sparse == sparse
            repeated += len(drawn[0] & drawn[1])
            opt.step()
            opt.zero_grad(set_to_none=True)
        centres.append(pfc.weight.detach())
    assert repeated > 6, "the micro-batches' samples should share rows"
    assert_float64_close(*centres, f"{optimizer}, two micro-batches per step")


def _positives_only_cases() -> list[dict]:
    """sample_rate 0: 8 labels of 41 classes; and every label on rank 0's shard, so that rank 1 (of two)
    has no positive and keeps no centre at all."""
    return [pfc_against_dense(views=2, margin=ARCFACE, num_classes=41, sample_rate=0.0, seed=11),
            pfc_against_dense(views=3, margin=COSFACE, num_classes=5, sample_rate=0.0, labels_below=3, seed=12)]


def test_sample_rate_zero_keeps_exactly_the_positives_without_process_group():
    for result in _positives_only_cases():
        assert_matches_reference(result, "sample_rate 0")


@pytest.mark.parametrize("world", ["world1", "world2"])
def test_sample_rate_zero_keeps_exactly_the_positives_in_ddp(request, world):
    """arcface_torch's PartialFC_V2 with no room for negatives: the loss and every gradient are the dense
    reference's over the step's positive classes only."""
    for result in request.getfixturevalue(world)[0]["positives_only"]:
        assert_matches_reference(result, f"{world} sample_rate 0")


def test_many_column_chunks_give_the_same_loss_and_gradients(monkeypatch):
    """The softmax passes walk the (N, C) buffer in column chunks to bound temporaries; results must not
    depend on the chunking (here 8 elements: one or two columns per chunk)."""
    monkeypatch.setattr(partial_fc, "COLUMN_CHUNK_ELEMENTS", 8)
    assert_matches_reference(pfc_against_dense(views=2, margin=ARCFACE, num_classes=11, seed=3), "chunked")


@pytest.mark.parametrize("case", OPTION_CASES)
def test_margin_options_through_partial_fc_without_process_group(case):
    result = pfc_against_dense(**OPTION_CASES[case], seed=7)
    assert_matches_reference(result, case)
    assert_the_option_matters(result, case)


@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("world", ["world1", "world2"])
def test_margin_options_through_partial_fc_in_ddp(request, world, case):
    result = request.getfixturevalue(world)[0]["options"][case]
    assert_matches_reference(result, f"{world} {case}")
    assert_the_option_matters(result, f"{world} {case}")


def test_the_options_reference_is_the_plain_reference_when_they_are_off():
    gen = torch.Generator().manual_seed(4)
    views = [torch.randn(6, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    centres = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0, 4, 4, 2, 1, 3])
    for margin in (ARCFACE, COSFACE, (1.2, 0.3, 0.1)):
        assert dense_reference_with_options(views, labels, centres, margin, SCALE).item() == pytest.approx(
            dense_reference(views, labels, centres, margin, SCALE).item(), rel=1e-15)


def _sampling_facts(rank, world_size):
    torch.manual_seed(100 + rank)
    num_classes, batch = 40, 3
    pfc = PartialFC(CombinedMarginLoss(), 8, num_classes, sample_rate=0.25).double()
    labels = torch.tensor([[0, 5, 5], [30, 20, 1]])[rank % 2]  # 0 and 20: the first class of each rank
    views = [torch.randn(batch, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    pfc(views, labels)[0].backward()
    start, count = class_range(num_classes, rank, world_size)
    grad_rows_nonzero = (pfc.weight.grad != 0).any(dim=1).nonzero().squeeze(1) + start
    facts = dict(sampled=pfc.last_sampled_classes.tolist(), start=start, count=count,
                 grad_rows=grad_rows_nonzero.tolist(), zero_elsewhere=_zero_outside(pfc, start))
    with torch.no_grad():  # later forwards of this rank: every rank samples its own range afresh
        facts["later_draws"] = [_draw(pfc, views, labels) for _ in range(60)]
    return facts


def _draw(pfc: PartialFC, views, labels) -> tuple[int, ...]:
    pfc(views, labels)
    return tuple(pfc.last_sampled_classes.tolist())


def _zero_outside(pfc, start):
    mask = torch.ones(pfc.num_local, dtype=torch.bool)
    mask[pfc.last_sampled_classes - start] = False
    return bool((pfc.weight.grad[mask] == 0).all())


def test_sampling_keeps_every_positive_and_leaves_the_rest_untouched(world2):
    results = [r["sampling"] for r in world2]
    positives = {0, 1, 5, 30, 20}
    for r in results:
        mine = {c for c in positives if r["start"] <= c < r["start"] + r["count"]}
        for draw in [r["sampled"], *r["later_draws"]]:
            assert mine <= set(draw)
            assert len(draw) == max(int(0.25 * r["count"]), len(mine))
            assert list(draw) == sorted(set(draw))
            assert set(draw) <= set(range(r["start"], r["start"] + r["count"])), "a rank samples its own centres"
        assert set(r["grad_rows"]) <= set(r["sampled"])
        assert r["zero_elsewhere"], "centres outside the sampled subset must get exactly zero gradient"


def test_every_rank_draws_fresh_negatives_from_its_whole_range(world2):
    for r in (r["sampling"] for r in world2):
        assert len(set(r["later_draws"])) > 40, "the negatives of 60 forwards should almost never repeat"
        assert set().union(*r["later_draws"]) == set(range(r["start"], r["start"] + r["count"]))


def draws(seed: int, forwards: int, num_classes: int = 40, sample_rate: float = 0.25) -> list[tuple[int, ...]]:
    """The centres each of `forwards` forward calls used, with torch's generator seeded by `seed`."""
    torch.manual_seed(seed)
    pfc = PartialFC(CombinedMarginLoss(), 8, num_classes, sample_rate=sample_rate)
    views = [torch.randn(3, 8), torch.randn(3, 8)]
    with torch.no_grad():
        return [_draw(pfc, views, torch.tensor([0, 5, 5])) for _ in range(forwards)]


def test_sampled_negatives_are_random_fresh_each_forward_and_seeded():
    """10 of 40 centres per forward: the positives 0 and 5, and 8 of the 38 others drawn afresh by every
    forward call, uniformly, from torch's seeded generator (the seed replays them; another seed does not)."""
    forwards = 200
    seen = draws(0, forwards)
    assert all({0, 5} <= set(draw) and len(draw) == 10 for draw in seen)
    assert len(set(seen)) == forwards, "a draw of 8 of 38 negatives should not repeat within 200 forwards"
    counts = torch.bincount(torch.tensor([c for draw in seen for c in draw]), minlength=40)
    negatives = torch.tensor([c for c in range(40) if c not in (0, 5)])
    expected = forwards * 8 / 38  # 42 per class; binomial standard deviation 5.8
    assert counts[[0, 5]].tolist() == [forwards, forwards]
    assert int(counts[negatives].min()) > expected - 28 and int(counts[negatives].max()) < expected + 28, counts
    assert draws(0, forwards) == seen
    assert draws(1, 20) != seen[:20]


def test_view_weights_one_zero_gives_the_second_view_no_gradient():
    torch.manual_seed(0)
    pfc = PartialFC(CombinedMarginLoss(), 16, 9, view_weights=(1.0, 0.0)).double()
    views = [torch.randn(5, 16, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    labels = torch.tensor([0, 3, 8, 3, 1])
    loss, per_view = pfc(views, labels)
    loss.backward()
    assert torch.count_nonzero(views[1].grad) == 0
    assert torch.count_nonzero(views[0].grad) > 0
    expected = dense_reference([views[0].detach()], labels, pfc.weight.detach(), (1.0, 0.5, 0.0), 64.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert per_view[0].item() == pytest.approx(expected.item(), rel=1e-12)


def test_view_losses_are_each_views_mean_cross_entropy():
    torch.manual_seed(1)
    pfc = PartialFC(CombinedMarginLoss(m2=0.0, m3=0.35), 16, 9, view_weights=(0.25, 0.75)).double()
    views = [torch.randn(4, 16, dtype=torch.float64) for _ in range(2)]
    labels = torch.tensor([2, 2, 7, 0])
    loss, per_view = pfc(views, labels)
    each = [dense_reference([v], labels, pfc.weight.detach(), (1.0, 0.0, 0.35), 64.0).item() for v in views]
    assert per_view.tolist() == pytest.approx(each, rel=1e-12)
    assert loss.item() == pytest.approx(0.25 * each[0] + 0.75 * each[1], rel=1e-12)


def test_a_hopeless_row_s_loss_is_not_capped_at_arcface_torchs_69_08():
    # arcface_torch clamps the target probability at 1e-30 (a row's loss at most -ln 1e-30 = 69.08); the README
    # says pairface's loss is the plain cross-entropy, so a row whose target is the far side of the sphere reads
    # s * 2 = 128 (the gradient is the same either way: the clamp only touches the logged value).
    pfc = PartialFC(CombinedMarginLoss(m2=0.0), 2, 2).double()
    with torch.no_grad():
        pfc.weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64))
    loss, _ = pfc(torch.tensor([[-1.0, 0.0]], dtype=torch.float64), torch.tensor([0]))
    reference = torch.logsumexp(torch.tensor([-64.0, 64.0], dtype=torch.float64), 0) + 64.0
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12) and loss.item() > -math.log(1e-30)
    assert "1e-30" in (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_extreme_inputs_give_finite_loss_and_gradients():
    torch.manual_seed(2)
    pfc = PartialFC(CombinedMarginLoss(m1=1.2, m2=0.4, m3=0.1), 8, 6)
    with torch.no_grad():
        pfc.weight[3].zero_()  # a zero-norm centre too
    centre = pfc.weight[0].detach()
    emb = torch.stack([centre * 3, -centre, torch.zeros(8), centre, torch.randn(8)]).requires_grad_(True)
    labels = torch.tensor([0, 0, 2, 3, 5])  # cos = 1, cos = -1, zero embedding, zero centre
    loss, _ = pfc([emb, emb * 2], labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(emb.grad).all() and torch.isfinite(pfc.weight.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_autocast_inputs_stay_finite_in_float32(dtype):
    torch.manual_seed(3)
    backbone = torch.nn.Linear(12, 8)
    pfc = PartialFC(CombinedMarginLoss(), 8, 10)
    x = torch.randn(2, 6, 12)
    with torch.autocast("cpu", dtype=dtype):  # the GEMMs in `dtype`, the softmax in float32
        feats = backbone(x.view(12, 12)).view(2, 6, 8)
        loss, _ = pfc([feats[0], feats[1].to(dtype)], torch.arange(6))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert torch.isfinite(backbone.weight.grad).all() and torch.isfinite(pfc.weight.grad).all()


def _bad_label_on_rank_one(rank, world_size):
    pfc = PartialFC(CombinedMarginLoss(), 8, 7)
    labels = torch.tensor([0, 6]) if rank == 0 else torch.tensor([9, 1])
    try:
        pfc(torch.randn(2, 8), labels)
    except ValueError as err:
        return str(err)
    return None


def test_out_of_range_label_raises_on_every_rank_without_hanging(world2):
    for message in [r["bad_label"] for r in world2]:
        assert message is not None and "label 9 (sample 0 on rank 1)" in message and "[0, 7)" in message
        assert "num_classes" in message


def test_negative_label_and_wrong_shapes_are_clear_errors():
    pfc = PartialFC(CombinedMarginLoss(), 8, 7)
    with pytest.raises(ValueError, match=r"label -1 .*outside \[0, 7\)"):
        pfc(torch.randn(2, 8), torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="embedding_size"):
        pfc(torch.randn(2, 5), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="view_weights"):
        PartialFC(CombinedMarginLoss(), 8, 7, view_weights=(1.0,))([torch.randn(2, 8)] * 2, torch.tensor([0, 1]))


def test_class_range_splits_unevenly_and_covers_everything():
    for num_classes, world_size in [(7, 2), (10, 3), (5, 5), (93431, 8)]:
        ranges = [class_range(num_classes, r, world_size) for r in range(world_size)]
        assert ranges[0][0] == 0 and sum(count for _, count in ranges) == num_classes
        assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
        assert max(n for _, n in ranges) - min(n for _, n in ranges) <= 1


def test_repr_names_the_classes_this_rank_holds():
    pfc = PartialFC(CombinedMarginLoss(), 8, 7, sample_rate=0.5)
    assert pfc.extra_repr() == "num_classes=7, local=0..6, embedding_size=8, sample_rate=0.5"


def _small_problem(seed: int = 5):
    torch.manual_seed(seed)
    pfc = PartialFC(CombinedMarginLoss(), 8, 9).double()
    views = [torch.randn(5, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    return pfc, views, torch.tensor([0, 3, 8, 3, 1])


def test_the_loss_gradient_scales_with_the_gradient_it_receives():
    """Training back-propagates a scaled loss (the grad scaler's scale, 1 / gradient_acc)."""
    grads = []
    for factor in (1.0, 2.5):
        pfc, views, labels = _small_problem()
        (factor * pfc(views, labels)[0]).backward()
        grads.append([pfc.weight.grad, *(v.grad for v in views)])
    for plain, scaled in zip(*grads):
        torch.testing.assert_close(scaled, 2.5 * plain, rtol=1e-13, atol=0.0)


def test_frozen_centres_or_frozen_embeddings_still_get_the_other_gradient():
    """Fine-tuning a backbone against fixed centres, or training centres on fixed embeddings."""
    for frozen in ("centres", "embeddings"):
        pfc, views, labels = _small_problem()
        reference_views = [v.detach().clone().requires_grad_(frozen == "centres") for v in views]
        reference_centres = pfc.weight.detach().clone().requires_grad_(frozen == "embeddings")
        dense_reference(reference_views, labels, reference_centres, ARCFACE, SCALE).backward()
        if frozen == "centres":
            pfc.weight.requires_grad_(False)
        else:
            views = [v.detach() for v in views]
        pfc(views, labels)[0].backward()
        if frozen == "centres":
            assert pfc.weight.grad is None
            for mine, theirs in zip(views, reference_views):
                assert_float64_close(mine.grad, theirs.grad, "embedding gradient with frozen centres")
        else:
            assert_float64_close(pfc.weight.grad, reference_centres.grad, "centre gradient with frozen embeddings")


def test_a_second_backward_of_one_forward_is_refused():
    pfc, views, labels = _small_problem()
    loss, _ = pfc(views, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once per forward"):
        loss.backward()


class _GemmDtypes(TorchDispatchMode):
    """Records the input and output dtypes of every matrix product run under it (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default:
            self.seen.append((tuple(args[0].shape), tuple(args[1].shape), args[0].dtype, args[1].dtype, out.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, None])
def test_the_gradient_gemms_run_in_the_autocast_precision_and_the_cosines_in_float32(dtype):
    """Under autocast both gradient GEMMs take half-precision inputs (that is what makes them fast); the
    cosines' GEMM writes float32 (on a CPU, which has no half GEMM with a float32 result: from float32
    inputs); without autocast all three stay float32."""
    torch.manual_seed(6)
    pfc = PartialFC(CombinedMarginLoss(), 8, 10)
    views = [torch.randn(6, 8, requires_grad=True) for _ in range(2)]
    gemms = _GemmDtypes()
    with gemms, torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss, _ = pfc(views, torch.arange(6))
    with gemms:
        loss.backward()
    assert loss.dtype == torch.float32
    by_shape = {(a, b): dtypes for a, b, *dtypes in gemms.seen}
    assert len(gemms.seen) == 3 and sorted(by_shape) == [((10, 12), (12, 8)), ((12, 8), (8, 10)),
                                                         ((12, 10), (10, 8))]
    assert by_shape.pop(((12, 8), (8, 10))) == [torch.float32] * 3  # the cosines: (N, D) @ (D, C)
    expected = dtype or torch.float32
    assert all(a == b == expected for a, b, _ in by_shape.values()), gemms.seen


def _per_view_losses(views, labels, centres, s, round_cos_to=None):
    """Each view's mean ArcFace cross-entropy over a full softmax in float64, written out; `round_cos_to`
    rounds the cosines to that dtype first (what a GEMM writing half precision would hand the softmax)."""
    unit_centres = centres / centres.norm(dim=1, keepdim=True)
    losses = []
    for emb in views:
        cos = (emb / emb.norm(dim=1, keepdim=True)) @ unit_centres.t()
        if round_cos_to is not None:
            cos = cos.to(round_cos_to).double()
        target = cos.gather(1, labels[:, None])
        logits = torch.scatter(s * cos, 1, labels[:, None], s * torch.cos(torch.acos(target) + 0.5))
        losses.append(F.cross_entropy(logits, labels))
    return torch.stack(losses)


def test_under_bf16_autocast_the_softmax_sees_cosines_far_more_exact_than_bfloat16():
    """PartialFC under bfloat16 autocast on the CPU against the float64 reference: its per-view losses
    are off by float32 rounding alone, far less than cosines rounded to bfloat16 (2^-9 of a cosine, a
    quarter of a logit at s = 64) would make them; that larger error is measured here too."""
    torch.manual_seed(11)
    pfc = PartialFC(CombinedMarginLoss(), 8, 30)  # D = 8: cosines of random vectors are large
    views, labels = [torch.randn(64, 8) for _ in range(2)], torch.randint(0, 30, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, per_view = pfc(views, labels)
    exact = [v.double() for v in views], labels, pfc.weight.detach().double(), SCALE
    reference = _per_view_losses(*exact)
    error = (per_view.double() - reference).abs().max().item()
    rounded_error = (_per_view_losses(*exact, round_cos_to=torch.bfloat16) - reference).abs().max().item()
    assert rounded_error > 1e-2
    assert error < rounded_error / 1000, (error, rounded_error)


def test_any_rows_of_the_initial_centres_are_those_of_the_whole_matrix(monkeypatch):
    """Each rank draws only its rows (block by block): any range, across block boundaries, equals the same
    rows of the whole matrix drawn at once, so the centres are the same for any number of processes."""
    monkeypatch.setattr(partial_fc, "INIT_BLOCK_ROWS", 4)
    whole = initial_centres(3, 0, 23, 5)
    assert whole.std().item() == pytest.approx(0.01, rel=0.3) and len({tuple(r.tolist()) for r in whole}) == 23
    for start, count in [(0, 4), (1, 2), (3, 6), (4, 4), (7, 16), (22, 1)]:
        assert torch.equal(initial_centres(3, start, count, 5), whole[start:start + count]), (start, count)
    assert not torch.equal(initial_centres(4, 0, 23, 5), whole)


@pytest.mark.parametrize("sample_rate", [-0.1, 1.5])
def test_a_sample_rate_outside_zero_to_one_is_refused(sample_rate):
    with pytest.raises(ValueError, match="sample_rate"):
        PartialFC(CombinedMarginLoss(), 8, 7, sample_rate=sample_rate)


def test_one_class_per_process_is_enough_and_a_label_equal_to_num_classes_is_out_of_range():
    pfc = PartialFC(CombinedMarginLoss(), 8, 1)
    assert pfc(torch.randn(2, 8), torch.tensor([0, 0]))[0].item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match=r"label 7 \(sample 1 on rank 0\) is outside \[0, 7\)"):
        PartialFC(CombinedMarginLoss(), 8, 7)(torch.randn(2, 8), torch.tensor([6, 7]))


@pytest.mark.parametrize("sample_rate, waits", [
    (1.0, 0),
    (0.25, 0),    # 10 of 40 centres sampled, room for all 6 labels: no need to count the positives
    (0.1, 1),     # 4 sampled centres for up to 6 positives: their number sets the columns
    (0.0, 1),     # only the positives: their number is the number of columns
])
def test_forward_and_backward_wait_for_the_device_only_to_count_positives(sample_rate, waits):
    """Counted as the operations that make a GPU's host wait (bench.host_syncs), with the label check
    deferred as GPU training defers it; the check itself, when not deferred, is the one wait more."""
    for defer in (True, False):
        torch.manual_seed(8)
        pfc = PartialFC(CombinedMarginLoss(interclass_filtering_threshold=0.1), 8, 40, sample_rate=sample_rate,
                        defer_label_check=defer)
        views, labels = [torch.randn(6, 8, requires_grad=True) for _ in range(2)], torch.tensor([0, 3, 3, 17, 25, 39])
        with SyncCounter() as counter:
            pfc(views, labels)[0].backward()
        assert len(counter.syncs) == waits + (not defer), counter.syncs
