"""train.py end to end on tiny synthetic two-view data: a real 2-process gloo run through torchrun,
its log, TensorBoard file, verification lines and checkpoints; resume (also on another world size);
the output folder guard."""
from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from backbones import get_model
from gpu_acceptance.runs import load_run
from tests.run_helpers import continue_command, digest, run_cli, run_command, run_here

NETWORK = ["network=r18", "network_kwargs={'width_mult': 0.0625}", "embedding_size=32"]
TINY = (*NETWORK, "batch_size=4", "num_workers=0", "frequent=2", "verbose=4", "num_epoch=2")
LOG_LINE = re.compile(r"Speed [\d.]+ samples/sec [\d.]+ images/sec   Loss [\d.]+ \(v1 [\d.]+ v2 [\d.]+\)   "
                      r"LR [\d.]+   Epoch: \d+   Global Step: (\d+)   Required: \d+ (seconds|minutes|hours)")


def train(data: Path, output: Path, *overrides: str, nproc: int = 0, resume: bool = False, env=None,
          nan_steps: str | None = None, real: bool = False):
    """train.py with these tests' settings (every other step logged, verification at step 4)."""
    return run_cli(data, output, *overrides, nproc=nproc, resume=resume, base=TINY, env=env, nan_steps=nan_steps,
                   real=real)


def train_here(data: Path, output: Path, *overrides: str, resume: bool = False) -> SimpleNamespace:
    """What `train` runs, as train.main in this process (a one-process run's process start adds nothing these
    tests check): .returncode and .stderr as `train`'s."""
    status, stderr = run_here(data, output, *overrides, resume=resume, base=TINY)
    return SimpleNamespace(returncode=status, stderr=stderr)


def steps_logged(text: str) -> list[int]:
    return [int(m.group(1)) for m in LOG_LINE.finditer(text)]


@pytest.fixture(scope="module")
def two_process_run(data, tmp_path_factory):
    output = tmp_path_factory.mktemp("runs") / "two"
    result = train(data, output, "max_steps=4", nproc=2, real=True)  # the command line itself: torchrun's workers
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return output, result


def test_two_process_run_logs_verifies_and_checkpoints(two_process_run, data):
    output, result = two_process_run
    log = (output / "training.log").read_text()
    assert steps_logged(log) == [2, 4]
    assert "2 process(es)" in log
    assert re.search(r"\[synthetic_val\]\[4\]Accuracy-Flip: [\d.]+\+-[\d.]+", log)
    assert re.search(r"\[synthetic_val\]\[4\]XNorm: [\d.]+", log)
    assert log.count("]Accuracy-Flip") == 1  # step 4 was verified; the end of training does not repeat it
    assert steps_logged(result.stdout) == [2, 4]  # rank 0 also prints to stdout; no rank prints twice

    checkpoint = load_run(output)
    assert checkpoint["world_size"] == 2 and checkpoint["progress"]["global_step"] == 4
    assert tuple(checkpoint["class_centres"].shape) == (20, 32)  # the whole matrix, both shards
    assert len(checkpoint["per_rank"]) == 2
    assert checkpoint["model"] == {"network": "r18", "network_kwargs": {"width_mult": 0.0625}, "embedding_size": 32,
                                   "num_classes": 20}

    backbone = get_model("r18", num_features=32, width_mult=0.0625)
    backbone.load_state_dict(torch.load(output / "backbone.pth", weights_only=True), strict=True)
    assert all(value.device.type == "cpu" for value in torch.load(output / "backbone.pth").values())
    assert torch.equal(backbone.state_dict()["fc.weight"], checkpoint["backbone"]["fc.weight"])


def test_two_process_run_writes_tensorboard_scalars(two_process_run):
    output, _ = two_process_run
    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "loss_view1", "loss_view2", "learning_rate", "samples_per_sec", "synthetic_val"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [2, 4]
    assert all(0 < e.value < 100 for e in events.Scalars("loss"))


def test_resume_on_one_process_continues_at_the_saved_step_with_the_saved_lr(two_process_run, data, tmp_path):
    output = Path(shutil.copytree(two_process_run[0], tmp_path / "run"))  # the shared run stays as it was
    saved = load_run(output)
    saved_lr = saved["optimizer"]["param_groups"][0]["lr"]
    # 2 ranks x 5 batches of 4 per epoch became 1 rank x 10: step 4 of 10 is step 8 of 20
    result = train_here(data, output, "max_steps=10", resume=True)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (output / "training.log").read_text()
    assert f"resumed from {output / 'checkpoint.json'} at global step 4 (epoch 0), lr {saved_lr:.6f}" in log
    assert ("resuming a run of 2 process(es) and 5 steps per epoch with 1 and 10: step 4 becomes step 8 of the LR "
            "schedule; the log and TensorBoard go on counting from step 4; the data order of this epoch differs from "
            "the original run") in log
    assert ("max_steps=10 counts steps of the LR schedule (10 per epoch now): this run stops at its step 10, shown in "
            "the log and TensorBoard as step 6") in log
    assert steps_logged(log) == [2, 4, 6]  # schedule steps 9 and 10 are the run's 5th and 6th
    resumed = load_run(output)
    assert resumed["world_size"] == 1 and resumed["progress"]["global_step"] == 10
    assert tuple(resumed["class_centres"].shape) == (20, 32)


def test_resume_in_the_same_world_continues_exactly_where_it_stopped(data, tmp_path):
    output = tmp_path / "run"
    first = train_here(data, output, "max_steps=3", "frequent=1", "verbose=100")
    assert first.returncode == 0, first.stderr[-3000:]
    saved = load_run(output)
    assert saved["progress"]["global_step"] == 3
    second = train_here(data, output, "max_steps=6", "frequent=1", "verbose=100", resume=True)
    assert second.returncode == 0, second.stderr[-3000:]
    log = (output / "training.log").read_text()
    lr = saved["optimizer"]["param_groups"][0]["lr"]
    assert f"at global step 3 (epoch 0), lr {lr:.6f}" in log
    assert "data order" not in log  # the same world size continues the same order
    assert steps_logged(log) == [1, 2, 3, 4, 5, 6]
    scheduler = load_run(output)["scheduler"]
    assert scheduler["last_epoch"] == 6


def test_an_existing_run_is_never_overwritten_without_resume_and_a_finished_one_says_how_to_train_on(data, tmp_path):
    output = tmp_path / "run"
    assert train_here(data, output, "max_steps=1").returncode == 0
    before = {p.name: digest(p) for p in output.iterdir() if p.is_file()}
    again = train_here(data, output, "max_steps=1")
    assert again.returncode != 0
    command = continue_command(data, output, "max_steps=2", base=TINY)
    assert again.stderr.strip().splitlines() == [
        f"error: output folder {output} holds a run that finished training at global step 1 (max_steps=1); to "
        f"train it on, raise max_steps and continue it, e.g. with: {command}; or choose a new folder with --set "
        "output=<folder>"]
    assert {p.name: digest(p) for p in output.iterdir() if p.is_file()} == before
    # The command given continues this run, not the config's own output folder's.
    on = run_command([sys.executable, *shlex.split(command)[1:]], timeout=300)
    assert on.returncode == 0, on.stderr[-3000:]
    log = (output / "training.log").read_text()
    assert f"resumed from {output / 'checkpoint.json'} at global step 1" in log
    assert "training finished at global step 2" in log


def test_starting_from_a_bare_backbone_loads_it_and_says_so(data, tmp_path):
    """With lr 0 nothing moves, so the backbone.pth a run writes holds the bare backbone's weights bit for bit
    (BatchNorm statistics aside: they move in every forward), and a fresh run's differ from them."""
    weights = tmp_path / "arcface_torch_model.pt"
    torch.manual_seed(1)
    bare = get_model("r18", num_features=32, width_mult=0.0625)
    torch.save(bare.state_dict(), weights)
    output, fresh = tmp_path / "finetune", tmp_path / "fresh"
    assert run_here(data, output, "max_steps=2", "lr=0.0", f"resume={weights}", base=TINY) == (0, "")
    assert run_here(data, fresh, "max_steps=2", "lr=0.0", base=TINY) == (0, "")
    assert f"initialised the backbone from {weights} (a bare backbone" in (output / "training.log").read_text()
    parameters = [name for name, _ in bare.named_parameters()]
    started, fresh_start = (torch.load(run / "backbone.pth", weights_only=True) for run in (output, fresh))
    assert all(torch.equal(started[name], bare.state_dict()[name]) for name in parameters)
    assert not all(torch.equal(fresh_start[name], bare.state_dict()[name]) for name in parameters)
