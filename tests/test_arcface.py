"""arcface_torch's checkpoints: resumed on other world sizes, converted both ways, refused when they do not fit.

The arcface_torch folders are written here as upstream's code writes them, from 2 ranks: train_v2.py's
per-rank dict (the state_dict of a torch optimizer over [backbone parameters, centre shard] after real
steps, and of a copy of upstream's PolynomialLRWarmup), and the 2021 partial_fc.py's plain tensors,
their storages tagged cuda:0 as upstream's GPU tensors are (this machine has no GPU to load them on).
21 classes: rows 0..10 on source rank 0, 11..20 on rank 1; on 3 ranks 0..6, 7..13, 14..20, so rank 1
takes rows from both files. References are the source ranks' tensors stacked by hand. A channels_last run's
first step after an import (of arcface_torch's files, or of an earlier version's checkpoint.pt) is SGD with
momentum computed in float64 from the files.
"""
from __future__ import annotations

import contextlib
import copy
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from backbones import get_model
from checkpoint.arcface import V2_FILE, restore_arcface
from checkpoint.run_dir import resolve_resume
from checkpoint.sources import (
    LEGACY_FORMAT,
    LEGACY_NAME,
    ArcfaceTorchSave,
    BareBackbone,
    EarlierCheckpoint,
    find_resume_source,
)
from gpu_acceptance.runs import CONFIG, INFO, QUIET, load_run, scalars
from losses import CombinedMarginLoss
from partial_fc import PartialFC
from tests.distributed_helpers import run_world
from tests.run_helpers import ROOT, run_cli, run_here, same_tensors
from tools import convert_checkpoint
from training.state import architecture, build_components, build_training_state
from utils.config import load_config
from utils.errors import CheckpointError, RunDirError
from utils.lr_scheduler import build_scheduler

NUM_CLASSES, DIM, LR = 21, 32, 0.1
INFO21 = {**INFO, "num_classes": NUM_CLASSES}
WIDTH = INFO["network_kwargs"]["width_mult"]  # the runs' r18 (QUIET): upstream's files are written for it
WARMUP_EPOCHS, EPOCHS = 1, 4                 # the schedule of the runs below (runs.QUIET: num_epoch=4)
UPSTREAM_EPOCHS, UPSTREAM_BATCHES = 2, 5     # arcface_torch saved after its 2nd epoch of 5 batches per rank
ROWS_ON = {1: [(0, 21)], 3: [(0, 7), (7, 14), (14, 21)]}  # rows each rank holds, written out
OVERRIDES = ["num_classes=21", f"warmup_epoch={WARMUP_EPOCHS}"]
FOLDERS = ("train_v2_sgd", "train_v2_adamw", "2021")


# arcface_torch's lr_scheduler.py up to PolynomialLRWarmup.get_lr, as insightface ships it (its closed form and demo
# left out): the schedule train_v2.py saves below, and the file gpu_acceptance/side_by_side.py patches
# (test_side_by_side.py)
UPSTREAM_SCHEDULER = """\
from torch.optim.lr_scheduler import _LRScheduler
from torch.optim import SGD
import torch
import warnings

class PolynomialLRWarmup(_LRScheduler):
    def __init__(self, optimizer, warmup_iters, total_iters=5, power=1.0, last_epoch=-1, verbose=False):
        super().__init__(optimizer, last_epoch=last_epoch, verbose=verbose)
        self.total_iters = total_iters
        self.power = power
        self.warmup_iters = warmup_iters


    def get_lr(self):
        if not self._get_lr_called_within_step:
            warnings.warn("To get the last learning rate computed by the scheduler, "
                          "please use `get_last_lr()`.", UserWarning)

        if self.last_epoch == 0 or self.last_epoch > self.total_iters:
            return [group["lr"] for group in self.optimizer.param_groups]

        if self.last_epoch <= self.warmup_iters:
            return [base_lr * self.last_epoch / self.warmup_iters for base_lr in self.base_lrs]
        else:
            l = self.last_epoch
            w = self.warmup_iters
            t = self.total_iters
            decay_factor = ((1.0 - (l - w) / (t - w)) / (1.0 - (l - 1 - w) / (t - w))) ** self.power
        return [group["lr"] * decay_factor for group in self.optimizer.param_groups]
"""


def upstream_scheduler_class() -> type:
    """PolynomialLRWarmup of UPSTREAM_SCHEDULER, but for the `verbose` argument torch 2.14 no longer takes."""
    passes_verbose = "last_epoch=last_epoch, verbose=verbose)"
    assert UPSTREAM_SCHEDULER.count(passes_verbose) == 1
    names: dict = {}
    exec(UPSTREAM_SCHEDULER.replace(passes_verbose, "last_epoch=last_epoch)"), names)
    return names["PolynomialLRWarmup"]


PolynomialLRWarmup = upstream_scheduler_class()


class CentreShard(torch.nn.Module):
    """What of PartialFC_V2 reaches train_v2's checkpoint: `weight`, this rank's rows, split as upstream splits."""

    def __init__(self, rank: int, world_size: int, num_classes: int, embedding_size: int):
        super().__init__()
        num_local = num_classes // world_size + int(rank < num_classes % world_size)
        self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (num_local, embedding_size)))


@contextlib.contextmanager
def saved_from_gpu():
    """torch.save tags every storage "cuda:0", as in the files of a run whose tensors lived on GPU 0."""
    def tag(storage):
        return "cuda:0" if storage.device.type == "cpu" else None

    torch.serialization.register_package(-1, tag, lambda storage, location: None)
    try:
        yield
    finally:
        registry = torch.serialization._package_registry
        registry.remove(next(entry for entry in registry if entry[1] is tag))


def write_train_v2(folder: Path, optimizer: str = "sgd", world_size: int = 2, num_classes: int = NUM_CLASSES,
                   epochs: int = UPSTREAM_EPOCHS, embedding_size: int = DIM, width_mult: float = WIDTH) -> list[dict]:
    """train_v2.py's save after `epochs` epochs of UPSTREAM_BATCHES batches on `world_size` ranks; the dicts written."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    first = get_model("r18", num_features=embedding_size, width_mult=width_mult)
    global_step, written = epochs * UPSTREAM_BATCHES, []
    for rank in range(world_size):
        backbone = copy.deepcopy(first)  # DDP keeps the weights equal on every rank
        module_partial_fc = CentreShard(rank, world_size, num_classes, embedding_size)
        params = [{"params": backbone.parameters()}, {"params": module_partial_fc.parameters()}]
        opt = (torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=5e-4) if optimizer == "sgd"
               else torch.optim.AdamW(params, lr=LR, weight_decay=5e-4))
        lr_scheduler = PolynomialLRWarmup(optimizer=opt, warmup_iters=UPSTREAM_BATCHES * WARMUP_EPOCHS,
                                          total_iters=UPSTREAM_BATCHES * EPOCHS)
        centre_grads = torch.Generator().manual_seed(100 + rank)  # each rank's own centre gradients
        for step in range(global_step):
            for i, p in enumerate(backbone.parameters()):  # all-reduced: the same on every rank
                p.grad = torch.full_like(p, 0.01 * (step + 1 + i % 3))
            module_partial_fc.weight.grad = torch.randn(module_partial_fc.weight.shape, generator=centre_grads)
            opt.step()
            lr_scheduler.step()
        with torch.no_grad():  # BatchNorm statistics follow each rank's own batches
            for buffer in backbone.buffers():
                if buffer.is_floating_point():
                    buffer.add_(rank)
        checkpoint = {
            "epoch": epochs,
            "global_step": global_step,
            "state_dict_backbone": backbone.state_dict(),
            "state_dict_softmax_fc": module_partial_fc.state_dict(),
            "state_optimizer": opt.state_dict(),
            "state_lr_scheduler": lr_scheduler.state_dict(),
        }
        with saved_from_gpu():
            torch.save(checkpoint, folder / f"checkpoint_gpu_{rank}.pt")
            if rank == 0:
                torch.save(backbone.state_dict(), folder / "model.pt")
        written.append(checkpoint)
    return written


def write_2021(folder: Path, world_size: int = 2) -> dict:
    """train.py + partial_fc.py of 2021: backbone.pth, each rank's weight and weight_mom tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    backbone = get_model("r18", num_features=DIM, width_mult=WIDTH)
    weights, moms = [], []
    with saved_from_gpu():
        torch.save(backbone.state_dict(), folder / "backbone.pth")
        for rank in range(world_size):
            num_local = NUM_CLASSES // world_size + int(rank < NUM_CLASSES % world_size)
            weights.append(torch.normal(0, 0.01, (num_local, DIM)))
            moms.append(torch.randn(num_local, DIM))
            torch.save(weights[-1], folder / f"rank_{rank}_softmax_weight.pt")
            torch.save(moms[-1], folder / f"rank_{rank}_softmax_weight_mom.pt")
    return {"backbone": backbone.state_dict(), "weight": torch.cat(weights), "momentum_buffer": torch.cat(moms)}


def reference(written: list[dict]) -> dict:
    """The whole matrices and rank 0's backbone state, stacked by hand from the dicts train_v2 wrote."""
    centre_index = written[0]["state_optimizer"]["param_groups"][1]["params"][0]
    centre_states = [w["state_optimizer"]["state"][centre_index] for w in written]
    state = {name: torch.cat([s[name] for s in centre_states]) if value.dim() else value
             for name, value in centre_states[0].items()}
    first = written[0]["state_optimizer"]["state"]
    return {"weight": torch.cat([w["state_dict_softmax_fc"]["weight"] for w in written]), **state,
            "backbone": written[0]["state_dict_backbone"], "backbone_state": [first[i] for i in range(centre_index)]}


def make_model(optimizer: str, num_classes: int = NUM_CLASSES, embedding_size: int = DIM,
               width_mult: float = WIDTH) -> SimpleNamespace:
    torch.manual_seed(7)  # other weights than the files': everything must come from them
    backbone = get_model("r18", num_features=embedding_size, width_mult=width_mult)
    pfc = PartialFC(CombinedMarginLoss(), embedding_size, num_classes, seed=7)
    groups = [{"params": list(backbone.parameters())}, {"params": [pfc.weight]}]
    model = SimpleNamespace(backbone=backbone, pfc=pfc, optimizer=(
        torch.optim.SGD(groups, lr=LR, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(groups, lr=LR)))
    model.scheduler = build_scheduler(model.optimizer, WARMUP_EPOCHS * UPSTREAM_BATCHES, EPOCHS * UPSTREAM_BATCHES, 1.0)
    model.scaler = torch.amp.GradScaler("cpu", enabled=False)
    model.components = build_components(model, {})  # what the import restores through
    return model


def _restore(folder: Path, optimizer: str, info: dict = INFO21, **model_options) -> dict:
    model = make_model(optimizer, **model_options)
    restored = restore_arcface(find_resume_source(folder)[1], info, model)
    state = model.optimizer.state
    return {"weight": model.pfc.weight.detach().clone(), **{k: v.clone() for k, v in state[model.pfc.weight].items()},
            "backbone": {k: v.clone() for k, v in model.backbone.state_dict().items()},
            "backbone_state": [{k: v.clone() for k, v in state[p].items()} for p in model.backbone.parameters()],
            "restored": restored}


def _restore_all(rank: int, world_size: int, root: str) -> dict:
    return {name: _restore(Path(root) / name, "adamw" if "adamw" in name else "sgd") for name in FOLDERS}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("arcface")
    return SimpleNamespace(root=root, train_v2_sgd=write_train_v2(root / "train_v2_sgd"),
                           train_v2_adamw=write_train_v2(root / "train_v2_adamw", "adamw"),
                           layout_2021=write_2021(root / "2021"))


@pytest.fixture(scope="module")
def restored(sources) -> dict[int, list[dict]]:
    return {1: [_restore_all(0, 1, str(sources.root))],  # one process, no process group
            3: run_world(_restore_all, 3, str(sources.root))}


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_train_v2_rows_and_optimizer_state_land_bit_for_bit(sources, restored, world_size, optimizer):
    expected = reference(getattr(sources, f"train_v2_{optimizer}"))
    names = ["weight", "momentum_buffer"] if optimizer == "sgd" else ["weight", "exp_avg", "exp_avg_sq"]
    for rank, (start, stop) in enumerate(ROWS_ON[world_size]):
        mine = restored[world_size][rank][f"train_v2_{optimizer}"]
        for name in names:
            assert same_tensors(mine[name], expected[name][start:stop]), (rank, name)
        if optimizer == "adamw":
            assert same_tensors(mine["step"], expected["step"])
        assert same_tensors(mine["backbone"], expected["backbone"])  # rank 0's, BatchNorm statistics included
        assert same_tensors(mine["backbone_state"], expected["backbone_state"])
        imported = mine["restored"]
        assert imported.progress == {"global_step": 10, "steps_per_epoch": 5, "nonfinite_total": 0}
        assert imported.world_size == 2 and imported.rank_state is None
        assert imported.config == {"optimizer": optimizer, "lr": LR, "weight_decay": 5e-4, "num_epoch": EPOCHS,
                                   "warmup_epoch": WARMUP_EPOCHS, **({"momentum": 0.9} if optimizer == "sgd" else {})}


@pytest.mark.parametrize("world_size", [1, 3])
def test_2021_centres_and_momentum_land_bit_for_bit(sources, restored, world_size):
    expected = sources.layout_2021
    for rank, (start, stop) in enumerate(ROWS_ON[world_size]):
        mine = restored[world_size][rank]["2021"]
        assert same_tensors(mine["weight"], expected["weight"][start:stop])
        assert same_tensors(mine["momentum_buffer"], expected["momentum_buffer"][start:stop])
        assert same_tensors(mine["backbone"], expected["backbone"])
        assert all(state == {} for state in mine["backbone_state"])  # 2021 kept none: it starts fresh
        assert mine["restored"].progress["global_step"] == 0


def scheduled_lr(step: int, steps_per_epoch: int, lr: float = LR) -> float:
    """pairface's schedule written out: linear warmup, then (1 - progress) ** 2, for 0-based `step`."""
    warmup, total = WARMUP_EPOCHS * steps_per_epoch, EPOCHS * steps_per_epoch
    return lr * step / warmup if step < warmup else lr * (1 - (step - warmup) / (total - warmup)) ** 2


def parameters_only(state: dict) -> dict:
    """A backbone state_dict without BatchNorm statistics (they move in every forward, even at lr 0)."""
    return {key: value for key, value in state.items() if not re.search(r"running_|num_batches_tracked", key)}


@pytest.mark.slow  # one torchrun launch of 3 processes: ~4 CPU seconds of imports each
def test_train_v2_resumes_through_torchrun_on_three_processes(data, sources, tmp_path):
    """At lr 0 (and momentum 0, so SGD leaves its buffers alone) the run's own checkpoint shows where the
    import put every row: 2 ranks x 5 batches at step 10 is, on 3 processes of 3 steps, step 6."""
    output = tmp_path / "run"
    shutil.copytree(sources.root / "train_v2_sgd", output)
    result = run_cli(data, output, *OVERRIDES, "lr=0.0", "momentum=0.0", "max_steps=7", nproc=3, resume=True)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (output / "training.log").read_text()
    assert ("imported arcface_torch checkpoint (train_v2, 2 ranks, global step 10): backbone, 21 class centres, "
            "SGD momentum, LR schedule") in log
    assert "resuming a run of 2 process(es) and 5 steps per epoch with 3 and 3: step 10 becomes step 6" in log
    assert "config changed on resume: lr 0.1 -> 0.0: every LR from this step on is scaled by new / old = 0" in log
    assert "config changed on resume: momentum: 0.9 -> 0.0" in log
    run = load_run(output, INFO21)
    assert run["world_size"] == 3 and run["progress"]["global_step"] == 7
    expected = reference(sources.train_v2_sgd)
    assert same_tensors(run["class_centres"], expected["weight"])
    centre_index = len(expected["backbone_state"])
    assert same_tensors(run["optimizer"]["state"][centre_index]["momentum_buffer"], expected["momentum_buffer"])
    assert same_tensors(parameters_only(run["backbone"]), parameters_only(expected["backbone"]))


def test_train_v2_resumes_in_one_process_on_pairface_schedule(data, sources, tmp_path):
    """Step 10 of 2 ranks x 5 is step 20 of one process's 10; the next step's LR is pairface's at step 20. The
    log and TensorBoard count on from the imported run's step 10."""
    output = tmp_path / "run"
    shutil.copytree(sources.root / "train_v2_sgd", output)
    assert run_here(data, output, *OVERRIDES, "max_steps=22", resume=True) == (0, "")
    log = (output / "training.log").read_text()
    assert "imported arcface_torch checkpoint (train_v2, 2 ranks, global step 10)" in log
    assert "decays with power 1 (train_v2's default), pairface's with power 2" in log
    assert f"resumed from {output / 'checkpoint_gpu_0.pt'} at global step 10 (epoch 2)" in log
    losses, lrs = scalars(output, "loss"), scalars(output, "learning_rate")
    assert sorted(losses) == [11, 12] and all(0 < loss < 100 for loss in losses.values())
    for step in (21, 22):  # logged at 1-based step s (shown as s - 10): the LR of 0-based step s - 1
        assert lrs[step - 10] == pytest.approx(scheduled_lr(step - 1, 10), rel=1e-6)


def test_2021_layout_resumes_at_step_zero(data, sources, tmp_path):
    output = tmp_path / "run"
    shutil.copytree(sources.root / "2021", output)
    assert run_here(data, output, *OVERRIDES, "lr=0.0", "momentum=0.0", "max_steps=1", resume=True) == (0, "")
    log = (output / "training.log").read_text()
    assert ("imported arcface_torch checkpoint (2021, 2 ranks, global step 0): backbone, 21 class centres, "
            "SGD momentum; the 2021 layout holds no step, LR schedule or backbone optimizer state") in log
    assert "resuming a run of" not in log  # step 0 is step 0: nothing renumbered
    run = load_run(output, INFO21)
    assert same_tensors(run["class_centres"], sources.layout_2021["weight"])
    centre_index = len(list(make_model("sgd").backbone.parameters()))
    assert same_tensors(run["optimizer"]["state"][centre_index]["momentum_buffer"],
                        sources.layout_2021["momentum_buffer"])


NHWC_WIDTH = 0.25  # the narrowest r18 whose NHWC convolutions this CPU's oneDNN runs (tests/test_speedups.py)


def channels_last_state(tmp_path: Path, importer: str) -> tuple[SimpleNamespace, dict]:
    """A channels_last run's training state (as train.py builds it: fused SGD) after `importer` put in it the
    arcface_torch save of one rank written here (or the same tensors as an earlier version's checkpoint.pt);
    the dict train_v2 wrote."""
    written = write_train_v2(tmp_path / "arcface", world_size=1, width_mult=NHWC_WIDTH)[0]
    cfg = load_config(ROOT / CONFIG, [*QUIET, *OVERRIDES, "channels_last=True",
                                      f"network_kwargs={{'width_mult': {NHWC_WIDTH}}}"])
    state = build_training_state(cfg, NUM_CLASSES, torch.device("cpu"), UPSTREAM_BATCHES)
    shapes = architecture(cfg, NUM_CLASSES)
    if importer == "arcface_torch":
        restore_arcface(tmp_path / "arcface" / V2_FILE.format(0), shapes, state)
    else:  # what earlier versions wrote: their own optimizer's state_dict (fused SGD), every centre row
        optimizer = {"state": written["state_optimizer"]["state"],
                     "param_groups": state.optimizer.state_dict()["param_groups"]}
        torch.save({"format": LEGACY_FORMAT, "model": shapes, "config": {"lr": LR}, "world_size": 1,
                    "progress": {"global_step": 10, "steps_per_epoch": 5}, "backbone": written["state_dict_backbone"],
                    "class_centres": written["state_dict_softmax_fc"]["weight"], "optimizer": optimizer,
                    "scheduler": state.scheduler.state_dict(), "grad_scaler": state.scaler.state_dict(),
                    "per_rank": [{"loader": {"skipped": 0}}]}, tmp_path / LEGACY_NAME)
        EarlierCheckpoint().restore(tmp_path / LEGACY_NAME, shapes, state)
    return state, written


@pytest.mark.parametrize("importer", ["arcface_torch", "earlier"])
def test_a_channels_last_run_steps_each_imported_weight_with_its_own_momentum(tmp_path, importer):
    """One SGD step after the import is SGD with momentum computed here in float64 from the files' weights and
    momentum. torch's fused SGD walks a weight and its momentum in memory order: NCHW momentum beside the NHWC
    weights of channels_last would give each weight another one's momentum, without a word."""
    state, written = channels_last_state(tmp_path, importer)
    assert state.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    group = state.optimizer.param_groups[0]
    group["lr"] = LR  # the schedule's warm-up starts at 0: a step that moves the weights
    momentum, decay = group["momentum"], group["weight_decay"]
    grads = torch.Generator().manual_seed(3)
    expected_weights, expected_momentum = {}, {}
    for index, (name, p) in enumerate(state.backbone.named_parameters()):
        grad = torch.randn(p.shape, generator=grads)
        p.grad = torch.empty_like(p).copy_(grad)  # in the weight's layout, as backward gives it
        weight = written["state_dict_backbone"][name].double()
        buffer = momentum * written["state_optimizer"]["state"][index]["momentum_buffer"].double() + grad.double() \
            + decay * weight
        expected_momentum[name], expected_weights[name] = buffer, weight - LR * buffer
    state.optimizer.step()
    worst_weight = max((p.detach().double() - expected_weights[name]).abs().max().item()
                       for name, p in state.backbone.named_parameters())
    worst_momentum = max((state.optimizer.state[p]["momentum_buffer"].double() - expected_momentum[name])
                         .abs().max().item() for name, p in state.backbone.named_parameters())
    assert worst_weight < 1e-6 and worst_momentum < 1e-5, (worst_weight, worst_momentum)


# --- conversion -----------------------------------------------------------------------------------

def convert(*argv: str) -> int:
    return convert_checkpoint.main([str(a) for a in argv])


def to_pairface(src: Path, dst: Path, *extra: str) -> int:
    """--to pairface with the settings of the runs here (`extra` after them: later --set win)."""
    settings = [arg for item in [*QUIET, *OVERRIDES] for arg in ("--set", item)]
    return convert(src, dst, "--to", "pairface", "--config", "configs/synthetic_pair.py", *settings, *extra)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_arcface_torch_to_pairface_and_back_reproduces_every_tensor(sources, tmp_path, optimizer, capsys):
    """Every tensor of every rank's file comes back bit for bit, but for rank 1's BatchNorm statistics:
    pairface keeps rank 0's backbone (as its own checkpoints do), so both files carry rank 0's."""
    source = sources.root / f"train_v2_{optimizer}"
    assert to_pairface(source, tmp_path / "pairface", "--set", f"optimizer={optimizer!r}") == 0
    assert convert(tmp_path / "pairface", tmp_path / "back", "--to", "arcface_torch", "--world-size", 2) == 0
    out = capsys.readouterr().out
    assert "a pairface run at global step 20 (epoch 2, 10 steps per epoch counted for one process)" in out
    assert "arcface_torch train_v2 files for 2 ranks (21 class centres) and model.pt, at global step 10 (epoch 2" in out
    original = getattr(sources, f"train_v2_{optimizer}")
    for rank in range(2):
        back = torch.load(tmp_path / "back" / f"checkpoint_gpu_{rank}.pt", weights_only=True)
        assert (back["epoch"], back["global_step"]) == (2, 10)
        assert same_tensors(back["state_dict_softmax_fc"], original[rank]["state_dict_softmax_fc"])
        assert same_tensors(back["state_optimizer"]["state"], original[rank]["state_optimizer"]["state"])
        assert same_tensors(back["state_dict_backbone"], original[0]["state_dict_backbone"])
        scheduler, upstream = back["state_lr_scheduler"], original[rank]["state_lr_scheduler"]
        assert {k: scheduler[k] for k in ("last_epoch", "total_iters", "warmup_iters", "base_lrs", "_step_count")} == \
            {k: upstream[k] for k in ("last_epoch", "total_iters", "warmup_iters", "base_lrs", "_step_count")}
        assert scheduler["power"] == 2.0  # pairface's curve from here on (train_v2's default is 1)
    assert same_tensors(torch.load(tmp_path / "back" / "model.pt", weights_only=True),
                        original[0]["state_dict_backbone"])


@pytest.fixture(scope="module")
def pairface_run(data, tmp_path_factory) -> Path:
    """One process, 10 steps per epoch, stopped at step 12: inside epoch 1."""
    output = tmp_path_factory.mktemp("pairface") / "run"
    assert run_here(data, output, *OVERRIDES, "max_steps=12") == (0, "")
    return output


def test_pairface_to_arcface_torch_and_back_reproduces_every_tensor(pairface_run, tmp_path, capsys):
    assert convert(pairface_run, tmp_path / "arcface", "--to", "arcface_torch", "--world-size", 2) == 0
    out = capsys.readouterr().out
    # step 12 of 10 per epoch is step 6 of 5 on 2 ranks: arcface_torch resumes at epoch starts only
    assert f"at global step 5 (epoch 1, 5 batches per epoch, lr {scheduled_lr(5, 5):.6g})" in out
    assert "note: the run stopped inside epoch 1 (step 6, epochs of 5 batches); arcface_torch resumes at epoch " \
           "starts only, so the files say step 5" in out
    assert to_pairface(tmp_path / "arcface", tmp_path / "back") == 0
    original, back = load_run(pairface_run, INFO21), load_run(tmp_path / "back", INFO21)
    for key in ("backbone", "class_centres", "optimizer"):
        assert same_tensors(back[key]["state"] if key == "optimizer" else back[key],
                            original[key]["state"] if key == "optimizer" else original[key]), key
    assert back["progress"]["global_step"] == 10 and back["progress"]["steps_per_epoch"] == 10


def test_arcface_torch_goes_on_along_pairface_schedule(pairface_run, tmp_path):
    """train_v2's own resume (optimizer, then scheduler load_state_dict) and steps: the LR it then uses is
    pairface's schedule at arcface_torch's step."""
    assert convert(pairface_run, tmp_path / "arcface", "--to", "arcface_torch", "--world-size", 1,
                   "--steps-per-epoch", 10) == 0
    checkpoint = torch.load(tmp_path / "arcface" / "checkpoint_gpu_0.pt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (1, 10)
    backbone, shard = get_model("r18", num_features=DIM, width_mult=WIDTH), CentreShard(0, 1, NUM_CLASSES, DIM)
    opt = torch.optim.SGD(params=[{"params": backbone.parameters()}, {"params": shard.parameters()}], lr=LR,
                          momentum=0.9, weight_decay=5e-4)
    lr_scheduler = PolynomialLRWarmup(optimizer=opt, warmup_iters=999, total_iters=9999)  # its config's: overwritten
    backbone.load_state_dict(checkpoint["state_dict_backbone"])
    shard.load_state_dict(checkpoint["state_dict_softmax_fc"])
    opt.load_state_dict(checkpoint["state_optimizer"])
    lr_scheduler.load_state_dict(checkpoint["state_lr_scheduler"])
    for step in range(10, 40):
        assert opt.param_groups[0]["lr"] == pytest.approx(scheduled_lr(step, 10), rel=1e-9, abs=1e-12), step
        opt.step()
        lr_scheduler.step()


# --- what does not fit ----------------------------------------------------------------------------

def refusal(folder: Path, optimizer: str = "sgd", info: dict = INFO21, **model_options) -> str:
    with pytest.raises(CheckpointError) as caught:
        _restore(folder, optimizer, info, **model_options)
    return str(caught.value)


def test_a_missing_rank_file_is_named(tmp_path):
    write_train_v2(tmp_path, world_size=3)
    (tmp_path / "checkpoint_gpu_1.pt").unlink()
    assert refusal(tmp_path).startswith(f"{tmp_path / 'checkpoint_gpu_1.pt'} is missing (the folder holds the files "
                                        "of ranks 0, 2); copy every rank's file")


def test_a_missing_last_rank_file_is_named(tmp_path):
    write_train_v2(tmp_path)
    (tmp_path / "checkpoint_gpu_1.pt").unlink()
    assert refusal(tmp_path).startswith(f"{tmp_path / 'checkpoint_gpu_1.pt'} is missing: the folder holds ranks 0..0 "
                                        "of a run on 2 processes")


def test_a_missing_2021_momentum_file_is_named(tmp_path):
    write_2021(tmp_path)
    (tmp_path / "rank_1_softmax_weight_mom.pt").unlink()
    assert refusal(tmp_path).startswith(f"{tmp_path / 'rank_1_softmax_weight_mom.pt'} is missing")


def test_files_of_runs_on_different_world_sizes_are_refused(tmp_path):
    write_train_v2(tmp_path / "two")
    write_train_v2(tmp_path / "three", world_size=3)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "two" / "checkpoint_gpu_0.pt", mixed)     # rows 0..10 of 21 over 2
    shutil.copy(tmp_path / "three" / "checkpoint_gpu_1.pt", mixed)   # rows 7..13 of 21 over 3
    assert refusal(mixed).startswith(f"{mixed / 'checkpoint_gpu_0.pt'} holds 11 class centres where rank 0 of 2 "
                                     "holding 18 would hold 9; the folder mixes files of runs on different numbers")


def test_files_of_different_saves_are_refused(tmp_path):
    write_train_v2(tmp_path / "late")
    write_train_v2(tmp_path / "early", epochs=1)
    shutil.copy(tmp_path / "early" / "checkpoint_gpu_1.pt", tmp_path / "late")
    assert refusal(tmp_path / "late").startswith(f"{tmp_path / 'late' / 'checkpoint_gpu_1.pt'} was saved at global "
                                                 "step 5, ")


def test_another_network_is_refused_with_the_one_it_fits(sources):
    message = refusal(sources.root / "train_v2_sgd", info={**INFO21, "network_kwargs": {"width_mult": 0.25}},
                      width_mult=0.25)
    assert message.startswith(f"{sources.root / 'train_v2_sgd' / 'checkpoint_gpu_0.pt'} holds a backbone that does "
                              "not fit network r18, width_mult=0.25")
    assert message.endswith(f"it fits network r18, width_mult={WIDTH}, num_features=32: resume with those settings")


def test_another_class_count_is_refused(sources):
    message = refusal(sources.root / "train_v2_sgd", info={**INFO21, "num_classes": 22}, num_classes=22)
    assert message == (f"{sources.root / 'train_v2_sgd'} holds 21 class centres in 2 rank files, this run has 22 "
                       "classes; set num_classes=21 (or resume with the config and data that trained it)")


def test_another_embedding_size_is_refused(sources):
    message = refusal(sources.root / "2021", info={**INFO21, "embedding_size": 64}, embedding_size=64)
    assert message.startswith(f"{sources.root / '2021' / 'rank_0_softmax_weight.pt'} holds 32-dimensional class "
                              "centres, this run's embedding_size is 64; set embedding_size=32")


def test_another_optimizer_is_refused(sources):
    assert "holds AdamW state, this run uses SGD; set optimizer='adamw'" in refusal(sources.root / "train_v2_adamw")


def test_a_damaged_rank_file_is_refused_through_the_command_line(data, sources, tmp_path):
    output = tmp_path / "run"
    shutil.copytree(sources.root / "train_v2_sgd", output)
    (output / "checkpoint_gpu_1.pt").write_bytes((output / "checkpoint_gpu_1.pt").read_bytes()[:5000])
    status, stderr = run_here(data, output, *OVERRIDES, resume=True)
    assert status == 1
    assert stderr.startswith(f"error: cannot read {output / 'checkpoint_gpu_1.pt'} (")
    assert stderr.strip().endswith("it is damaged or not an arcface_torch checkpoint: copy it again from the run "
                                   "that wrote it")


def test_arcface_torch_folders_are_resume_sources_and_runs_to_guard(sources, tmp_path):
    v2 = sources.root / "train_v2_sgd"
    assert find_resume_source(v2) == (ArcfaceTorchSave(), v2 / "checkpoint_gpu_0.pt")
    assert find_resume_source(v2 / "checkpoint_gpu_1.pt") == (ArcfaceTorchSave(), v2 / "checkpoint_gpu_0.pt")
    assert find_resume_source(sources.root / "2021" / "rank_1_softmax_weight_mom.pt") == \
        (ArcfaceTorchSave(), sources.root / "2021" / "rank_0_softmax_weight.pt")
    shutil.copy(v2 / "model.pt", tmp_path)  # train_v2's default (save_all_states False): the backbone alone
    assert find_resume_source(tmp_path) == (BareBackbone(), tmp_path / "model.pt")
    with pytest.raises(RunDirError, match="already holds a run"):
        resolve_resume(str(v2), False)


def test_the_converter_refuses_to_overwrite_and_says_what_it_needs(sources, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as caught:
        to_pairface(sources.root / "train_v2_sgd", tmp_path / "taken")
    assert caught.value.code == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'taken'} already holds files; choose a new folder, or "
                                       "pass --force to write the converted checkpoint over what is there\n")
    assert to_pairface(sources.root / "train_v2_sgd", tmp_path / "taken", "--force") == 0
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit):
        convert(tmp_path / "taken", tmp_path / "new", "--to", "arcface_torch")
    assert "--to arcface_torch needs --world-size N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert(tmp_path / "taken", tmp_path / "new", "--to", "pairface")
    assert "--to pairface needs --config CONFIG" in capsys.readouterr().err


def test_arcface_torch_centres_into_sub_centres_are_refused_in_one_line(sources, tmp_path, capsys):
    folder = sources.root / "train_v2_sgd"
    with pytest.raises(SystemExit, match="1"):
        to_pairface(folder, tmp_path / "new", "--set", "margin_family='subcenter'")
    assert capsys.readouterr().err == (
        f"error: {folder / 'checkpoint_gpu_0.pt'} holds one centre per class, this run 3 sub-centres per "
        "class (margin_family='subcenter'); continue it with margin_family='combined', or start from its backbone "
        "alone (--set resume=<its model.pt>)\n")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("warmup, total", [(0, 40), (5, 40)])
def test_lr_power_1_follows_train_v2_s_polynomial_lr_warmup_step_by_step(warmup, total):
    """lr_power = 1: the learning rate of every step equals upstream's PolynomialLRWarmup (its recursive get_lr), but
    step 0 of a warmup, where upstream starts at the base LR and pairface, as its PolyScheduler, at 0."""
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    upstream = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = build_scheduler(ours, warmup, total, power=1.0)
    reference = PolynomialLRWarmup(optimizer=upstream, warmup_iters=warmup, total_iters=total)
    for step in range(total + 2):
        if step or not warmup:
            assert ours.param_groups[0]["lr"] == pytest.approx(upstream.param_groups[0]["lr"], rel=1e-9, abs=1e-12)
        ours.step(), upstream.step()
        schedule.step(), reference.step()
