"""CombinedMarginLoss against closed-form float64 maths written here, and its edge cases."""
import math

import pytest
import torch

from losses import CombinedMarginLoss

MARGINS = {
    "arcface": (1.0, 0.5, 0.0),
    "cosface": (1.0, 0.0, 0.35),
    "combined": (1.0, 0.3, 0.2),
    "sphereface": (1.35, 0.0, 0.0),
    "all_three": (1.2, 0.4, 0.1),
    "sub_unit_m1": (0.9, 0.0, 0.0),  # theta* = pi / 0.9 lies past pi: never reached, no linear part
}


def closed_form_target(c: float, m1: float, m2: float, m3: float, s: float) -> float:
    theta = math.acos(c)
    theta_star = (math.pi - m2) / m1
    if theta <= theta_star:
        return s * (math.cos(m1 * theta + m2) - m3)
    return s * (c - math.cos(theta_star) - 1.0 - m3)  # the linear continuation past theta*


def closed_form_slope(c: float, m1: float, m2: float, s: float) -> float:
    theta = math.acos(c)
    if theta <= (math.pi - m2) / m1:
        return s * m1 * math.sin(m1 * theta + m2) / math.sin(theta)
    return s


def random_problem(n=6, c=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cos = torch.rand(n, c, generator=gen, dtype=torch.float64) * 1.9 - 0.95
    labels = torch.randint(0, c, (n,), generator=gen)
    labels[1] = -1  # a row whose target lives elsewhere
    return cos, labels


@pytest.mark.parametrize("name", MARGINS)
def test_values_match_closed_form(name):
    m1, m2, m3 = MARGINS[name]
    cos, labels = random_problem()
    logits = CombinedMarginLoss(64.0, m1, m2, m3)(cos, labels)
    for i in range(cos.shape[0]):
        for j in range(cos.shape[1]):
            if labels[i] == j:
                expected = closed_form_target(cos[i, j].item(), m1, m2, m3, 64.0)
            else:
                expected = 64.0 * cos[i, j].item()
            assert logits[i, j].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name", MARGINS)
def test_gradient_is_the_true_derivative(name):
    m1, m2, m3 = MARGINS[name]
    margin = CombinedMarginLoss(64.0, m1, m2, m3)
    cos, labels = random_problem(seed=1)
    cos.requires_grad_(True)
    upstream = torch.randn(cos.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (margin(cos, labels) * upstream).sum().backward()
    for i in range(cos.shape[0]):
        for j in range(cos.shape[1]):
            slope = closed_form_slope(cos[i, j].item(), m1, m2, 64.0) if labels[i] == j else 64.0
            assert cos.grad[i, j].item() == pytest.approx(slope * upstream[i, j].item(), rel=1e-9, abs=1e-12)
    assert torch.autograd.gradcheck(lambda c: margin(c, labels), (cos.detach().requires_grad_(True),))


@pytest.mark.parametrize("name", MARGINS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_finite_and_monotonic_on_all_of_minus_one_to_one(name, dtype):
    margin = CombinedMarginLoss(64.0, *MARGINS[name])
    grid = torch.linspace(-1.0, 1.0, 4001, dtype=torch.float64).to(dtype)
    grid = torch.cat([grid, torch.tensor([-1.0, 1.0, -1 + 1e-7, 1 - 1e-7], dtype=dtype)]).unique()
    cos = grid.clone().requires_grad_(True)
    target = margin.target_logit(cos)
    target.sum().backward()
    assert torch.isfinite(target).all() and torch.isfinite(cos.grad).all()
    assert (cos.grad >= 0).all(), "the target logit must never fall as its cosine rises"
    steps = target.detach().double().diff()
    assert (steps >= -1e-3 * 64).all() if dtype == torch.float16 else (steps >= -1e-9).all()


def test_past_theta_star_the_logit_keeps_rising():
    margin = CombinedMarginLoss(64.0, 1.0, 0.5, 0.0)
    theta = torch.tensor([math.pi - 0.4, math.pi - 0.2, math.pi - 0.01], dtype=torch.float64)
    values = margin.target_logit(torch.cos(theta))
    assert (values.diff() < 0).all()  # larger angle, lower logit, unlike cos(theta + m) would give


def test_straight_through_keeps_the_value_and_passes_s_as_gradient():
    cos, labels = random_problem(seed=3)
    exact = CombinedMarginLoss(64.0, 1.0, 0.5, 0.0)
    straight = CombinedMarginLoss(64.0, 1.0, 0.5, 0.0, straight_through=True)
    leaf = cos.clone().requires_grad_(True)
    logits = straight(leaf, labels)
    assert torch.allclose(logits, exact(cos, labels), rtol=0, atol=1e-12)
    logits.sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(cos, 64.0))


def test_interclass_filtering_zeroes_confusable_negatives_only():
    cos = torch.tensor([[0.9, 0.5, 0.1], [0.95, 0.2, 0.7]], dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, -1])
    margin = CombinedMarginLoss(64.0, 1.0, 0.0, 0.35, interclass_filtering_threshold=0.4)
    logits = margin(cos, labels)
    expected = torch.tensor([[64 * (0.9 - 0.35), 0.0, 6.4], [0.0, 12.8, 0.0]], dtype=torch.float64)
    assert torch.allclose(logits, expected)
    logits.sum().backward()
    assert torch.equal(cos.grad, torch.tensor([[64.0, 0.0, 64.0], [0.0, 64.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("kwargs", [dict(s=0), dict(s=-1), dict(m1=0), dict(m2=-0.1), dict(m2=math.pi), dict(m2=3.2)])
def test_invalid_parameters_are_refused(kwargs):
    with pytest.raises(ValueError, match="must"):
        CombinedMarginLoss(**kwargs)


@pytest.mark.parametrize("name", MARGINS)
def test_target_logit_on_both_sides_of_theta_star_matches_closed_form(name):
    """The whole range of the target cosine, the linear continuation past theta* included (random cosines
    rarely get there); the target logit keeps its input's dtype."""
    m1, m2, m3 = MARGINS[name]
    margin = CombinedMarginLoss(64.0, m1, m2, m3)
    grid = torch.linspace(-0.999, 0.999, 201, dtype=torch.float64)
    values = margin.target_logit(grid)
    expected = [closed_form_target(c, m1, m2, m3, 64.0) for c in grid.tolist()]
    assert values.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert any(math.acos(c) > (math.pi - m2) / m1 for c in grid.tolist()) == (name not in ("cosface", "sub_unit_m1"))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert margin.target_logit(grid.to(dtype)).dtype == dtype


def test_cosface_is_exact_up_to_plus_and_minus_one():
    """Without an angular margin (m1 = 1, m2 = 0) the target logit is s * (cos - m3) itself, with slope s:
    no acos, so no clamping near +-1."""
    margin = CombinedMarginLoss(64.0, 1.0, 0.0, 0.35)
    cos = torch.tensor([-1.0, -1 + 1e-12, 0.3, 1 - 1e-12, 1.0], dtype=torch.float64, requires_grad=True)
    logits = margin.target_logit(cos)
    assert torch.equal(logits, 64.0 * (cos.detach() - 0.35))
    logits.sum().backward()
    assert torch.equal(cos.grad, torch.full_like(cos, 64.0))


def test_a_cosine_equal_to_the_filtering_threshold_is_kept():
    """arcface_torch drops negatives strictly above the threshold."""
    margin = CombinedMarginLoss(64.0, 1.0, 0.0, 0.0, interclass_filtering_threshold=0.5)
    cos = torch.tensor([[0.9, 0.5, 0.75]], dtype=torch.float64)
    assert margin.filtered(cos, torch.tensor([0])).tolist() == [[False, False, True]]
    assert margin(cos, torch.tensor([0])).tolist() == [[64 * 0.9, 32.0, 0.0]]


@pytest.mark.parametrize("kwargs", [dict(s=1.0), dict(s=0.5), dict(m1=0.5), dict(m2=0.0), dict(m2=3.14)])
def test_valid_parameters_at_the_edges_are_accepted(kwargs):
    CombinedMarginLoss(**kwargs)


def test_filtering_is_off_by_default():
    """Nothing is filtered, not even a cosine that rounding pushed past 1."""
    margin = CombinedMarginLoss(64.0, 1.0, 0.0, 0.0)
    cos = torch.tensor([[0.2, 1.0, 1.0 + 1e-12]], dtype=torch.float64)
    assert margin.interclass_filtering_threshold == 0.0 and not margin.straight_through
    assert margin(cos, torch.tensor([0])).tolist() == [[64 * 0.2, 64.0, 64 * (1.0 + 1e-12)]]
