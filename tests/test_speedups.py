"""The step's speed switches (`channels_last`, `compile_backbone`: training/speedups.py) in whole runs of train.py.

r18 at a quarter of its widths (the narrowest whose NHWC convolutions this CPU's oneDNN runs), two micro-batches
per step (the accumulation path, which skips DDP's sync on every micro-batch but the last). Each switch trains the
same model as the eager, NCHW step up to float rounding (the kernels differ, the maths does not); channels_last
resumes bit for bit and its checkpoint resumes with the switch off; the compiled step saves the backbone under
its own names. A narrow ResNet that would crash oneDNN is one error line instead, and compile_backbone on several
processes without channels_last gets the advice to set it (its reason was seen once by hand on 2 processes: a
compiled run takes too long to spawn for this suite).
"""
from __future__ import annotations

import pytest
import torch

from gpu_acceptance.runs import CONFIG, INFO, load_backbone_strict, scalars
from tests.run_helpers import ROOT, assert_same_run, run_here
from tests.test_train_errors import only_line
from training.speedups import layout_advice
from utils.config import load_config

pytestmark = pytest.mark.slow  # one inductor compilation of r18, cold: about 45 s on this CPU

WIDTH = 0.25
SETTINGS = [f"network_kwargs={{'width_mult': {WIDTH}}}", "gradient_acc=2", "sample_rate=0.5"]
INFO_HERE = {**INFO, "network_kwargs": {"width_mult": WIDTH}}
STEPS = 2


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("speedups")
    for name, overrides in (("eager", []), ("channels_last", ["channels_last=True"]),
                            ("compiled", ["compile_backbone='default'"])):
        status, stderr = run_here(data, root / name, *SETTINGS, *overrides, f"max_steps={STEPS}")
        assert status == 0, stderr  # inductor's C++ build may warn, on a CPU, that it found no CUDA runtime
    for step in range(1, STEPS + 1):
        assert run_here(data, root / "split", *SETTINGS, "channels_last=True", f"max_steps={step}",
                        resume=step > 1) == (0, "")
    return root


@pytest.mark.parametrize("switch", ["channels_last", "compiled"])
def test_a_switch_trains_the_same_model_as_the_eager_step(runs, switch):
    eager, switched = scalars(runs / "eager", "loss"), scalars(runs / switch, "loss")
    assert eager.keys() == switched.keys() == set(range(1, STEPS + 1))
    # the second step's loss is the first update's outcome: the same update, up to the kernels' rounding
    assert all(switched[step] == pytest.approx(eager[step], rel=1e-4) for step in eager)
    ours = load_backbone_strict(runs / switch / "backbone.pth", INFO_HERE).state_dict()
    theirs = load_backbone_strict(runs / "eager" / "backbone.pth", INFO_HERE).state_dict()
    assert ours.keys() == theirs.keys()  # the compiled step's wrapper adds no prefix to the saved names
    # weights of order 1 after two steps at lr 0.1: their rounding differences stay below 3e-3 here
    assert all(torch.allclose(ours[k].float(), theirs[k].float(), rtol=0, atol=1e-2) for k in ours)


def test_channels_last_resumes_bit_for_bit_and_its_checkpoint_resumes_without_it(runs, data):
    assert_same_run(runs / "split", runs / "channels_last", INFO_HERE)
    assert run_here(data, runs / "split", *SETTINGS, f"max_steps={STEPS + 1}", resume=True) == (0, "")
    assert set(scalars(runs / "split", "loss")) == set(range(1, STEPS + 2))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch")
def test_channels_last_on_a_resnet_that_would_crash_onednn_is_one_error_line(data, tmp_path):
    status, stderr = run_here(data, tmp_path / "run", "channels_last=True", "max_steps=1")  # QUIET's width 0.0625
    assert status != 0
    line = only_line(stderr)
    assert "'channels_last'" in line and "oneDNN" in line and "width_mult" in line
    assert not (tmp_path / "run" / "checkpoint.json").exists()


def test_compile_on_several_processes_asks_for_channels_last_where_ddp_would_copy_every_gradient():
    def advice(world_size: int, **keys):
        cfg = load_config(ROOT / CONFIG, ["compile_backbone='default'", *(f"{k}={v!r}" for k, v in keys.items())])
        return layout_advice(cfg, world_size)

    assert "set channels_last=True too" in advice(2)
    assert advice(1) is None and advice(2, channels_last=True) is None
    assert advice(2, network="vit_t", network_kwargs={}) is None and advice(2, compile_backbone=None) is None
