"""Exact resume: N steps, stop, then --resume for N more is the 2N-step run, bit for bit.

Compared between the split and the uninterrupted run: every logged step's loss, view losses and LR
(TensorBoard, frequent=1), and the final checkpoint's backbone, whole class-centre matrix,
optimizer state (momentum / Adam moments), LR scheduler, grad scaler, every rank's loader position
and RNG streams. Sampled centres (sample_rate 0.5) and dropout draw from those streams, so any
state the resume forgot would change the numbers. One process runs through train.main in this
process; two run through `torchrun --nproc_per_node 2 train.py`.
"""
from __future__ import annotations

import pytest
import torch

from tests.run_helpers import assert_same_run, load_run, run_here, scalars

# 1 process, 40 records, batch 4: 10 steps per epoch (5 with gradient_acc=2).
ONE_PROCESS = {
    # fp16 on CPU: a real GradScaler backing off from 2^16 during the first 8 steps (the scaled
    # gradient of PartialFC's float16 cosines overflows), so the checkpoint at step 6 holds a scale in mid-descent; SGD
    # momentum; warmup then decay (the LR changes every step); the run crosses an epoch at step 10.
    "sgd_fp16_warmup": (6, ["fp16=True", "sample_rate=0.5", "warmup_epoch=1", "num_epoch=2"]),
    # AdamW moments, bf16 autocast, dropout (RNG), two micro-batches per step, stopped at an epoch end.
    "adamw_bf16_accumulation": (5, ["optimizer=adamw", "lr=0.01", "bf16=True", "gradient_acc=2", "sample_rate=0.5",
                                    "dropout=0.2", "num_epoch=4"]),
}


@pytest.mark.parametrize("case", ONE_PROCESS)
def test_one_process_resume_is_the_uninterrupted_run(data, tmp_path, case):
    half, overrides = ONE_PROCESS[case]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_here(data, whole, *overrides, f"max_steps={2 * half}") == (0, "")
    assert run_here(data, split, *overrides, f"max_steps={half}") == (0, "")
    stopped = load_run(split)
    assert stopped["progress"]["global_step"] == half
    if "fp16=True" in overrides:
        assert 1 < stopped["grad_scaler"]["scale"] < 2.0 ** 16  # the scaler state is not the default one
    assert run_here(data, split, *overrides, f"max_steps={2 * half}", resume=True) == (0, "")
    assert f"resumed from {split / 'checkpoint.json'} at global step {half}" in (split / "training.log").read_text()
    logged = scalars(split, "loss")  # fp16 skips (and does not log) the steps its scaler backs off on
    assert max(logged) == 2 * half and len(logged) >= 4
    assert_same_run(split, whole)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_grad_scaler_state_round_trips_through_a_checkpoint(tmp_path, device):
    """A scaler that grew twice and backed off once (growth tracker mid-interval) comes back from the
    checkpoint as it was, and then scales the next steps as the original does."""
    from types import SimpleNamespace

    from losses import CombinedMarginLoss
    from partial_fc import PartialFC
    from utils.lr_scheduler import build_scheduler
    from utils.training_state import POINTER_NAME, restore_state, save_state

    def make():
        torch.manual_seed(0)
        backbone, pfc = torch.nn.Linear(3, 4).to(device), PartialFC(CombinedMarginLoss(), 4, 5).to(device)
        optimizer = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}], lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 8, growth_interval=2)
        return SimpleNamespace(backbone=backbone, pfc=pfc, optimizer=optimizer,
                               scheduler=build_scheduler(optimizer, 0, 100), scaler=scaler)

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
    save_state(tmp_path, original, {"global_step": 6}, {}, {}, {})

    restored = make()
    restore_state(tmp_path / POINTER_NAME, {}, restored)
    assert restored.scaler.state_dict() == scaler.state_dict()
    for run in (original, restored):
        step(run, overflow=False)  # completes the growth interval: the scale doubles
    assert restored.scaler.get_scale() == scaler.get_scale() == 2.0 ** 10
