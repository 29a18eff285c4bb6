"""PartialFC against a dense single-process float64 reference, on 1 and 2 real gloo processes.

The reference (tools/check_pfc.dense_reference) is a plain full-softmax cross-entropy written
with F.cross_entropy and the closed-form margin; it shares no code with partial_fc.py.
"""
import pytest
import torch

from losses import CombinedMarginLoss
from partial_fc import PartialFC, class_range
from tests.distributed_helpers import run_world
from tools.check_pfc import dense_reference, run_check

TOLERANCE = 1e-5
ARCFACE, COSFACE = (1.0, 0.5, 0.0), (1.0, 0.0, 0.35)
CASES = [(views, margin) for views in (1, 2, 3) for margin in (ARCFACE, COSFACE)]


def _check_all_cases(rank, world_size, num_classes, sample_rate):
    return [run_check(views, num_classes, batch=4, embedding_size=16, margin=margin, sample_rate=sample_rate,
                      dtype=torch.float64, device=torch.device("cpu"), seed=views)
            for views, margin in CASES]


def _assert_exact(per_rank_results):
    for (views, margin), errors in zip(CASES, per_rank_results[0]):
        assert errors, "rank 0 reports the comparison"
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOLERANCE, f"{views} views, margin {margin}: {worst} off by {errors[worst]:.2e}"


def _everything_distributed(rank, world_size):
    """All multi-process facts from one spawn: starting processes costs more than the checks."""
    return dict(exact=_check_all_cases(rank, world_size, 7, 1.0),
                sampled=_check_all_cases(rank, world_size, 41, 0.3),
                sampling=_sampling_facts(rank, world_size),
                bad_label=_bad_label_on_rank_one(rank, world_size))


@pytest.fixture(scope="module")
def world2():
    return run_world(_everything_distributed, 2)


@pytest.fixture(scope="module")
def world1():
    return run_world(_everything_distributed, 1)


def test_world1_without_process_group_equals_dense_reference():
    _assert_exact([_check_all_cases(0, 1, 7, 1.0)])


def test_world1_ddp_equals_dense_reference(world1):
    _assert_exact([r["exact"] for r in world1])
    _assert_exact([r["sampled"] for r in world1])


def test_world2_ddp_gradients_equal_dense_reference(world2):
    """7 classes on 2 ranks: shards of 4 and 3 centres."""
    _assert_exact([r["exact"] for r in world2])


def test_sampled_loss_equals_reference_restricted_to_the_subset(world2):
    _assert_exact([r["sampled"] for r in world2])


def _sampling_facts(rank, world_size):
    torch.manual_seed(100 + rank)
    num_classes, batch = 40, 3
    pfc = PartialFC(CombinedMarginLoss(), 8, num_classes, sample_rate=0.25).double()
    labels = torch.tensor([[1, 5, 5], [30, 22, 1]])[rank % 2]
    views = [torch.randn(batch, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    pfc(views, labels)[0].backward()
    start, count = class_range(num_classes, rank, world_size)
    grad_rows_nonzero = (pfc.weight.grad != 0).any(dim=1).nonzero().squeeze(1) + start
    return dict(sampled=pfc.last_sampled_classes.tolist(), start=start, count=count,
                grad_rows=grad_rows_nonzero.tolist(), zero_elsewhere=_zero_outside(pfc, start))


def _zero_outside(pfc, start):
    mask = torch.ones(pfc.num_local, dtype=torch.bool)
    mask[pfc.last_sampled_classes - start] = False
    return bool((pfc.weight.grad[mask] == 0).all())


def test_sampling_keeps_every_positive_and_leaves_the_rest_untouched(world2):
    results = [r["sampling"] for r in world2]
    positives = {1, 5, 30, 22}
    for r in results:
        mine = {c for c in positives if r["start"] <= c < r["start"] + r["count"]}
        assert mine <= set(r["sampled"])
        assert len(r["sampled"]) == max(int(0.25 * r["count"]), len(mine))
        assert r["sampled"] == sorted(set(r["sampled"]))
        assert set(r["grad_rows"]) <= set(r["sampled"])
        assert r["zero_elsewhere"], "centres outside the sampled subset must get exactly zero gradient"


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
        assert message is not None and "label 9" in message and "[0, 7)" in message and "num_classes" in message


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
