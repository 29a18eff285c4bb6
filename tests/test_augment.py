"""dali_aug: each operation against an independent float64 reference, the coins' rates, per-view
independence, and batches that do not depend on workers or resume."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dataset import build_dataset, build_loader, render_faces
from facedata.augment import SampleRandom
from facedata.dali_aug import (
    ViewAugment,
    dali_augment,
    draw_augments,
    gaussian_blur,
    grey,
    hue_saturation,
    low_resolution,
)

# DALI's hsv.h matrices, typed from upstream (not imported from the code under test).
DALI_RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.321], [0.211, -0.523, 0.311]])
DALI_YIQ_TO_RGB = np.array([[1.0, 0.956, 0.621], [1.0, -0.272, -0.647], [1.0, -1.107, 1.705]])
DALI_SIGMA = {3: 0.8, 5: 1.1}  # gaussian_blur docs: sigma = (radius - 1) * 0.3 + 0.8


def faces(n: int = 3) -> torch.Tensor:
    """(n, 3, 112, 112) uint8 faces with noise added, so that every frequency carries energy."""
    rng = np.random.default_rng(0)
    pixels = render_faces(range(n), 0, seed=2).astype(np.float64) + rng.normal(0, 12, (n, 112, 112, 3))
    return torch.from_numpy(np.clip(np.rint(pixels), 0, 255).astype(np.uint8)).permute(0, 3, 1, 2).contiguous()


def as_float(views: torch.Tensor) -> np.ndarray:
    return views.numpy().astype(np.float64)


def assert_within_rounding(got: torch.Tensor, want: np.ndarray):
    """uint8 result vs a float reference: off by at most one level (a tie rounded the other way), and rarely."""
    difference = np.abs(as_float(got) - np.clip(np.rint(want), 0, 255))
    assert difference.max() <= 1 and (difference > 0).mean() < 0.002


def band_energy(views: torch.Tensor, low: float, high: float) -> float:
    """Spectral energy of the mean-free images between ``low`` and ``high`` cycles per image."""
    pixels = as_float(views)
    spectrum = np.abs(np.fft.fft2(pixels - pixels.mean(axis=(-2, -1), keepdims=True))) ** 2
    frequency = np.fft.fftfreq(pixels.shape[-1]) * pixels.shape[-1]
    radius = np.hypot(*np.meshgrid(frequency, frequency, indexing="ij"))
    return float(spectrum[..., (radius >= low) & (radius < high)].sum())


@pytest.mark.parametrize("side", [56, 89])
def test_low_resolution_loses_the_high_frequencies_and_keeps_size_and_mean(side):
    views = faces()
    out = low_resolution(views.clone(), side)
    assert out.shape == views.shape and out.dtype == torch.uint8
    assert np.abs(as_float(out).mean(axis=(-2, -1)) - as_float(views).mean(axis=(-2, -1))).max() < 1.0
    # Above the small copy's Nyquist frequency (side / 2 cycles per image) most energy is gone (the
    # rest is bilinear enlarging's imperfect reconstruction); well below it, the picture is what it was.
    assert band_energy(out, side / 2, 200) < 0.15 * band_energy(views, side / 2, 200)
    assert band_energy(out, 0, side / 8) == pytest.approx(band_energy(views, 0, side / 8), rel=0.05)


@pytest.mark.parametrize("window", [3, 5])
def test_gaussian_blur_is_dalis_kernel_with_mirrored_borders(window):
    views = faces()
    radius, sigma = window // 2, DALI_SIGMA[window]
    taps = np.exp(-np.arange(-radius, radius + 1) ** 2 / (2 * sigma ** 2))
    kernel = np.outer(taps, taps) / taps.sum() ** 2
    padded = np.pad(as_float(views), ((0, 0), (0, 0), (radius, radius), (radius, radius)), mode="reflect")
    want = sum(kernel[dy, dx] * padded[..., dy:dy + 112, dx:dx + 112]
               for dy in range(window) for dx in range(window))
    assert_within_rounding(gaussian_blur(views.clone(), window), want)


@pytest.mark.parametrize("hue, saturation", [(0.0, 1.0), (7.5, 1.0), (19.9, 1.19), (0.0, 1.2)])
def test_hue_saturation_is_dalis_yiq_rotation_and_scaling(hue, saturation):
    views = faces()
    yiq = np.einsum("ck,nkhw->nchw", DALI_RGB_TO_YIQ, as_float(views))
    angle = math.radians(hue)
    i, q = yiq[:, 1].copy(), yiq[:, 2].copy()
    yiq[:, 1] = saturation * (math.cos(angle) * i + math.sin(angle) * q)
    yiq[:, 2] = saturation * (-math.sin(angle) * i + math.cos(angle) * q)
    want = np.einsum("ck,nkhw->nchw", DALI_YIQ_TO_RGB, yiq)
    assert_within_rounding(hue_saturation(views.clone(), [hue] * 3, [saturation] * 3), want)


def test_hue_saturation_turns_and_scales_chroma_and_keeps_luma():
    """What the transform means: luma stays, chroma (I, Q) turns by the hue and grows by the saturation."""
    views = faces(1)
    out = hue_saturation(views.clone(), [15.0], [1.1])
    before, after = (np.einsum("ck,nkhw->nchw", DALI_RGB_TO_YIQ, as_float(v)) for v in (views, out))
    unclipped = (as_float(out) > 0).all(axis=1) & (as_float(out) < 255).all(axis=1)
    assert np.abs(after[:, 0] - before[:, 0])[unclipped].max() < 2.0
    chroma_before, chroma_after = before[:, 1] + 1j * before[:, 2], after[:, 1] + 1j * after[:, 2]
    strong = unclipped & (np.abs(chroma_before) > 30)
    ratio = chroma_after[strong] / chroma_before[strong]
    assert np.median(np.abs(ratio)) == pytest.approx(1.1, abs=0.02)
    assert np.median(-np.angle(ratio, deg=True)) == pytest.approx(15.0, abs=1.0)


def test_grey_is_the_luma_in_every_channel():
    views = faces()
    out = grey(views.clone())
    pixels = as_float(views)
    luma = 0.299 * pixels[:, 0] + 0.587 * pixels[:, 1] + 0.114 * pixels[:, 2]
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 1], out[:, 2])
    assert_within_rounding(out[:, :1], luma[:, None])


def test_augment_applies_each_views_own_operations_in_upstreams_order():
    views = faces(4)
    augments = [ViewAugment(), ViewAugment(low_res=64, blur=5), ViewAugment(hue_saturation=(10.0, 1.1), grey=True),
                ViewAugment(blur=3, hue_saturation=(3.0, 1.05))]
    out = dali_augment(views.clone(), augments)
    assert torch.equal(out[0], views[0])
    assert torch.equal(out[1:2], gaussian_blur(low_resolution(views[1:2].clone(), 64), 5))
    assert torch.equal(out[2:3], grey(hue_saturation(views[2:3].clone(), [10.0], [1.1])))
    assert torch.equal(out[3:4], hue_saturation(gaussian_blur(views[3:4].clone(), 3), [3.0], [1.05]))


def within_binomial(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))


def drawn(samples: int, views: int = 2) -> list[list[ViewAugment]]:
    return [draw_augments(SampleRandom(11, epoch=3, index=i), views) for i in range(samples)]


COINS = {"low_res": (lambda a: a.low_res is not None, 0.1), "blur": (lambda a: a.blur is not None, 0.2),
         "colour": (lambda a: a.hue_saturation is not None, 0.2), "grey": (lambda a: a.grey, 0.1)}


def test_rates_and_ranges_are_upstreams():
    augments = [a for sample in drawn(20000) for a in sample]
    n = len(augments)
    for name, (happens, p) in COINS.items():
        assert within_binomial(sum(map(happens, augments)), n, p), name
    sides = np.array([a.low_res for a in augments if a.low_res is not None])
    assert sides.min() == 56 and sides.max() == 89 and abs(sides.mean() - 72.5) < 0.6
    windows = [a.blur for a in augments if a.blur is not None]
    assert set(windows) == {3, 5} and within_binomial(windows.count(5), len(windows), 0.5)
    hues, saturations = np.array([a.hue_saturation for a in augments if a.hue_saturation is not None]).T
    assert 0 <= hues.min() < 0.1 and 19.9 < hues.max() < 20 and 1 <= saturations.min() and saturations.max() < 1.2


def test_views_draw_independently():
    samples = drawn(20000)
    n = len(samples)
    for name, (happens, p) in COINS.items():
        both = sum(happens(first) and happens(second) for first, second in samples)
        assert within_binomial(both, n, p * p), name
    first_hues = [s[0].hue_saturation for s in samples if s[0].hue_saturation and s[1].hue_saturation]
    second_hues = [s[1].hue_saturation for s in samples if s[0].hue_saturation and s[1].hue_saturation]
    assert abs(np.corrcoef(np.array(first_hues)[:, 0], np.array(second_hues)[:, 0])[0, 1]) < 4.5 / math.sqrt(
        len(first_hues))


NUM_SAMPLES = 24


@pytest.fixture(scope="module")
def pair_rec(pair_records) -> str:
    return pair_records(NUM_SAMPLES, seed=3)


def test_dataset_adds_each_views_draws_after_the_flip(pair_rec):
    """With dali_aug the flips stay as they were; a view whose coins all say no is the plain view."""
    plain = build_dataset(pair_rec, num_views=2, seed=5)
    augmented = build_dataset(pair_rec, num_views=2, seed=5, dali_aug=True)
    untouched = changed = 0
    for epoch in range(3):
        for index in range(NUM_SAMPLES):
            want, got = plain.load(index, epoch)[0], augmented.load(index, epoch)[0]
            rng = SampleRandom(5, epoch, index)
            rng.bits()  # the two flip coins of a sample come from one draw
            for view, aug in enumerate(draw_augments(rng, 2)):
                expected = dali_augment(want[view:view + 1].clone(), [aug])
                assert torch.equal(got[view:view + 1], expected)
                untouched += aug == ViewAugment()
                changed += not torch.equal(got[view], want[view])
    assert untouched > 0 and changed > 0


def test_batches_do_not_depend_on_workers_or_resume(pair_rec):
    ds = build_dataset(pair_rec, num_views=2, seed=9, dali_aug=True)
    uninterrupted = [batch for step in build_loader(ds, 4, seed=1, num_workers=0).steps(0, 12) for batch in step]
    with_workers = [batch for step in build_loader(ds, 4, seed=1, num_workers=2).steps(0, 12) for batch in step]
    resumed = [batch for step in build_loader(ds, 4, seed=1, num_workers=1).steps(8, 12) for batch in step]
    for got, want in zip(with_workers + resumed, uninterrupted + uninterrupted[8:]):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    plain = [batch for step in build_loader(build_dataset(pair_rec, num_views=2, seed=9), 4, seed=1,
                                            num_workers=0).steps(0, 12) for batch in step]
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(uninterrupted, plain))
