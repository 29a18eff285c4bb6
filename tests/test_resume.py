"""Exact resume: N steps, stop, then --resume for N more is the 2N-step run, bit for bit.

Compared between the split and the uninterrupted run: every logged step's loss, view losses and LR
(TensorBoard, frequent=1), and the final checkpoint's backbone, whole class-centre matrix,
optimizer state (momentum / Adam moments), LR scheduler, grad scaler, every rank's loader position
and RNG streams. Sampled centres (sample_rate 0.5) and dropout draw from those streams, so any
state the resume forgot would change the numbers. One process runs through train.main in this
process; two run through `torchrun --nproc_per_node 2 train.py`.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from checkpoint.pointer import POINTER_NAME
from checkpoint.sharded import restore_state, save_state
from gpu_acceptance.runs import SAVED_STATE, load_run, scalars
from losses import CombinedMarginLoss
from partial_fc import PartialFC
from tests.run_helpers import assert_same_run, file_states, run_here, same_tensors
from tools import make_synthetic
from training.components import SavedPosition
from training.state import build_components
from utils.lr_scheduler import build_scheduler
from utils.metrics import open_metrics

# 1 process, 40 records, batch 4: 10 steps per epoch (5 with gradient_acc=2); each case names its data set.
ONE_PROCESS = {
    # fp16 on CPU: a real GradScaler backing off from 2^16 during the first 6 steps (the scaled
    # gradient of PartialFC's float16 cosines overflows), so the checkpoint at step 6 holds a scale in mid-descent; SGD
    # momentum; warmup then decay (the LR changes every step); the run crosses an epoch at step 10.
    "sgd_fp16_warmup": (6, ["fp16=True", "sample_rate=0.5", "warmup_epoch=1", "num_epoch=2"]),
    # AdamW moments, bf16 autocast, dropout (RNG), two micro-batches per step, stopped at an epoch end.
    "adamw_bf16_accumulation": (5, ["optimizer=adamw", "lr=0.01", "bf16=True", "gradient_acc=2", "sample_rate=0.5",
                                    "dropout=0.2", "num_epoch=4"]),
    # Two loader processes (persistent across the epoch the run crosses at step 10, restarted by the resume).
    "loader_workers": (6, ["num_workers=2", "sample_rate=0.5", "num_epoch=2"]),
}
# 80 one-view records (4 per identity), batch 8: 10 steps per epoch. The second view is another image of the
# identity, drawn per sample and epoch: the resume must draw the same ones.
IDENTITY_VIEWS = {
    "identity_views": (6, ["view_source='identity'", "batch_size=8", "sample_rate=0.5", "num_epoch=2"]),
}


@pytest.fixture(scope="module")
def one_view_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("one_view")
    assert make_synthetic.main(["--output", str(folder), "--identities", "20", "--images-per-identity", "4",
                                "--views", "1", "--val-identities", "10", "--val-pairs", "20", "--workers", "1"]) == 0
    return folder


@pytest.mark.parametrize("case", [*ONE_PROCESS, *IDENTITY_VIEWS])
def test_one_process_resume_is_the_uninterrupted_run(request, tmp_path, case):
    half, overrides = ONE_PROCESS[case] if case in ONE_PROCESS else IDENTITY_VIEWS[case]
    data = request.getfixturevalue("data" if case in ONE_PROCESS else "one_view_data")
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_here(data, whole, *overrides, f"max_steps={2 * half}") == (0, "")
    assert run_here(data, split, *overrides, f"max_steps={half}") == (0, "")
    stopped = load_run(split)
    assert stopped["progress"]["global_step"] == half
    if "fp16=True" in overrides:
        assert 1 < stopped["grad_scaler"]["scale"] < 2.0 ** 16  # the scaler state is not the default one
    assert run_here(data, split, *overrides, f"max_steps={2 * half}", resume=True) == (0, "")
    assert f"resumed from {split / 'checkpoint.json'} at global step {half}" in (split / "training.log").read_text()
    assert sorted(scalars(split, "loss")) == list(range(1, 2 * half + 1))  # each run logged its own steps
    assert_same_run(split, whole)


def test_resume_from_a_run_folder_or_a_checkpoint_file_into_a_new_output_folder(data, tmp_path):
    """`--set resume=<folder>` and `--set resume=<folder>/checkpoint.json` with a new output folder: both continue
    as the uninterrupted run would have, and the run they start from is left as it was."""
    overrides = ["sample_rate=0.5", "dropout=0.2"]
    first, whole = tmp_path / "first", tmp_path / "whole"
    assert run_here(data, whole, *overrides, "max_steps=4") == (0, "")
    assert run_here(data, first, *overrides, "max_steps=2") == (0, "")
    before = file_states(first)
    for name, source in (("from_folder", first), ("from_file", first / "checkpoint.json")):
        output = tmp_path / name
        assert run_here(data, output, *overrides, "max_steps=4", f"resume={source}") == (0, "")
        assert f"resumed from {first / 'checkpoint.json'} at global step 2" in (output / "training.log").read_text()
        assert sorted(scalars(output, "loss")) == [3, 4]
        for tag in ("loss", "loss_view1", "loss_view2", "learning_rate"):
            assert scalars(output, tag) == {step: value for step, value in scalars(whole, tag).items() if step > 2}
        resumed, uninterrupted = load_run(output), load_run(whole)
        for key in SAVED_STATE:
            assert same_tensors(resumed[key], uninterrupted[key]), (name, key)
    assert file_states(first) == before


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_grad_scaler_state_round_trips_through_a_checkpoint(tmp_path, device):
    """A scaler that grew twice and backed off once (growth tracker mid-interval) comes back from the
    checkpoint as it was, and then scales the next steps as the original does."""
    def make():
        torch.manual_seed(0)
        backbone, pfc = torch.nn.Linear(3, 4).to(device), PartialFC(CombinedMarginLoss(), 4, 5).to(device)
        optimizer = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}], lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 8, growth_interval=2)
        model = SimpleNamespace(backbone=backbone, pfc=pfc, optimizer=optimizer,
                                scheduler=build_scheduler(optimizer, 0, 100), scaler=scaler)
        model.components = build_components(model, {})
        return model

    def step(model, overflow: bool):
        loss = model.backbone(torch.ones(2, 3, device=device)).square().sum() + model.pfc.weight.sum()
        model.scaler.scale(loss).backward()
        if overflow:
            model.pfc.weight.grad[0, 0] = float("inf")
        model.scaler.step(model.optimizer)
        model.scaler.update()
        model.optimizer.zero_grad()

    original = make()
    for overflow in (False, False, False, False, True, False):  # grow, grow, back off, one good step
        step(original, overflow)
    scaler = original.scaler
    assert scaler.state_dict()["scale"] == 2.0 ** 9 and scaler.state_dict()["_growth_tracker"] == 1
    save_state(tmp_path, original, {"global_step": 6, "steps_per_epoch": 10, "nonfinite_total": 0},
               SavedPosition({"skipped": 0}), {}, {})

    restored = make()
    restore_state(tmp_path / POINTER_NAME, {}, restored)
    assert restored.scaler.state_dict() == scaler.state_dict()
    for run in (original, restored):
        step(run, overflow=False)  # completes the growth interval: the scale doubles
    assert restored.scaler.get_scale() == scaler.get_scale() == 2.0 ** 10


def test_a_resumed_run_leaves_one_tensorboard_point_per_step(tmp_path):
    """An earlier start logged every 3 steps up to step 6 but was last saved at step 4: the resumed run trains
    5 and 6 again and logs 6 over a shorter window. TensorBoard's reader (not ours) then shows one point at 6,
    the resumed run's, where two would stand otherwise."""
    earlier = SummaryWriter(log_dir=str(tmp_path / "tensorboard"))
    earlier.add_scalar("loss", 1.0, 3)
    earlier.add_scalar("loss", 2.0, 6)
    earlier.close()
    # An earlier start's file is older: named a minute back. (Both writers open within a second here, and the
    # name's last field, a per-process count, sorts 10 before 9: TensorBoard would read them the other way round.)
    (written,) = (tmp_path / "tensorboard").iterdir()
    stamp = written.name.split(".")[3]
    written.rename(written.with_name(written.name.replace(f".{stamp}.", f".{int(stamp) - 60:010d}.", 1)))
    metrics = open_metrics(SimpleNamespace(output=str(tmp_path), using_wandb=False, wandb_log_all=False),
                           resumed_at=4)
    metrics.add_scalar("loss", 3.0, 6)
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(event.step, event.value) for event in events.Scalars("loss")] == [(3, 1.0), (6, 3.0)]


@pytest.mark.parametrize("family", ["adaface", "elastic_arc"])
def test_a_margin_familys_state_resumes_as_the_uninterrupted_run(data, tmp_path, family):
    """AdaFace's EMAs (a fast rate, so they matter) and ElasticFace's draw position come back from the
    checkpoint: the resumed run's losses, weights and margin state are the uninterrupted run's."""
    overrides = [f"margin_family={family!r}", "adaface_t_alpha=0.5", "sample_rate=0.5"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_here(data, whole, *overrides, "max_steps=6") == (0, "")
    assert run_here(data, split, *overrides, "max_steps=3") == (0, "")
    assert run_here(data, split, *overrides, "max_steps=6", resume=True) == (0, "")
    assert_same_run(split, whole)
    margins = [json.loads(next(run.glob("checkpoint-*/state.json")).read_text())["run"]["margin"]
               for run in (split, whole)]
    assert margins[0] == margins[1] and margins[0]["step"] == 6, margins
