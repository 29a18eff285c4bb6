"""Fine-tuning a trained backbone on new classes, through the real CLI: `resume=<backbone.pth>` with
freeze_backbone_steps (the class centres alone at first: the backbone's weights and BatchNorm statistics
bitwise as loaded) and backbone_lr_mult (the backbone's lr that multiple of the schedule at every step,
also across a resume and when a resume changes the multiplier)."""
from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator

import pytest
import torch

import train
from gpu_acceptance.runs import CONFIG, INFO, QUIET, load_run
from tests.run_helpers import ROOT, run_here, same_tensors
from training.state import build_networks
from utils.config import load_config
from utils.errors import ConfigError

STEPS_PER_EPOCH, EPOCHS, WARMUP_EPOCHS, LR = 10, 4, 1, 0.1  # the data fixture's 40 records, batch 4 (QUIET)


def scheduled_lr(step: int) -> float:
    """arcface_torch's schedule written out for step `step` (0-based): linear warmup over the first epoch, then
    (1 - progress) ** 2 to zero."""
    warmup, total = STEPS_PER_EPOCH * WARMUP_EPOCHS, STEPS_PER_EPOCH * EPOCHS
    if step < warmup:
        return LR * step / warmup
    return LR * (1 - (step - warmup) / (total - warmup)) ** 2


def test_the_frozen_warm_up_leaves_the_backbone_and_its_batchnorm_statistics_bitwise_as_loaded(
        data, trained_backbone, tmp_path):
    frozen, control = tmp_path / "frozen", tmp_path / "control"
    assert run_here(data, frozen, f"resume={trained_backbone}", "freeze_backbone_steps=3", "max_steps=3") == (0, "")
    loaded = torch.load(trained_backbone, weights_only=True)
    saved = load_run(frozen)
    assert same_tensors(saved["backbone"], loaded)  # running_mean, running_var and num_batches_tracked included
    cfg = load_config(ROOT / CONFIG, [f"rec={data}", *QUIET])
    initial_centres = build_networks(cfg, INFO["num_classes"], torch.device("cpu"))[1].weight.detach()
    assert not torch.equal(saved["class_centres"], initial_centres)  # the centres did train
    assert "steps 1 to 3 of the LR schedule train the class centres alone" in (frozen / "training.log").read_text()

    # One step fewer frozen: the third step trains the backbone, weights and statistics.
    assert run_here(data, control, f"resume={trained_backbone}", "freeze_backbone_steps=2", "max_steps=3") == (0, "")
    trained = load_run(control)["backbone"]
    changed = {key for key in loaded if not torch.equal(trained[key], loaded[key])}
    assert {"conv1.weight", "bn1.running_mean", "bn1.num_batches_tracked"} <= changed


@contextlib.contextmanager
def recorded_lrs() -> Iterator[dict[int, list[float]]]:
    """Each step's learning rates ({0-based step: [backbone group's, centres group's]}), read from the
    optimizer's parameter groups just before train.py's step uses them."""
    seen: dict[int, list[float]] = {}
    real_step = train.train_step

    def recording_step(state, micro_batches, cfg):
        seen[state.scheduler.last_epoch] = [group["lr"] for group in state.optimizer.param_groups]
        return real_step(state, micro_batches, cfg)

    train.train_step = recording_step
    try:
        yield seen
    finally:
        train.train_step = real_step


def test_the_backbone_lr_multiplier_holds_at_every_step_and_across_resumes(data, tmp_path):
    """Steps 1-4 with backbone_lr_mult=0.25 (the warmup included), a resume to step 8 that keeps it, a resume
    to step 12 that changes it to 0.5: at every step the backbone's lr is the multiplier times the schedule's,
    the centres' the schedule's."""
    output = tmp_path / "run"
    phases = [((f"warmup_epoch={WARMUP_EPOCHS}", "backbone_lr_mult=0.25", "max_steps=4"), False, range(0, 4), 0.25),
              (("max_steps=8",), True, range(4, 8), 0.25),
              (("backbone_lr_mult=0.5", "max_steps=12"), True, range(8, 12), 0.5)]
    for overrides, resume, steps, multiplier in phases:
        with recorded_lrs() as seen:
            assert run_here(data, output, *overrides, resume=resume) == (0, "")
        assert sorted(seen) == list(steps)
        for step in steps:
            expected = [multiplier * scheduled_lr(step), scheduled_lr(step)]
            assert seen[step] == pytest.approx(expected, rel=1e-12, abs=1e-15), step
    groups = load_run(output)["optimizer"]["param_groups"]
    assert [group["lr"] for group in groups] == pytest.approx([0.5 * scheduled_lr(12), scheduled_lr(12)], rel=1e-12)


# --- the README's fine-tune command as written (issue 58, item 3) ------------------------------------------------

FINE_TUNE_CONFIG = "configs/finetune_my_faces.py"  # r18 at 1/8 width, embedding 128: not the backbones' below
# What the fine-tune config leaves to the run (its data, no verification set, a few steps), its network keys not.
FINE_TUNE_BASE = ["batch_size=4", "num_workers=0", "val_targets=()", "frequent=1", "verbose=1000"]


@pytest.fixture()
def backbone_run(trained_backbone, tmp_path):
    """A run folder as train.py leaves one: the backbone and the model.json that names its network (r18 at 1/16
    width, embedding 32), as the demo's and configs/my_faces.py's are not configs/finetune_my_faces.py's."""
    folder = tmp_path / "trained"
    folder.mkdir()
    shutil.copy(trained_backbone, folder / "backbone.pth")
    (folder / "model.json").write_text(json.dumps({**INFO, "num_classes": 7, "photo_preparation": "crop"}))
    return folder


def test_the_fine_tune_config_takes_the_network_of_the_backbones_model_json_and_a_resume_keeps_it(
        data, backbone_run, trained_backbone, tmp_path):
    out = tmp_path / "run"
    status, err = run_here(data, out, f"resume={backbone_run / 'backbone.pth'}", "freeze_backbone_steps=3",
                           "max_steps=2", config=FINE_TUNE_CONFIG, base=FINE_TUNE_BASE)
    assert (status, err) == (0, "")
    log = (out / "training.log").read_text()
    assert (f"network r18 (width_mult=0.0625), embedding_size 32: from {backbone_run / 'model.json'} beside the "
            "backbone it starts from (resume), in place of the config's r18 (width_mult=0.125), embedding_size 128") \
        in log
    # 40 records in batches of 4: 10 steps an epoch, so the 3 frozen steps are 0.3 of one.
    assert "steps 1 to 3 of the LR schedule train the class centres alone (freeze_backbone_steps; 0.3 epochs" in log
    assert same_tensors(load_run(out)["backbone"], torch.load(trained_backbone, weights_only=True))  # frozen so far
    recorded = json.loads((out / "config.json").read_text())
    assert {"network_kwargs={'width_mult': 0.0625}", "embedding_size=32"} <= set(recorded["set"])  # r18 was said
    assert run_here(data, out, "max_steps=4", config=FINE_TUNE_CONFIG, base=FINE_TUNE_BASE, resume=True) == (0, "")
    assert load_run(out)["progress"]["global_step"] == 4


def test_a_network_key_set_against_the_backbones_model_json_is_refused_with_the_set_line_that_fits(
        data, backbone_run, tmp_path):
    info, weights = backbone_run / "model.json", backbone_run / "backbone.pth"
    status, err = run_here(data, tmp_path / "run", f"resume={weights}", "embedding_size=64", config=FINE_TUNE_CONFIG,
                           base=FINE_TUNE_BASE)
    assert status == 1
    assert err.strip() == (
        f"error: --set embedding_size=64 contradicts {info}, which describes the backbone resume={weights} names; "
        f"drop that --set (the run takes {info}'s), or give all three as it says: --set network=r18 "
        "--set \"network_kwargs={'width_mult': 0.0625}\" --set embedding_size=32")


def test_a_bare_backbone_that_does_not_fit_the_config_is_told_the_set_line_that_fits(
        data, trained_backbone, tmp_path):
    status, err = run_here(data, tmp_path / "run", f"resume={trained_backbone}", config=FINE_TUNE_CONFIG,
                           base=FINE_TUNE_BASE)
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert err.strip().endswith(
        "it fits network r18, width_mult=0.0625, num_features=32: start with --set network=r18 "
        "--set \"network_kwargs={'width_mult': 0.0625}\" --set embedding_size=32"), err
    assert not (tmp_path / "run").exists()  # the folder it had started is gone again


@pytest.mark.parametrize(("item", "said"), [
    ("width_mult=0.0625", "--set width_mult=0.0625: width_mult is an option of the network, not a config key; write "
                          "it in network_kwargs, e.g. --set \"network_kwargs={'width_mult': 0.0625}\""),
    ("network_kwargs={width_mult:0.0625}", "the shell took the quotes off: quote the whole item, "
                                           "--set \"network_kwargs={'width_mult': 0.0625}\""),
])
def test_a_network_option_given_as_the_shell_leaves_it_is_told_the_set_line_that_works(item, said):
    with pytest.raises(ConfigError) as raised:
        load_config(ROOT / FINE_TUNE_CONFIG, [item])
    assert said in str(raised.value) and "timeout_minutes" not in str(raised.value)
    fixed = said.split("--set ")[-1].strip('"')
    assert load_config(ROOT / FINE_TUNE_CONFIG, [fixed]).network_kwargs == {"width_mult": 0.0625}


@pytest.mark.parametrize("frozen", ["freeze_backbone_steps=3", "freeze_backbone=True"])
def test_freezing_a_backbone_that_was_never_trained_is_refused(data, tmp_path, frozen):
    status, err = run_here(data, tmp_path / "run", frozen, "max_steps=1")
    assert status == 1
    assert err.strip() == (
        f"error: {frozen} keeps the backbone as it starts, but this run starts it from nothing (resume names no "
        "trained backbone), so the class centres would learn random features; set resume=path/to/backbone.pth to "
        "fine-tune a trained one, or freeze_backbone=False and freeze_backbone_steps=0 to train from nothing")
    assert not (tmp_path / "run").exists()
