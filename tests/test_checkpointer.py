"""The checkpointer (checkpoint/checkpointer.py) in one process, without training: when a run saves (every
save_every_steps, at each epoch's end and at the end of the run, never twice at one step; a save due inside a
streak of non-finite losses waits for the next good step), at which log level it says so, what a resume puts
back (the step, or the step renumbered for another epoch length, and the LR schedule that a changed lr or
num_epoch asks for), what it says about the keys a resume changes, and what a stopped run's last line names.

The checkpoints are real (checkpoint/sharded.py, in tmp_path) and the state is tests/toy_state.py's toy model;
the reference for every learning rate is a fresh scheduler stepped by hand. Whole runs that save and resume
are in test_resume.py and test_resume_said.py.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from backbones import get_model
from checkpoint.checkpointer import BackgroundSave, Checkpointer, HostStaging, Renumbering, last_good
from checkpoint.pointer import POINTER_NAME
from checkpoint.run_dir import RUN_CONFIG_NAME
from checkpoint.sources import LEGACY_NAME, find_resume_source
from tests import test_arcface as arcface
from tests.distributed_helpers import run_world
from tests.test_sources import legacy_checkpoint
from tests.toy_state import INFO, NUM_CLASSES, make_model, take_steps
from training.components import SavedPosition
from training.state import StepCounter, build_components
from utils.lr_scheduler import build_scheduler

CONFIG = {"lr": 0.1, "backbone_lr_mult": 1.0, "num_epoch": 2, "warmup_epoch": 0, "frequent": 1,
          "output": "first", "mean": [0.5, 0.5]}
WARMUP, TOTAL = 2, 20  # toy_state.make_model's schedule


def checkpointer(output, model, config=CONFIG, **kwargs) -> Checkpointer:
    return Checkpointer(str(output), model, SavedPosition({"skipped": 0}), INFO, config, **kwargs)


def published_step(output) -> int | None:
    pointer = output / POINTER_NAME
    return json.loads(pointer.read_text())["global_step"] if pointer.is_file() else None


def saves(output, saver: Checkpointer, steps_per_epoch: int, last: int, streaks: dict[int, int] = {}) -> list[int]:  # noqa: B006
    """The steps 1..last (the last one final) after which `saver` saved; `streaks`: the non-finite losses in a
    row at a step. Each save is checked to be the published checkpoint at once."""
    counter, saved = StepCounter(steps_per_epoch=steps_per_epoch), []
    for step in range(1, last + 1):
        counter.global_step, counter.nonfinite_in_a_row = step, streaks.get(step, 0)
        before = published_step(output)
        if saver.after_step(counter, final=True) if step == last else saver.after_step(counter):
            saved.append(step)
            assert published_step(output) == step
        else:
            assert published_step(output) == before, step
        assert not saver.after_step(counter, final=step == last)  # never twice at one step
    return saved


def test_a_save_is_due_every_save_every_steps_at_each_epoch_end_and_at_the_end(tmp_path):
    assert saves(tmp_path / "every3", checkpointer(tmp_path / "every3", make_model("sgd"), save_every_steps=3),
                 steps_per_epoch=5, last=13) == [3, 5, 6, 9, 10, 12, 13]
    assert saves(tmp_path / "epochs", checkpointer(tmp_path / "epochs", make_model("sgd")),
                 steps_per_epoch=5, last=7) == [5, 7]


def test_a_save_due_inside_a_non_finite_streak_waits_for_the_next_good_step_but_the_last_never_waits(tmp_path):
    # due at 4 (an epoch's end) inside a streak of 2: saved at 6, the first good step; 8 as usual; 9 is the end
    saver = checkpointer(tmp_path, make_model("sgd"))
    assert saves(tmp_path, saver, steps_per_epoch=4, last=9, streaks={4: 1, 5: 2, 9: 1}) == [6, 8, 9]


def test_a_save_for_exit_saves_only_a_step_not_saved_yet_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="checkpoint.checkpointer")
    saver, counter = checkpointer(tmp_path, make_model("sgd")), StepCounter(global_step=3, steps_per_epoch=10)
    saver.save_for_exit(counter)
    assert published_step(tmp_path) == 3
    folders = sorted(path.name for path in tmp_path.iterdir())
    saver.save_for_exit(counter)
    assert sorted(path.name for path in tmp_path.iterdir()) == folders
    counter.global_step = 4
    saver.save_for_exit(counter)
    assert published_step(tmp_path) == 4
    assert said_saves(caplog) == [(True, 3), (True, 4)]  # the last save of a run is said
    assert f"saved {tmp_path / 'checkpoint-000000004'} at global step 4" in caplog.messages


def said_saves(caplog) -> list[tuple[bool, int]]:
    """(whether the terminal shows it as well as training.log, the step) of each save said."""
    return [(not getattr(record, "file_only", False), record.args[1]) for record in caplog.records
            if record.name == "checkpoint.checkpointer" and record.msg.startswith("saved ") and
            record.levelno == logging.INFO]


def test_every_save_is_said_in_the_log_and_on_the_terminal_at_most_once_per_ten_log_lines_and_at_the_end(
        tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="checkpoint.checkpointer")
    saver = checkpointer(tmp_path, make_model("sgd"), config={**CONFIG, "frequent": 2}, save_every_steps=1)
    assert saves(tmp_path, saver, steps_per_epoch=100, last=22) == list(range(1, 23))
    # a log line every 2 steps: at most one save shown on the terminal per 20 steps; training.log has them all
    assert said_saves(caplog) == [(step in (1, 21, 22), step) for step in range(1, 23)]


def test_a_stopped_runs_last_line_names_the_checkpoint_left_or_the_backbone_or_nothing(tmp_path):
    assert last_good(str(tmp_path), "--resume X") == "no checkpoint had been written yet"
    (tmp_path / "backbone.pth").write_bytes(b"")
    assert last_good(str(tmp_path), "--resume X") == f"the last good backbone.pth in {tmp_path} is untouched"
    (tmp_path / POINTER_NAME).write_bytes(b"")
    assert last_good(str(tmp_path), "--resume X") == (f"the last good {POINTER_NAME} in {tmp_path} is untouched "
                                                      "(continue with: --resume X)")
    assert last_good(str(tmp_path)).endswith("(continue with: --resume)")
    assert checkpointer(tmp_path, make_model("sgd")).continue_with == "--resume"  # what the stop lines advise


def lr_after(steps: int, total: int = TOTAL, lr: float = 0.1, warmup: int = WARMUP) -> float:
    """The centres' learning rate after `steps` steps of a fresh schedule stepped by hand."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = build_scheduler(optimizer, warmup, total)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


def saved_run(output, step: int, steps_per_epoch: int, shown_offset: int = 0):
    """A checkpoint of the toy model at `step` (that many real optimizer steps), saved by the
    checkpointer, and the model's centres then."""
    model = make_model("sgd", seed=1)
    take_steps(model, step)
    checkpointer(output, model).save(StepCounter(global_step=step, steps_per_epoch=steps_per_epoch,
                                                 shown_offset=shown_offset))
    return model.pfc.weight.detach().clone()


def test_a_resume_on_the_same_epoch_length_goes_on_at_the_saved_step(tmp_path, caplog):
    centres = saved_run(tmp_path, 7, steps_per_epoch=10)
    model = make_model("sgd", seed=2)
    saver, counter = checkpointer(tmp_path, model), StepCounter(steps_per_epoch=10)
    restored = saver.resume(find_resume_source(tmp_path / POINTER_NAME), counter)
    assert torch.equal(model.pfc.weight, centres) and restored.progress["global_step"] == 7
    assert (counter.global_step, counter.shown_step, saver.saved_at, saver.renumbering) == (7, 7, 7, None)
    assert model.scheduler.last_epoch == 7 and model.optimizer.param_groups[1]["lr"] == lr_after(7)
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_a_resume_on_another_epoch_length_renumbers_the_step_and_its_schedule_and_says_so(tmp_path, caplog):
    saved_run(tmp_path, 7, steps_per_epoch=10, shown_offset=3)  # shown as step 10 (a renumbered run before)
    model = make_model("sgd", seed=2)
    saver, counter = checkpointer(tmp_path, model), StepCounter(steps_per_epoch=8)
    saver.resume(find_resume_source(tmp_path / POINTER_NAME), counter)
    # 7 of 10 steps per epoch is 5.6 of 8: step 6, shown as 10 still (an offset of 4)
    assert (counter.global_step, counter.shown_step, saver.saved_at) == (6, 10, 6)
    assert saver.renumbering == Renumbering(saved_step=7, saved_steps_per_epoch=10, steps_per_epoch=8, step=6)
    assert saver.renumbering.describe() == ("step 7 of the saved run, which had 10 steps per epoch where this one "
                                            "has 8")
    assert model.scheduler.last_epoch == 6 and model.optimizer.param_groups[1]["lr"] == lr_after(6)
    (warning,) = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warning == ("resuming a run of 1 process(es) and 10 steps per epoch with 1 and 8: step 7 becomes step 6 "
                       "of the LR schedule; the log and TensorBoard go on counting from step 10; the data order of "
                       "this epoch differs from the original run")


EFFECTS = {"lr": "every LR from this step on is scaled by new / old = 2",
           "num_epoch": "the LR schedule now spans another number of epochs: the LR from this step on differs from "
                        "the original plan",
           "warmup_epoch": "the warmup now ends at another epoch: the LR from this step on differs from the original "
                           "plan"}


def test_a_resume_that_changes_lr_num_epoch_or_warmup_follows_the_new_schedule_and_names_each_change(tmp_path,
                                                                                                      caplog):
    saved_run(tmp_path, 7, steps_per_epoch=10)
    caplog.set_level(logging.INFO, logger="checkpoint.checkpointer")
    for changes, total, warmup, lr in (({"lr": 0.2}, TOTAL, WARMUP, 0.2), ({"num_epoch": 4}, 2 * TOTAL, WARMUP, 0.1),
                                       ({"warmup_epoch": 1}, TOTAL, 10, 0.1)):
        caplog.clear()
        model = make_model("sgd", seed=2)
        model.scheduler = build_scheduler(model.optimizer, warmup, total)  # the new run's schedule
        model.components = build_components(model, {})
        # output: a value JSON cannot hold (a Path, as a config file may set) is compared by its repr
        config = {**CONFIG, **changes, "output": Path("elsewhere"), "mean": (0.5, 0.5), "frequent": 2}
        checkpointer(tmp_path, model, config).resume(find_resume_source(tmp_path / POINTER_NAME),
                                                     StepCounter(steps_per_epoch=10))
        assert model.scheduler.base_lrs == [lr, lr]
        assert [group["lr"] for group in model.optimizer.param_groups] == [lr_after(7, total, lr, warmup)] * 2
        said = [(record.levelno, record.getMessage()) for record in caplog.records
                if record.getMessage().startswith("config changed on resume")]
        ((key, new),) = changes.items()
        # where the run lives (output) and a tuple saved as a list are no change
        assert said == [(logging.WARNING, f"config changed on resume: {key} {CONFIG[key]!r} -> {new!r}: "
                                          f"{EFFECTS[key]}"),
                        (logging.INFO, "config changed on resume: frequent: 1 -> 2")], key


def test_a_resume_from_a_checkpoint_folder_without_checkpoint_json_says_so(tmp_path, caplog):
    centres = saved_run(tmp_path, 7, steps_per_epoch=10)
    (tmp_path / POINTER_NAME).unlink()
    source = find_resume_source(tmp_path)
    assert source.path == tmp_path / "checkpoint-000000007"
    model = make_model("sgd", seed=2)
    checkpointer(tmp_path, model).resume(source, StepCounter(steps_per_epoch=10))
    assert torch.equal(model.pfc.weight, centres)
    (warning,) = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warning == (f"{tmp_path} holds no {POINTER_NAME}: resuming from {source[1]}, its newest complete "
                       "checkpoint folder, once every file matches its checksum")


def test_a_resume_from_an_earlier_versions_file_or_arcface_torchs_folder_or_a_bare_backbone(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    centres = torch.arange(NUM_CLASSES * 3, dtype=torch.float32).reshape(NUM_CLASSES, 3)
    (tmp_path / "legacy").mkdir()
    # progress as the first checkpoint.pt wrote it: no count of non-finite steps yet
    legacy_checkpoint(tmp_path / "legacy" / LEGACY_NAME, centres, -centres, world_size=1)
    model, counter = make_model("sgd", seed=2), StepCounter(steps_per_epoch=10)
    restored = checkpointer(tmp_path / "legacy", model).resume(find_resume_source(tmp_path / "legacy"), counter)
    assert torch.equal(model.pfc.weight, centres) and counter.global_step == restored.progress["global_step"] == 1

    written = arcface.write_2021(tmp_path / "arcface", world_size=1)
    model = arcface.make_model("sgd")
    model.scheduler, model.scaler = build_scheduler(model.optimizer, WARMUP, TOTAL), None
    Checkpointer(str(tmp_path / "arcface"), model, SavedPosition({"skipped": 0}), arcface.INFO21, CONFIG).resume(
        find_resume_source(tmp_path / "arcface"), StepCounter(steps_per_epoch=10))
    assert torch.equal(model.pfc.weight, written["weight"])

    torch.manual_seed(3)
    start = get_model("r18", num_features=arcface.DIM, width_mult=arcface.WIDTH)
    torch.save(start.state_dict(), tmp_path / "start.pth")
    model = arcface.make_model("sgd")
    saver = Checkpointer(str(tmp_path / "run"), model, SavedPosition({"skipped": 0}), arcface.INFO21, CONFIG)
    assert saver.resume(find_resume_source(tmp_path / "start.pth"), StepCounter()) is None
    assert all(torch.equal(value, start.state_dict()[key]) for key, value in model.backbone.state_dict().items())
    assert (f"initialised the backbone from {tmp_path / 'start.pth'} (a bare backbone: class centres, optimizer "
            "and schedule start fresh)") in caplog.messages
    assert not [message for message in caplog.messages if f"holds no {POINTER_NAME}" in message]  # said of folders


def test_a_published_save_writes_the_config_file_overrides_and_values_the_run_was_started_with(tmp_path):
    for config_file, overrides, listed in (("configs/x.py", ["lr=0.2", "output=elsewhere"], ["lr=0.2"]),
                                           (None, None, [])):
        output = tmp_path / str(config_file).replace("/", "_")
        arguments = {} if config_file is None else dict(config_file=config_file, overrides=overrides)
        checkpointer(output, make_model("sgd"), **arguments).save(StepCounter(global_step=1))
        assert json.loads((output / RUN_CONFIG_NAME).read_text()) == {"config_file": config_file or "",
                                                                       "set": listed, "config": CONFIG}


def test_without_save_all_states_a_save_writes_the_backbone_alone_with_its_verification(tmp_path):
    model = make_model("sgd")
    saver, counter = checkpointer(tmp_path, model, save_all_states=False), StepCounter(steps_per_epoch=2)
    counter.verification = {"lfw": {"accuracy": 0.75}}
    saved = []
    for step in (1, 2, 3):
        counter.global_step = step
        saved += [step] if saver.after_step(counter, final=step == 3) else []
        assert not saver.after_step(counter, final=step == 3)
    assert saved == [2, 3]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["backbone.pth", "model.json"]
    saved = torch.load(tmp_path / "backbone.pth", weights_only=True)
    assert saved.keys() == model.backbone.state_dict().keys()
    assert all(torch.equal(saved[key], value) for key, value in model.backbone.state_dict().items())
    assert json.loads((tmp_path / "model.json").read_text()) == {**INFO, "verification": counter.verification}


def test_an_async_save_returns_before_its_files_are_written_and_writes_the_state_as_it_was(tmp_path, caplog):
    """The writer thread is held where it starts writing (a trace function on the threads save() starts)
    while the step trains on: what it writes is the state at save()."""
    caplog.set_level(logging.DEBUG, logger="checkpoint.checkpointer")
    model = make_model("sgd", seed=1)
    saver = checkpointer(tmp_path, model, async_save=True)
    writing, release = threading.Event(), threading.Event()

    writers = []

    def hold_the_writer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "write_state":
            writers.append(threading.current_thread())
            writing.set()
            release.wait(60)

    at_save = model.pfc.weight.detach().clone()
    threading.settrace(hold_the_writer)
    try:
        saver.save(StepCounter(global_step=3, steps_per_epoch=10))
    finally:
        threading.settrace(None)
    assert writing.wait(30) and published_step(tmp_path) is None  # save() returned; nothing is written yet
    assert writers[0].daemon  # a process stopping on an error does not wait for it: the last checkpoint stays
    with torch.no_grad():
        model.pfc.weight.add_(1.0)  # the next steps train on while the save is written
    release.set()
    saver.wait_for_save()
    assert published_step(tmp_path) == 3
    fresh = make_model("sgd", seed=2)
    checkpointer(tmp_path, fresh).resume(find_resume_source(tmp_path / POINTER_NAME), StepCounter(steps_per_epoch=10))
    assert torch.equal(fresh.pfc.weight, at_save)
    saver.save(StepCounter(global_step=4, steps_per_epoch=10))
    saver.save(StepCounter(global_step=5, steps_per_epoch=10), final=True)  # waits for step 4's, then its own
    assert published_step(tmp_path) == 5
    assert [step for _, step in said_saves(caplog)] == [3, 4, 5]


def test_the_host_staging_keeps_one_buffer_per_tensor_from_save_to_save():
    """An async save's host copies reuse their buffers while a tensor keeps its shape and dtype (the memory plan
    counts one set), and take new ones, of the tensor's dtype, when it changes."""
    staging = HostStaging()
    first = staging.copy("centres", torch.arange(6.0).reshape(2, 3))
    again = staging.copy("centres", torch.ones(2, 3))
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.ones(2, 3))
    for changed in (torch.zeros(3, 2), torch.arange(6, dtype=torch.float64).reshape(2, 3),
                    torch.arange(6).reshape(2, 3)):
        copied = staging.copy("centres", changed)
        assert copied.dtype == changed.dtype and torch.equal(copied, changed)
        assert copied.data_ptr() != again.data_ptr()
        assert staging.copy("centres", changed + 1).data_ptr() == copied.data_ptr()
        again = copied
    other = staging.copy("momentum", torch.ones(2, 3))
    assert other.data_ptr() != again.data_ptr()


def test_a_background_write_that_fails_raises_its_error_in_the_training_thread():
    def write():
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        BackgroundSave(write, torch.device("cpu")).wait()


def _a_training_collective_while_rank_1s_writer_is_held(rank: int, world_size: int, output: str) -> dict:
    """An async save on 2 processes whose rank 1 writer thread is held where it starts writing, while each
    training thread runs an all-reduce, as the next step does: rank 0's writer has reached its collectives first."""
    model = make_model("sgd", seed=1)
    saver = checkpointer(Path(output), model, async_save=True)
    writing, release = threading.Event(), threading.Event()

    def hold_rank_1s_writer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "write_state":
            writing.set()
            if rank == 1:
                release.wait(60)

    threading.settrace(hold_rank_1s_writer)
    try:
        saver.save(StepCounter(global_step=3, steps_per_epoch=10))
    finally:
        threading.settrace(None)
    assert writing.wait(30)
    if rank == 0:
        time.sleep(1.0)  # its writer thread is waiting in its first collective by now
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    release.set()
    saver.wait_for_save()
    return {"total": total.item(), "published": published_step(Path(output))}


def test_a_background_write_s_collectives_never_meet_the_training_loop_s(tmp_path):
    """The writer thread has a process group of its own: on the training's group, rank 1's all-reduce would meet
    rank 0's writer's collective instead of rank 0's all-reduce (a wrong sum, an error or a wait until the
    collective timeout)."""
    results = run_world(_a_training_collective_while_rank_1s_writer_is_held, 2, str(tmp_path))
    assert results == [{"total": 3.0, "published": 3}] * 2
