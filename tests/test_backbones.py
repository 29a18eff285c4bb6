"""Backbones: arcface_torch's exact state_dicts and outputs, sane forward/backward, precision, fusion, DDP.

References: the upstream state_dict fixtures (keys, shapes, dtypes, parameter counts written by
arcface_torch itself), embeddings computed by arcface_torch's own code (fixtures/golden, see its
README), the option values arcface_torch's get_model passes, float64 functional re-derivations of
upstream's block and attention maths, and plain single-process autograd for the checkpointing and
DDP checks.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from backbones import NETWORKS, fuse_batchnorm, get_model, read_face_image, read_state_dict, suggest_network
from backbones.iresnet import IBasicBlock, IResNet
from backbones.trained import load_saved_backbone, save_backbone
from backbones.vit import Attention
from dataset import Preparation
from tests.distributed_helpers import run_world
from training.state import ddp_backbone
from utils.errors import ConfigError, UserError

FIXTURES = Path(__file__).parent / "fixtures"
UPSTREAM = {
    name: entry
    for file in ("backbone_state_dicts.json", "backbone_state_dicts_more.json")
    for name, entry in json.loads((FIXTURES / "upstream" / file).read_text()).items()
}
UPSTREAM_NAMES = sorted(UPSTREAM)  # arcface_torch's networks; NETWORKS may hold more of our own
GOLDEN = FIXTURES / "golden" / "embeddings.pt"
SMALL = 0.125  # width_mult for the CPU-sized copies of each network
# Too deep to run at SMALL width on 2 cores within the time budget: tested at 1/64 instead.
TINY = {"r2060": 1 / 64}
# What arcface_torch's get_model passes beyond the shapes (its backbones/__init__.py and
# iresnet2060.py): ViT (drop_path_rate, mask_ratio, using_checkpoint); r2060's checkpoint_sequential
# segments per stage.
UPSTREAM_VIT_OPTIONS = {
    "vit_t": (0.1, 0.1, False), "vit_t_dp005_mask0": (0.05, 0.0, False),
    "vit_s": (0.1, 0.1, False), "vit_s_dp005_mask_0": (0.05, 0.0, False),
    "vit_b": (0.1, 0.1, True), "vit_b_dp005_mask_005": (0.05, 0.05, True),
    "vit_l_dp005_mask_005": (0.05, 0.05, True), "vit_h": (0.1, 0.0, True),
}
UPSTREAM_R2060_CHECKPOINT_SEGMENTS = (0, 20, 100, 0)
GOLDEN_TRAIN_SEED = 1  # torch.manual_seed right before a train-mode forward (ViT masking, drop path)
# The zeros of torch.empty(64).bernoulli_(0.5) after torch.manual_seed(0) on the torch that made the fixtures
# (2.14.1): drop path draws with bernoulli_, whose CPU stream differs in some releases (2.4's, for one).
FIXTURES_BERNOULLI_ZEROS = [0, 1, 3, 4, 5, 8, 13, 18, 19, 21, 23, 25, 26, 27, 28, 30, 31, 35, 36, 38, 42, 44, 46, 48,
                            49, 50, 53, 54, 56, 57, 59, 60, 63]


def bernoulli_stream_of_the_fixtures() -> bool:
    torch.manual_seed(0)
    return (torch.empty(64).bernoulli_(0.5) == 0).nonzero().flatten().tolist() == FIXTURES_BERNOULLI_ZEROS

torch.set_num_threads(1)


def first_layer(model: nn.Module) -> nn.Conv2d:
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 112, 112, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def calibrate_batchnorm(model: nn.Module, batches: int = 2) -> nn.Module:
    """Give BN running statistics the values training would (a freshly initialised deep iresnet
    is not meant to be run in eval mode), then switch to eval."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = None  # cumulative average over the calibration batches
    model.train()
    with torch.no_grad():
        for seed in range(batches):
            model(images(8, seed=100 + seed))
    return model.eval()


def randomize_affine(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BN scales/shifts, so tests see every term of the BN maths."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.1)
    return model


def fixture_state_dict(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random but well-scaled tensors with exactly the shapes and dtypes upstream's file holds."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape, dtype in UPSTREAM[name]["state_dict"]:
        if dtype == "int64":
            state[key] = torch.tensor(0, dtype=torch.int64)
        elif key.endswith("running_var"):
            state[key] = torch.rand(shape, generator=generator) + 0.5
        elif len(shape) >= 2:
            state[key] = torch.randn(shape, generator=generator) / math.sqrt(math.prod(shape[1:]))
        else:
            state[key] = torch.rand(shape, generator=generator) * 0.5 + 0.25
    return state


def golden_weights(template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The golden fixture's weights: drawn from one generator, key after key in state_dict order
    (arcface_torch's order, which ours equals), from the key's name and shape alone, so they owe
    nothing to either codebase's initialisation. tests/fixtures/golden/README.md describes this recipe.
    """
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for key, value in template.items():
        shape = value.shape
        if key.endswith("num_batches_tracked"):
            weights[key] = torch.zeros((), dtype=torch.int64)
        elif key.endswith("running_var"):
            weights[key] = torch.rand(shape, generator=generator) + 0.5
        elif key.endswith("running_mean"):
            weights[key] = torch.randn(shape, generator=generator) * 0.1
        elif len(shape) >= 2:  # conv/linear weights, position embedding, mask token: unit gain
            weights[key] = torch.randn(shape, generator=generator) / math.sqrt(value.numel() / shape[0])
        elif key.endswith("weight") and key.removesuffix("weight") + "bias" in template:  # BN/LN scale
            weights[key] = torch.rand(shape, generator=generator) + 0.5
        elif key.endswith("weight"):  # PReLU slopes: the only 1-D weights without a bias
            weights[key] = torch.rand(shape, generator=generator) * 0.4 + 0.05
        else:  # biases and BN/LN shifts
            weights[key] = torch.randn(shape, generator=generator) * 0.1
    return weights


def golden_images() -> torch.Tensor:
    """The golden fixture's input: 3 images in [-1, 1), as tests/fixtures/golden/README.md says."""
    return torch.rand(3, 3, 112, 112, generator=torch.Generator().manual_seed(0)) * 2 - 1


@functools.cache
def meta_model(name: str) -> nn.Module:
    """Full-size network without memory or arithmetic (r2060 alone takes seconds to build)."""
    with torch.device("meta"):
        return get_model(name)


def meta_state_dict(name: str) -> dict[str, torch.Tensor]:
    """Tensors with exactly the shapes and dtypes of upstream's file, on the meta device."""
    return {key: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            for key, shape, dtype in UPSTREAM[name]["state_dict"]}


# --- upstream compatibility ------------------------------------------------------------------


def test_every_network_of_arcface_torch_is_offered():
    assert set(UPSTREAM) <= set(NETWORKS)


@pytest.mark.parametrize("name", UPSTREAM_NAMES)
def test_state_dict_names_shapes_dtypes_and_parameter_count_equal_upstream(name):
    model = meta_model(name)
    ours = [[key, list(value.shape), str(value.dtype).removeprefix("torch.")]
            for key, value in model.state_dict().items()]
    assert ours == UPSTREAM[name]["state_dict"]
    assert sum(p.numel() for p in model.parameters()) == UPSTREAM[name]["params"]


@pytest.mark.parametrize("name", UPSTREAM_VIT_OPTIONS)
def test_vits_train_with_upstreams_drop_path_masking_and_checkpointing(name):
    drop_path_rate, mask_ratio, using_checkpoint = UPSTREAM_VIT_OPTIONS[name]
    model = meta_model(name)
    rates = [block.drop_path.drop_prob for block in model.blocks]
    assert rates == pytest.approx(torch.linspace(0, drop_path_rate, len(rates)).tolist())  # upstream's rule
    assert model.mask_ratio == mask_ratio and model.using_checkpoint == using_checkpoint


def test_r2060_recomputes_stages_2_and_3_in_upstreams_segments():
    assert meta_model("r2060").checkpoint_segments == UPSTREAM_R2060_CHECKPOINT_SEGMENTS


@pytest.mark.parametrize("name", ["r18", "mbf", "vit_t"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_embeddings_equal_arcface_torchs_own(name, mode):
    """arcface_torch's code, given the golden weights and images, produced fixtures/golden (see its
    README); ours must give the same embeddings up to float32 rounding. The convnets run the same
    operations in the same order (bit-equal on the machine that made the fixtures; on another CPU, e.g.
    AVX2 instead of AVX-512, oneDNN blocks the convolution sums differently: up to 4.5e-5 measured for
    r18); the ViT's fused attention kernel sums in another order. Train mode uses batch statistics, and
    for the ViT the token masking and drop path drawn after torch.manual_seed(GOLDEN_TRAIN_SEED) in
    upstream's order; there the last BN normalises each
    feature over only 3 images, some spread by < 0.01, which magnifies rounding ~100x (measured:
    7e-5), while a wrong mask or drop path moves embeddings by ~4."""
    if name == "vit_t" and mode == "train" and not bernoulli_stream_of_the_fixtures():
        pytest.skip(f"torch {torch.__version__}'s CPU bernoulli_ draws another stream than the fixtures' torch: "
                    "drop path would drop other samples than upstream did there")
    expected = torch.load(GOLDEN, weights_only=True)[f"{name}/{mode}"]
    model = get_model(name)
    model.load_state_dict(golden_weights(model.state_dict()), strict=True)
    model.train(mode == "train")
    torch.manual_seed(GOLDEN_TRAIN_SEED)
    with torch.no_grad():
        out = model(golden_images())
    atol = 1e-4 if mode == "eval" else 1e-3
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("name", UPSTREAM_NAMES)
def test_full_size_network_loads_upstream_shaped_weights_strictly(name):
    """Full-size networks: strict loading, and a full-size forward gives (2, 512). The big ones run
    on the meta device (shapes only, no arithmetic) to stay within CPU time."""
    if name in ("r18", "mbf", "mbf_large", "vit_t"):
        model = get_model(name)
        model.load_state_dict(fixture_state_dict(name), strict=True)
        with torch.no_grad():
            out = model.eval()(images(2))
        assert out.shape == (2, 512) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
    else:
        model = meta_model(name)
        model.load_state_dict(meta_state_dict(name), strict=True)
        if name in TINY:  # its forward runs (at a tiny width) in the forward tests; 1030 blocks take seconds
            return
        with torch.no_grad():
            assert model.eval()(torch.empty(2, 3, 112, 112, device="meta")).shape == (2, 512)


@pytest.mark.parametrize("name", ["vit_t_dp005_mask0", "vit_l_dp005_mask_005", "vit_h"])
def test_weights_of_a_full_size_network_are_recognised(name):
    """The first network in NETWORKS whose upstream state_dict is identical (vit_t_dp005_mask0 is
    vit_t's shape), at width 1 even where another network scaled up would fit too (vit_b x1.5 has
    vit_l's shapes). r2060 takes the iresnets' path (test_export_inference) and seconds to build."""
    same = next(other for other in NETWORKS
                if other in UPSTREAM and UPSTREAM[other]["state_dict"] == UPSTREAM[name]["state_dict"])
    assert suggest_network(meta_state_dict(name)) == f"network {same}, width_mult=1, num_features=512"


def test_strict_loading_rejects_a_state_dict_with_one_key_missing():
    state = fixture_state_dict("mbf")
    del state["features.layers.3.running_var"]
    with pytest.raises(RuntimeError, match="features.layers.3.running_var"):
        get_model("mbf").load_state_dict(state, strict=True)


# --- the contract every network keeps, arcface_torch's or not ----------------------------------


@pytest.mark.parametrize("name", NETWORKS)
def test_builds_on_the_meta_device_for_the_memory_plan(name):
    """The memory plan counts parameters of the full-size network without allocating them."""
    model = meta_model(name)
    assert all(tensor.is_meta for tensor in model.state_dict().values())
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("name", NETWORKS)
def test_backbone_pth_and_model_json_name_the_network_again(name, tmp_path):
    """What training writes (save_backbone) is what every tool loads (load_saved_backbone): the same
    tensors, and the same embeddings."""
    width = TINY.get(name, SMALL)
    torch.manual_seed(0)
    model = get_model(name, num_features=64, width_mult=width)
    architecture = {"network": name, "network_kwargs": {"width_mult": width}, "embedding_size": 64, "num_classes": 3}
    save_backbone(model, tmp_path, architecture)
    loaded, saved = load_saved_backbone(tmp_path)
    assert (saved.network, saved.options) == (name, {"width_mult": width, "num_features": 64})
    reloaded = loaded.state_dict()  # once: r2060 has ~6000 tensors, and state_dict() walks them all
    assert all(torch.equal(value, reloaded[key]) for key, value in model.state_dict().items())
    if name not in TINY:  # r2060's 1030 blocks take seconds to run
        with torch.no_grad():
            assert torch.equal(model.eval()(images(2)), loaded(images(2)))


# Under DDP the smallest widths that still build: 2 processes x 16 networks x 3 steps on 2 cores.
DDP_WIDTH, DDP_TINY = 1 / 16, {"r2060": 1 / 64, "vit_h": 1 / 128}
DDP_STEPS = 3


def _parameter_digest(model: nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _ddp_steps(rank: int, names: tuple[str, ...]) -> dict[str, dict]:
    """Per network, DDP_STEPS SGD steps of the backbone in DDP as training wraps it: which trainable
    parameters got no gradient at some step, and digests of the weights before and after."""
    facts = {}
    for name in names:
        torch.manual_seed(0)
        model = get_model(name, num_features=16, width_mult=DDP_TINY.get(name, DDP_WIDTH))
        ddp = ddp_backbone(model, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        before, missing = _parameter_digest(model), set()
        for step in range(DDP_STEPS):
            torch.manual_seed(100 * step + rank)  # ViT masking and drop path differ between ranks, as in training
            ddp(images(2, seed=10 * step + rank)).square().mean().backward()
            missing |= {key for key, p in model.named_parameters() if p.requires_grad and p.grad is None}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        facts[name] = dict(missing=missing, before=before, after=_parameter_digest(model))
    return facts


@pytest.mark.slow  # two processes step 16 networks (r2060: ~10 CPU seconds each)
@pytest.mark.parametrize("name", NETWORKS)
def test_trains_three_steps_under_ddp_in_two_processes(name, ddp_world):
    """Every step gives every trainable parameter its gradient (a parameter left without one makes DDP
    raise at the next step: the ViTs without masking did), the replicas stay equal and the weights move."""
    ranks = [facts["steps"][name] for facts in ddp_world]
    assert all(not r["missing"] for r in ranks), [r["missing"] for r in ranks]
    assert ranks[0]["after"] == ranks[1]["after"], "the two replicas differ after the steps"
    assert ranks[0]["after"] != ranks[0]["before"], "the steps changed no weight"


# --- forward / backward ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NETWORKS)
def test_forward_train_and_eval_and_gradient_reaches_first_convolution(name):
    torch.manual_seed(0)
    model = get_model(name, width_mult=TINY.get(name, SMALL)).train()
    out = model(images(2))
    assert out.shape == (2, 512) and out.dtype == torch.float32 and torch.isfinite(out).all()
    out.square().mean().backward()
    grad = first_layer(model).weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    calibrate_batchnorm(model)
    with torch.no_grad():
        out = model(images(2))
    assert out.shape == (2, 512) and torch.isfinite(out).all()


def test_num_features_sets_the_embedding_size():
    assert get_model("r18", num_features=128, width_mult=SMALL).eval()(images(1)).shape == (1, 128)


def test_width_mult_scales_channels():
    r50 = get_model("r50", width_mult=0.25)
    assert r50.conv1.out_channels == 16 and r50.fc.in_features == 128 * 7 * 7
    mbf = get_model("mbf", width_mult=0.5)
    assert mbf.layers[0].layers[0].out_channels == 64 and mbf.features.layers[2].in_features == 256
    assert get_model("vit_t", width_mult=0.125).pos_embed.shape == (1, 144, 32)
    assert get_model("vit_l_dp005_mask_005", width_mult=0.125).pos_embed.shape == (1, 144, 96)
    assert get_model("r2060", width_mult=TINY["r2060"]).layer3[-1].conv2.out_channels == 4


def train_step_keeping(model: nn.Module) -> int:
    """Forward and backward on a batch in training mode; how many numbers autograd kept for backward."""
    saved = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = model.train()(images(4))
    out.square().mean().backward()
    return sum(saved)


def test_checkpointed_iresnet_trains_like_the_plain_one_keeping_fewer_activations():
    """Recomputed stages (r2060's memory saver) give plain autograd's gradients and BN running
    statistics, each batch counted once (upstream's checkpoint_sequential counts it twice)."""
    torch.manual_seed(0)
    plain = IResNet((2, 6, 9, 2), width_mult=SMALL)
    checkpointed = IResNet((2, 6, 9, 2), width_mult=SMALL, checkpoint_segments=(0, 2, 3, 0))
    checkpointed.load_state_dict(plain.state_dict())
    kept = {model: train_step_keeping(model) for model in (plain, checkpointed)}
    # layer2 keeps 3 of its 6 blocks' activations, layer3 3 of 9 (their segments' inputs aside).
    assert kept[checkpointed] < 0.8 * kept[plain]
    for (key, ours), theirs in zip(checkpointed.named_parameters(), plain.parameters(), strict=True):
        if ours.requires_grad:
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=key)
    for (key, ours), theirs in zip(checkpointed.named_buffers(), plain.buffers(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=key)


@pytest.mark.slow  # 256M parameters, ~10 s
def test_vit_l_forward_and_backward_at_full_size_on_cpu():
    """The largest network run at full size here (256M parameters, ~3 GB, ~10 s on one core), as
    upstream trains it: activation checkpointing, 5% of the tokens masked."""
    torch.manual_seed(0)
    model = get_model("vit_l_dp005_mask_005").train()
    out = model(images(2))
    assert out.shape == (2, 512) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert model.patch_embed.proj.weight.grad.abs().sum() > 0 and model.mask_token.grad.abs().sum() > 0


def test_dropout_acts_in_training_only():
    model = get_model("r18", dropout=0.5, width_mult=SMALL)
    calibrate_batchnorm(model).train()
    with torch.no_grad():
        x = images(4)
        assert not torch.allclose(model(x), model(x))
        model.eval()
        torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)


# --- errors ----------------------------------------------------------------------------------


def test_unknown_network_is_a_config_error_listing_the_valid_names():
    with pytest.raises(ConfigError) as error:
        get_model("r51")
    assert all(name in str(error.value) for name in NETWORKS) and "did you mean 'r50'?" in str(error.value)


def test_unknown_option_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="layers_per_stage"):
        get_model("r18", layers_per_stage=3)
    with pytest.raises(ConfigError, match="mask_ratio"):
        get_model("mbf", mask_ratio=0.1)
    assert get_model("vit_t", width_mult=SMALL, mask_ratio=0.0).mask_ratio == 0.0


@pytest.mark.parametrize("name, options", [
    ("r18", {"width_mult": 0.3}), ("mbf", {"width_mult": -1.0}), ("vit_t", {"width_mult": 10 / 256}),
    ("vit_t", {"width_mult": 12 / 256}), ("vit_t", {"mask_ratio": 1.0}), ("vit_s", {"drop_path_rate": -0.1})])
def test_impossible_option_is_a_config_error_naming_it(name, options):
    with pytest.raises(ConfigError, match=next(iter(options))):
        get_model(name, **options)


def _user_errors(tmp_path: Path) -> list[Exception]:
    """One of each error a user can cause in backbones/."""
    not_torch = tmp_path / "notes.pth"
    not_torch.write_text("not weights")
    not_image = tmp_path / "face.jpg"
    not_image.write_text("not an image")
    face = tmp_path / "face.png"
    torch.save({}, tmp_path / "empty.pth")
    Image.new("RGB", (92, 112)).save(face)
    no_landmarks = Preparation("resize", {}, tmp_path / "points.txt")
    attempts = [
        lambda: get_model("r51"), lambda: get_model("resnet"), lambda: get_model("r18", colour=1),
        lambda: get_model("r18", width_mult=0.3), lambda: get_model("vit_t", width_mult=12 / 256),
        lambda: get_model("vit_t", mask_ratio=1.0), lambda: get_model("vit_t", drop_path_rate=1.0),
        lambda: read_state_dict(tmp_path / "missing.pth"), lambda: read_state_dict(not_torch),
        lambda: read_state_dict(tmp_path / "empty.pth"),
        lambda: read_face_image(tmp_path / "missing.jpg"), lambda: read_face_image(not_image),
        lambda: read_face_image(face, no_landmarks),
    ]
    errors = []
    for attempt in attempts:
        with pytest.raises(UserError) as error:
            attempt()
        errors.append(error.value)
    return errors


def test_every_user_error_is_one_sentence_saying_what_is_wrong_and_how_to_fix_it(tmp_path):
    for error in _user_errors(tmp_path):
        message = str(error)
        assert not message[0].isupper() and "; " in message and not message.endswith("."), message
        assert "\n" not in message, message


# --- mixed precision -------------------------------------------------------------------------


@pytest.mark.parametrize("name, trunk_end, head", [
    ("r18", "layer4", "fc"), ("mbf", "layers.7", "features"), ("vit_t", "blocks.11.mlp.fc2", "feature.0")])
def test_under_the_callers_autocast_the_trunk_runs_in_half_precision_and_the_head_in_float32(name, trunk_end, head):
    torch.manual_seed(0)
    model = calibrate_batchnorm(get_model(name, width_mult=SMALL)).eval()
    seen = {}
    modules = dict(model.named_modules())
    modules[trunk_end].register_forward_hook(lambda m, i, o: seen.__setitem__("trunk", o.dtype))
    modules[head].register_forward_hook(lambda m, i, o: seen.__setitem__("head", o.dtype))
    x = images(4)
    with torch.no_grad():
        reference = model.double()(x.double()).float()
        model.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the one autocast: the caller's
            out = model(x)
    assert seen == {"trunk": torch.bfloat16, "head": torch.float32}
    assert out.dtype == torch.float32
    # bfloat16 keeps 8 bits of mantissa: the embeddings' directions must still agree closely.
    assert F.cosine_similarity(out, reference).min() > 0.99


def test_arcface_torchs_fp16_argument_builds_the_same_network_and_opens_no_autocast_of_its_own(caplog):
    torch.manual_seed(0)
    plain = get_model("r18", width_mult=SMALL).eval()
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="backbones.registry"):
        given = get_model("r18", fp16=True, width_mult=SMALL).eval()
    assert [record.getMessage() for record in caplog.records] == [
        "get_model('r18', fp16=True): the network runs in the precision of the autocast its caller opens, not its "
        "own; for training set fp16=True in the config (not in network_kwargs), elsewhere open torch.autocast "
        "around the call"]
    seen = {}
    given.layer4.register_forward_hook(lambda m, i, o: seen.__setitem__("trunk", o.dtype))
    with torch.no_grad():
        assert torch.equal(given(images(2)), plain(images(2)))
    assert seen == {"trunk": torch.float32}


def test_the_trunk_follows_the_callers_precision_and_the_head_stays_float32():
    model = get_model("r18", width_mult=SMALL).eval()
    seen = {}
    model.layer4.register_forward_hook(lambda m, i, o: seen.__setitem__("trunk", o.dtype))
    model.fc.register_forward_hook(lambda m, i, o: seen.__setitem__("head", o.dtype))
    with torch.no_grad():
        assert model(images(2)).dtype == torch.float32 and seen == {"trunk": torch.float32, "head": torch.float32}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(images(2)).dtype == torch.float32
    assert seen == {"trunk": torch.bfloat16, "head": torch.float32}


# --- maths against float64 references ------------------------------------------------------


def test_iresnet_block_matches_upstream_formula_in_float64():
    """bn1 -> conv1 -> bn2 -> prelu -> conv2(stride 2) -> bn3, plus the 1x1/BN projection."""
    torch.manual_seed(0)
    block = randomize_affine(IBasicBlock(8, 16, stride=2))
    for bn in [m for m in block.modules() if isinstance(m, nn.BatchNorm2d)]:
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    block = block.double().eval()
    x = torch.randn(3, 8, 14, 14, dtype=torch.float64)

    def bn(module, t):
        return ((t - module.running_mean[:, None, None]) / torch.sqrt(module.running_var[:, None, None] + 1e-5)
                * module.weight[:, None, None] + module.bias[:, None, None])

    y = bn(block.bn1, x)
    y = F.conv2d(y, block.conv1.weight, padding=1)
    y = bn(block.bn2, y)
    y = torch.where(y > 0, y, block.prelu.weight[:, None, None] * y)
    y = bn(block.bn3, F.conv2d(y, block.conv2.weight, stride=2, padding=1))
    shortcut = bn(block.downsample[1], F.conv2d(x, block.downsample[0].weight, stride=2))
    with torch.no_grad():
        torch.testing.assert_close(block(x), y + shortcut, rtol=1e-12, atol=1e-12)


def test_vit_attention_matches_explicit_softmax_in_float64():
    torch.manual_seed(0)
    attention = Attention(dim=32, num_heads=8).double()
    x = torch.randn(2, 144, 32, dtype=torch.float64)
    qkv = (x @ attention.qkv.weight.T).reshape(2, 144, 3, 8, 4)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    weights = torch.softmax(q @ k.transpose(-1, -2) * 4 ** -0.5, dim=-1)
    mixed = (weights @ v).transpose(1, 2).reshape(2, 144, 32)
    expected = mixed @ attention.proj.weight.T + attention.proj.bias
    with torch.no_grad():
        torch.testing.assert_close(attention(x), expected, rtol=1e-10, atol=1e-10)


def test_vit_training_masks_ten_percent_of_tokens_with_the_mask_token():
    torch.manual_seed(0)
    vit = get_model("vit_t", width_mult=SMALL)
    tokens = torch.randn(3, 144, 32)
    kept, restore = vit._keep_random_tokens(tokens)
    assert kept.shape == (3, int(144 * 0.9), 32)
    restored = vit._restore_tokens(kept, restore)
    is_mask = (restored == vit.mask_token).all(dim=2)
    assert (is_mask.sum(dim=1) == 144 - kept.shape[1]).all()
    torch.testing.assert_close(restored[~is_mask], tokens[~is_mask], rtol=0, atol=0)


# --- inference fusion -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["r18", "mbf", "vit_t"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_batchnorm_copy_computes_the_same_embeddings(name, channels_last):
    torch.manual_seed(0)
    model = calibrate_batchnorm(randomize_affine(get_model(name, width_mult=SMALL)))
    keys_before = list(model.state_dict())
    fused = fuse_batchnorm(model)
    x = images(4)
    if channels_last:
        fused = fused.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        reference = model.double()(x.double()).float()
        out = fused(x)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
    assert list(model.state_dict()) == keys_before  # the original is untouched
    remaining = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    original = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert remaining < original


def test_fusion_leaves_only_batchnorms_that_follow_no_layer():
    """iresnet's pre-activation BNs (bn1 of each block, bn2 before the flatten) cannot fold into a
    preceding layer; every other BN must be gone."""
    fused = fuse_batchnorm(get_model("r18", width_mult=SMALL))
    left = sorted(name for name, m in fused.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    assert left == sorted(["bn2"] + [f"layer{s}.{b}.bn1" for s in range(1, 5) for b in range(2)])


# --- DistributedDataParallel ------------------------------------------------------------------


def _ddp_gradient_errors(rank: int, world_size: int, names: tuple[str, ...]) -> dict[str, float]:
    """Per network, the largest relative |DDP gradient - mean of the ranks' single-process gradients|."""
    errors = {}
    for name in names:
        torch.manual_seed(0)
        model = get_model(name, width_mult=SMALL)
        reference = copy.deepcopy(model)
        ddp = ddp_backbone(model, torch.device("cpu"))
        shards = [images(4, seed=10 + r) for r in range(world_size)]  # (B*V) = 2 samples x 2 views

        torch.manual_seed(1000 + rank)  # ViT masking / drop-path draws: replayed below
        ddp(shards[rank]).square().mean().backward()
        for r in range(world_size):
            torch.manual_seed(1000 + r)
            (reference(shards[r]).square().mean() / world_size).backward()
        worst = 0.0
        for (key, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
            if ours.requires_grad:
                assert ours.grad is not None, f"{name}: {key} got no gradient"
                scale = theirs.grad.abs().max().item() + 1e-12
                worst = max(worst, (ours.grad - theirs.grad).abs().max().item() / scale)
        errors[name] = worst
    return errors


GRADIENT_NETWORKS = ("r18", "mbf", "vit_b", "vit_t_dp005_mask0")


def _ddp_facts(rank: int, world_size: int) -> dict:
    """Every DDP fact of this file from one spawn of 2 processes: starting them costs more than the checks."""
    return dict(gradients=_ddp_gradient_errors(rank, world_size, GRADIENT_NETWORKS), steps=_ddp_steps(rank, NETWORKS))


@pytest.fixture(scope="module")
def ddp_world() -> list[dict]:
    return run_world(_ddp_facts, 2)


def test_ddp_gradient_is_the_mean_of_the_ranks_gradients(ddp_world):
    """Three families; vit_b also covers activation checkpointing (on by default, as upstream) and the
    mask token under DDP, vit_t_dp005_mask0 a ViT whose mask token no step uses."""
    for facts in ddp_world:
        errors = facts["gradients"]
        assert errors.keys() == set(GRADIENT_NETWORKS) and max(errors.values()) < 1e-4, errors
