"""crop_scale and erase_p (facedata/crop_erase.py): each operation against an independent reference
(PIL's crop and bilinear resize, a numpy rectangle), the draws' ranges and rates, their place in the
sample's stream, determinism per (seed, epoch, index), defaults that leave a sample bitwise as it
was, batches equal to their views one at a time, and the config's one-line refusals."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from PIL import Image

from dataset import build_dataset, build_loader, render_faces
from facedata.augment import SampleRandom, coins
from facedata.crop_erase import CropErase, crop_resize, draw_crop_erase, erase, resize, resize_in_float
from facedata.dali_aug import dali_augment, draw_augments
from utils.config import ConfigError, load_config

SIZE = 112


def faces(n: int = 3) -> torch.Tensor:
    """(n, 3, 112, 112) uint8 faces with noise added, so that a wrong pixel shows."""
    rng = np.random.default_rng(0)
    pixels = render_faces(range(n), 0, seed=2).astype(np.float64) + rng.normal(0, 12, (n, SIZE, SIZE, 3))
    return torch.from_numpy(np.clip(np.rint(pixels), 0, 255).astype(np.uint8)).permute(0, 3, 1, 2).contiguous()


def pil_crop_resize(view: torch.Tensor, top: int, left: int, side: int) -> np.ndarray:
    """The reference: PIL's crop, then its bilinear resize to 112 x 112 (torchvision's antialiased bilinear
    is a port of it), (3, H, W) int."""
    image = Image.fromarray(view.permute(1, 2, 0).numpy())
    resized = image.crop((left, top, left + side, top + side)).resize((SIZE, SIZE), Image.BILINEAR)
    return np.asarray(resized).transpose(2, 0, 1).astype(int)


CROPS = [(0, 0, 60), (52, 52, 60), (5, 17, 90), (0, 21, 91), (1, 0, 111), (0, 0, 1)]


def test_crop_is_pils_crop_and_bilinear_resize():
    views = faces(len(CROPS))
    out = crop_resize(views.clone(), [CropErase(crop=crop) for crop in CROPS])
    for n, crop in enumerate(CROPS):
        difference = np.abs(out[n].numpy().astype(int) - pil_crop_resize(views[n], *crop))
        # both round fixed-point sums, each its own way: a level, now and then
        assert difference.max() <= 1 and (difference > 0).mean() < 0.03, crop


def test_resize_is_torchvisions():
    import torchvision.transforms.v2.functional as tvf  # noqa: PLC0415 (a second to import)

    generator = torch.Generator().manual_seed(1)
    for side in (1, 56, 89, 111):
        squares = torch.randint(0, 256, (2, 3, side, side), dtype=torch.uint8, generator=generator)
        assert torch.equal(resize(squares, SIZE, SIZE), tvf.resize(squares, [SIZE, SIZE], antialias=True))


def test_the_gpus_float_resize_is_the_cpus_within_a_level_and_batch_invariant():
    """The path a GPU takes, run here on the CPU: a level off now and then, and a batch is its views."""
    squares = faces(4)[:, :, 3:93, 10:100]
    in_float, in_uint8 = resize_in_float(squares, SIZE, SIZE), resize(squares, SIZE, SIZE)
    difference = (in_float.int() - in_uint8.int()).abs()
    assert difference.max() <= 1 and (difference > 0).float().mean() < 0.3
    assert all(torch.equal(in_float[n:n + 1], resize_in_float(squares[n:n + 1], SIZE, SIZE)) for n in range(4))


def test_crop_shows_the_square_it_names():
    """What the crop means, seen without any resampling: a 56-pixel square doubled back to 112 holds
    the square's pixels at even positions up to bilinear's quarter-pixel blend; a shifted one does not."""
    views = faces(1)
    top, left = 30, 8
    out = crop_resize(views.clone(), [CropErase(crop=(top, left, 56))])[0].numpy().astype(float)
    square = views[0, :, top:top + 56, left:left + 56].numpy().astype(float)
    inner = out[:, 2:-2:2, 2:-2:2]
    # output pixel 2k samples the square at k - 0.25: 0.75 of pixel k, 0.25 of pixel k - 1, in each axis
    blended = 0.75 * 0.75 * square[:, 1:-1, 1:-1] + 0.75 * 0.25 * (square[:, :-2, 1:-1] + square[:, 1:-1, :-2]) \
        + 0.25 * 0.25 * square[:, :-2, :-2]
    assert np.abs(inner - blended).max() <= 1.5  # two rounded passes
    shifted = views[0, :, top + 4:top + 60, left:left + 56].numpy().astype(float)
    wrong = 0.75 * 0.75 * shifted[:, 1:-1, 1:-1] + 0.75 * 0.25 * (shifted[:, :-2, 1:-1] + shifted[:, 1:-1, :-2]) \
        + 0.25 * 0.25 * shifted[:, :-2, :-2]
    assert np.abs(inner - wrong).mean() > 5.0


def test_erase_is_a_black_rectangle():
    views = faces(3)
    rectangles = [(0, 0, 112, 6), (40, 50, 20, 62), None]
    out = erase(views.clone(), [CropErase(erase=r) for r in rectangles])
    want = views.numpy().copy()
    for n, rectangle in enumerate(rectangles):
        if rectangle is not None:
            top, left, height, width = rectangle
            want[n, :, top:top + height, left:left + width] = 0
    assert np.array_equal(out.numpy(), want)


def test_a_batch_is_its_views_one_at_a_time():
    """The batched decoding path augments a whole batch in one call, the workers a sample's views: the same."""
    views = faces(6)
    draws = [CropErase(crop=(0, 0, 90), erase=(3, 4, 20, 30)), CropErase(), CropErase(crop=(10, 12, 90)),
             CropErase(crop=(2, 1, 70), erase=(90, 100, 22, 12)), CropErase(erase=(0, 0, 5, 5)),
             CropErase(crop=(20, 22, 90))]
    batch = erase(crop_resize(views.clone(), draws), draws)
    for n, draw in enumerate(draws):
        assert torch.equal(batch[n:n + 1], erase(crop_resize(views[n:n + 1].clone(), [draw]), [draw]))


def drawn(samples: int, crop_scale=(0.5, 0.9), erase_p=0.3, views: int = 2) -> list[list[CropErase]]:
    return [draw_crop_erase(SampleRandom(7, epoch=2, index=i), views, crop_scale, erase_p, SIZE)
            for i in range(samples)]


def within_binomial(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))


def test_crop_draws_cover_the_range_uniformly_and_every_position():
    draws = [d for sample in drawn(10000) for d in sample]
    assert all(d.crop is not None for d in draws)
    tops, lefts, sides = np.array([d.crop for d in draws]).T
    area = (sides / SIZE) ** 2
    step = 2 * math.sqrt(0.9) / SIZE  # one pixel more or less on the side
    assert 0.5 - step < area.min() < 0.5 + step and 0.9 - step < area.max() < 0.9 + step
    assert abs(area.mean() - 0.7) < 0.005  # uniform in area, as torchvision's RandomResizedCrop
    assert tops.min() == lefts.min() == 0 and (tops + sides).max() == (lefts + sides).max() == SIZE
    assert (tops + sides <= SIZE).all() and (lefts + sides <= SIZE).all()
    spot = (tops + 0.5) / (SIZE - sides + 1)  # each of the SIZE - side + 1 positions alike: about uniform in (0, 1)
    assert abs(spot.mean() - 0.5) < 0.01 and abs(spot.var() - 1 / 12) < 0.003
    across = (lefts + 0.5) / (SIZE - sides + 1)  # the top and the left drawn independently
    assert abs(np.corrcoef(spot, across)[0, 1]) < 4.5 / math.sqrt(len(draws))


def test_erase_draws_honour_p_and_torchvisions_ranges():
    draws = [d for sample in drawn(10000) for d in sample]
    rectangles = np.array([d.erase for d in draws if d.erase is not None])
    assert within_binomial(len(rectangles), len(draws), 0.3)
    tops, lefts, heights, widths = rectangles.T
    area, ratio = heights * widths / SIZE ** 2, heights / widths
    assert 0.02 * 0.9 < area.min() < 0.021 and 0.32 < area.max() < 0.33 * 1.05
    assert 0.3 * 0.9 < ratio.min() < 0.32 and 3.1 < ratio.max() < 3.3 * 1.1
    assert abs(np.median(np.log(ratio))) < 0.05  # log-uniform: as often tall as wide
    assert (tops >= 0).all() and (lefts >= 0).all()
    assert (tops + heights <= SIZE).all() and (lefts + widths <= SIZE).all()
    for p, expected in ((0.0, 0), (1.0, len(draws))):
        assert sum(d.erase is not None for s in drawn(10000, erase_p=p) for d in s) == expected


def test_views_draw_independently_and_each_key_leaves_the_others_draws():
    samples = drawn(10000)
    both = sum(first.erase is not None and second.erase is not None for first, second in samples)
    assert within_binomial(both, len(samples), 0.3 * 0.3)
    sides = np.array([[view.crop[2] for view in sample] for sample in samples])
    assert abs(np.corrcoef(sides.T)[0, 1]) < 4.5 / math.sqrt(len(samples))
    # crop on or off, the erasings are the same; erasing on or off, the crops are the same
    no_crop, no_erase = drawn(10000, crop_scale=(1.0, 1.0)), drawn(10000, erase_p=0.0)
    assert [d.erase for s in no_crop for d in s] == [d.erase for s in samples for d in s]
    assert [d.crop for s in no_erase for d in s] == [d.crop for s in samples for d in s]
    assert all(d.crop is None for s in no_crop for d in s)


def test_draws_are_a_function_of_seed_epoch_and_index():
    def draws(seed, epoch, index):
        return draw_crop_erase(SampleRandom(seed, epoch, index), 2, (0.6, 1.0), 0.5, SIZE)
    assert draws(1, 2, 3) == draws(1, 2, 3)
    assert len({str(draws(*key)) for key in [(1, 2, 3), (1, 2, 4), (1, 3, 3), (2, 2, 3)]}) == 4


NUM_SAMPLES = 24


@pytest.fixture(scope="module")
def pair_rec(pair_records) -> str:
    return pair_records(NUM_SAMPLES, seed=3)


def test_defaults_leave_a_sample_bitwise_as_before(pair_rec):
    """Off (the defaults, or given explicitly): no draw is made, and a sample is its flipped views (and,
    with dali_aug, those augmented) computed here from the source, as before the keys existed."""
    for dali_aug in (False, True):
        default = build_dataset(pair_rec, num_views=2, seed=5, dali_aug=dali_aug)
        explicit = build_dataset(pair_rec, num_views=2, seed=5, dali_aug=dali_aug, crop_scale=(1.0, 1.0),
                                 erase_p=0.0)
        for epoch in range(2):
            for index in range(NUM_SAMPLES):
                image, _ = default.source.load(index)
                rng = SampleRandom(5, epoch, index)
                flips = coins(rng, 2)
                want = torch.stack([torch.as_tensor(np.asarray(v)) for v in default.cut(image, index)])
                want = torch.where(torch.tensor(flips)[:, None, None, None], want.flip(-1), want).contiguous()
                if dali_aug:
                    want = dali_augment(want, draw_augments(rng, 2))
                assert torch.equal(default.load(index, epoch)[0], want)
                assert torch.equal(explicit.load(index, epoch)[0], want)
                assert default.encoded(index, epoch).crop_erase is None


def test_dataset_crops_before_dali_aug_and_erases_after_with_the_draws_after_dali_augs(pair_rec):
    plain = build_dataset(pair_rec, num_views=2, seed=5)
    augmented = build_dataset(pair_rec, num_views=2, seed=5, dali_aug=True, crop_scale=(0.6, 0.95), erase_p=0.5)
    erased = 0
    for epoch in range(2):
        for index in range(NUM_SAMPLES):
            rng = SampleRandom(5, epoch, index)
            rng.bits()  # the two flip coins of a sample come from one draw
            augments = draw_augments(rng, 2)
            draws = draw_crop_erase(rng, 2, (0.6, 0.95), 0.5, SIZE)
            want = erase(dali_augment(crop_resize(plain.load(index, epoch)[0], draws), augments), draws)
            assert torch.equal(augmented.load(index, epoch)[0], want)
            assert augmented.encoded(index, epoch).crop_erase == draws
            erased += sum(d.erase is not None for d in draws)
    assert 0 < erased < 4 * NUM_SAMPLES


def test_batches_do_not_depend_on_workers_or_resume(pair_rec):
    ds = build_dataset(pair_rec, num_views=2, seed=9, crop_scale=(0.7, 1.0), erase_p=0.5)
    uninterrupted = [batch for step in build_loader(ds, 4, seed=1, num_workers=0).steps(0, 12) for batch in step]
    with_workers = [batch for step in build_loader(ds, 4, seed=1, num_workers=2).steps(0, 12) for batch in step]
    resumed = [batch for step in build_loader(ds, 4, seed=1, num_workers=1).steps(8, 12) for batch in step]
    for got, want in zip(with_workers + resumed, uninterrupted + uninterrupted[8:], strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("overrides, fragment", [
    (["crop_scale=(0.0, 1.0)"], "config key 'crop_scale' must be two area fractions (low, high) with "
                                "0 < low <= high <= 1, not (0.0, 1.0); e.g. crop_scale=(0.7, 1.0)"),
    (["crop_scale=(0.9, 0.8)"], "not (0.9, 0.8)"),
    (["crop_scale=(0.7, 1.2)"], "not (0.7, 1.2)"),
    (["crop_scale=(0.7,)"], "not (0.7,)"),
    (["erase_p=1.5"], "config key 'erase_p' is a probability and must be in [0, 1], not 1.5; e.g. erase_p=0.5"),
    (["erase_p=-0.1"], "not -0.1"),
])
def test_bad_values_are_refused_in_one_line(tmp_path, overrides, fragment):
    config = tmp_path / "c.py"
    config.write_text("")
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        load_config(config, overrides)
    assert "\n" not in str(info.value)


def test_keys_parse_to_their_types(tmp_path):
    config = tmp_path / "c.py"
    config.write_text("crop_scale = [0.7, 1]\n")
    cfg = load_config(config, ["erase_p=1"])
    assert cfg.crop_scale == (0.7, 1.0) and cfg.erase_p == 1.0
    assert load_config(config, ["crop_scale=(1, 1)"]).crop_scale == (1.0, 1.0)
