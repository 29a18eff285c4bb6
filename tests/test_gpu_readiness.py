"""GPU and NCCL readiness, checked on a CPU: the device choice and its refusals, the process-group
setup, the numerics switches, the grad scaler after a skipped step, the deferred label check and the
half-precision backward of PartialFC.

Where a test needs a GPU that is not there (or, on a GPU machine, needs CUDA to be absent), it replaces
torch's *hardware queries* (is CUDA available, how many devices) and nothing else: the logic under test
runs as it is, and the file passes on a GPU machine too.
"""
from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bench import host_syncs
from checkpoint.checkpointer import BackgroundSave, HostStaging
from checkpoint.sharded import restore_state, stage_state, write_state
from facedata.staging import in_background
from losses import CombinedMarginLoss
from partial_fc import PartialFC
from tests.run_helpers import run_here
from tests.toy_state import INFO, make_model, take_steps
from training.components import SavedPosition
from training.state import TrainingState, build_optimizer
from training.step import _back_off, train_step
from utils import device as device_module
from utils.config import load_config
from utils.device import choose_device, configure_numerics, cuda_unavailable_reason
from utils.distributed import init_distributed
from utils.errors import ConfigError, DataError
from utils.launcher import local_process
from utils.lr_scheduler import build_scheduler


def test_auto_and_cpu_choose_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this test machine
    assert choose_device("auto", 0, 1) == torch.device("cpu")
    assert choose_device("cpu", 0, 1) == torch.device("cpu")


def test_cuda_without_a_driver_names_the_driver_the_build_needs(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_module, "NVIDIA_DRIVER_FILE", tmp_path / "absent")
    with pytest.raises(ConfigError) as error:
        choose_device("cuda", 0, 1)
    message = str(error.value)
    assert message.startswith("device='cuda' but CUDA cannot be used here: no NVIDIA driver is loaded")
    assert f"built for CUDA {torch.version.cuda}" in message and "or set device='cpu'" in message
    if torch.version.cuda.startswith("13."):
        assert "needs NVIDIA driver 580.65.06 or newer" in message


def test_an_old_driver_and_a_build_without_cuda_are_told_apart(monkeypatch, tmp_path):
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    monkeypatch.setattr(device_module, "NVIDIA_DRIVER_FILE", driver)
    assert cuda_unavailable_reason().startswith(f"the NVIDIA driver is 535.104.05 but this torch is built for CUDA "
                                                f"{torch.version.cuda}")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "is built without CUDA" in cuda_unavailable_reason()


def test_more_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match=r"^4 processes on this node but 2 GPU\(s\) visible "
                                          r"\(CUDA_VISIBLE_DEVICES=0,1\); start torchrun with --nproc_per_node=2"):
        choose_device("auto", 3, 4)


@pytest.mark.parametrize("environment, expected", [
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16"}, (3, 8)),
    ({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)", "WORLD_SIZE": "8"}, (1, None)),
    ({}, (0, 1)),
])
def test_the_local_gpu_comes_from_torchrun_or_slurm(monkeypatch, environment, expected):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert local_process() == expected


def test_several_processes_without_a_local_rank_are_refused(monkeypatch):
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="neither LOCAL_RANK .* nor SLURM_LOCALID .*; start training with torchrun"):
        local_process()


def test_the_process_group_gets_the_timeout_and_no_device_on_a_cpu(monkeypatch):
    calls = []
    real = dist.init_process_group

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "init_process_group", spy)
    try:
        init_distributed(torch.device("cpu"), timeout_minutes=7)
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()
    assert calls == [{"backend": "gloo", "init_method": "env://", "timeout": timedelta(minutes=7), "device_id": None}]


def test_deterministic_sets_what_it_says(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    configure_numerics(torch.device("cpu"), tf32=False, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    configure_numerics(torch.device("cpu"), tf32=True, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark  # autotuning is for GPUs
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"


def _scaler_after(steps: list[str]) -> torch.amp.GradScaler:
    """A CPU GradScaler after steps that are "good", "overflow" (an infinite gradient the scaler finds
    itself) or "other_rank" (finite here, skipped because another rank's loss was not: training.step._back_off)."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    for kind in steps:
        scaler.scale(weight.sum()).backward()
        if kind == "overflow":
            weight.grad[0] = float("inf")
        scaler.unscale_(optimizer)
        if kind == "other_rank":
            _back_off(scaler)
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
    return scaler


@pytest.mark.parametrize("before", [[], ["good", "good"], ["good", "good", "good", "good"]])
def test_a_skip_for_another_ranks_loss_backs_the_scaler_off_as_an_overflow_would(before):
    found, other_rank = _scaler_after([*before, "overflow"]), _scaler_after([*before, "other_rank"])
    assert other_rank.state_dict() == found.state_dict()
    assert found.state_dict()["_growth_tracker"] == 0
    after = ["good", "good", "good"]  # one growth interval: both grow at the same step
    assert _scaler_after([*before, "other_rank", *after]).state_dict() == _scaler_after([*before, "overflow", *after]
                                                                                  ).state_dict()


def test_a_deferred_label_check_poisons_the_loss_and_then_names_the_label():
    pfc = PartialFC(CombinedMarginLoss(), 8, 7, defer_label_check=True)
    loss, _ = pfc(torch.randn(2, 8), torch.tensor([0, 9]))
    assert torch.isnan(loss)
    with pytest.raises(DataError, match=r"label 9 \(sample 1 on rank 0\) is outside \[0, 7\)"):
        pfc.check_labels(torch.tensor([0, 9]))
    good, _ = pfc(torch.randn(2, 8), torch.tensor([0, 6]))
    assert torch.isfinite(good)


def test_train_step_turns_a_deferred_bad_label_into_its_data_error(tmp_path):
    (tmp_path / "c.py").write_text("")
    cfg = load_config(tmp_path / "c.py", ["embedding_size=8"])
    backbone = torch.nn.Sequential(torch.nn.AvgPool2d(8), torch.nn.Flatten(), torch.nn.Linear(3 * 14 * 14, 8))
    pfc = PartialFC(CombinedMarginLoss(), 8, 5, defer_label_check=True)
    optimizer = build_optimizer(cfg, backbone, pfc)
    state = TrainingState(backbone=backbone, ddp_backbone=backbone, pfc=pfc, optimizer=optimizer,
                          scheduler=build_scheduler(optimizer, 0, 10),
                          scaler=torch.amp.GradScaler("cpu", enabled=False), precision=None)
    images = torch.zeros((2, 1, 3, 112, 112), dtype=torch.uint8)
    with pytest.raises(DataError, match=r"label 5 .* is outside \[0, 5\)"):
        train_step(state, [(images, torch.tensor([1, 5]))], cfg)


def test_half_precision_backward_stays_finite_for_small_centres():
    """Centres of norm ~1e-4: 1/|w| ~ 1e4 on top of the loss scale would overflow float16 if it were
    cast with the gradient; it is applied in float32 instead. Compared with the float32 backward."""
    torch.manual_seed(0)
    results = {}
    for dtype in (torch.float16, None):
        pfc = PartialFC(CombinedMarginLoss(), 16, 40, seed=3)
        with torch.no_grad():
            pfc.weight.mul_(0.01)
        views = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, _ = pfc(list(views), torch.arange(8))
        (loss * 2.0 ** 12).backward()  # a grad scaler's scale
        results[dtype] = (views.grad, pfc.weight.grad)
    for half, full in zip(results[torch.float16], results[None]):
        assert torch.isfinite(half).all()
        torch.testing.assert_close(half, full, rtol=2e-2, atol=2e-2 * full.abs().max().item())


def test_the_start_up_log_names_the_device_and_backend(data, tmp_path):
    output = tmp_path / "run"
    assert run_here(data, output, "max_steps=1")[0] == 0
    log = (output / "training.log").read_text()
    device = "cuda:0 (" if torch.cuda.is_available() else "cpu ("  # device="auto"
    assert f"device {device}" in log and "backend none (one process), 1 process(es) on 1 node(s)" in log


def _record_set_device(monkeypatch) -> list[tuple[str, torch.device]]:
    """(thread name, device) of every torch.cuda.set_device call from now on (no GPU is touched)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append((threading.current_thread().name, torch.device(device))))
    return calls


def test_an_async_saves_writer_thread_takes_the_process_gpu_and_no_cuda_stream(monkeypatch, tmp_path):
    """A new thread starts on GPU 0: the writer must set its rank's device before its first CUDA call, and
    DCP's copy-ahead (a CUDA stream of the writing thread) must not run for host copies. CUDA is reported
    available, so DCP takes its GPU path: a CUDA stream asked for here, without a driver, would raise."""
    model = make_model("sgd")
    take_steps(model)
    staged = stage_state(model, {"global_step": 2, "steps_per_epoch": 10, "nonfinite_total": 0},
                         SavedPosition({"skipped": 0}), INFO, {}, HostStaging().copy)
    calls = _record_set_device(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    folder = BackgroundSave(lambda: write_state(tmp_path, staged), torch.device("cuda", 3)).wait()
    monkeypatch.undo()
    assert calls == [("checkpoint-writer", torch.device("cuda", 3))]
    restored = make_model("sgd", seed=5)
    restore_state(folder, INFO, restored)
    assert torch.equal(restored.pfc.weight, model.pfc.weight)


def test_the_batch_staging_thread_takes_the_loaders_gpu_before_staging(monkeypatch):
    calls = _record_set_device(monkeypatch)
    seen = []

    def stage(item):
        seen.append((item, list(calls)))
        return item

    assert list(in_background(range(2), stage, torch.device("cuda", 5))) == [0, 1]
    assert seen[0] == (0, [("batch staging", torch.device("cuda", 5))])
    assert calls == [("batch staging", torch.device("cuda", 5))]


def test_threads_on_a_cpu_set_no_cuda_device(monkeypatch, tmp_path):
    calls = _record_set_device(monkeypatch)
    assert list(in_background(range(2), lambda item: item, torch.device("cpu"))) == [0, 1]
    assert BackgroundSave(lambda: tmp_path, torch.device("cpu")).wait() == tmp_path
    assert calls == []


def test_the_growth_rows_steps_each_train_on_new_seeded_labels_and_images(monkeypatch):
    """At sample_rate 0 the sampled centres are the step's labels: one batch used again and again would keep
    their number, and the allocator's block sizes, fixed, and growth could not show."""
    seen = []

    def recording(state, batches, cfg):
        images, labels = batches[0]
        seen.append((images.clone(), labels.clone()))
        return train_step(state, batches, cfg)

    monkeypatch.setattr(host_syncs, "train_step", recording)
    runs = []
    for _ in range(2):
        step = host_syncs.training_step(torch.device("cpu"), 50, 2, "sample_rate=0")
        for _ in range(3):
            step()
        runs.append(seen[:])
        seen.clear()
    first = runs[0]
    assert all(not torch.equal(a[1], b[1]) and not torch.equal(a[0], b[0]) for a, b in zip(first, first[1:]))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, runs[1]))  # seeded
