"""The memory plan (--dry-run, the start-up warning) against what real steps allocate.

One child process (tools/step_memory.py) builds each configuration below as train.py does, runs real
steps on the CPU and measures one: torch.profiler's record of every CPU allocation gives the bytes
alive at markers around the backbone's forward and the softmax and the step's peak, and the
parameters, gradients, optimizer state and DDP's buckets are measured as they are. What the plan counts
are tensors; the workspace a kernel takes for itself and frees before it returns depends on the CPU
(which bf16/fp16 GEMM and convolution kernels its instruction set gets) and is measured apart, so that
these tests mean the same on any x86-64 CPU. Between them the configurations vary every config key
the plan reads (checked below by recording what it reads); one more runs on two processes under
torchrun. Tolerance: the items the plan sizes by arithmetic exactly, the others as
TOLERANCE says.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import train
from checkpoint.checkpointer import HostStaging
from checkpoint.sharded import stage_state
from gpu_acceptance.runs import QUIET
from tests.forked_commands import ForkedCommand
from tests.run_helpers import ROOT, run_here, start_command
from tools.step_memory import _recording, compare
from training.components import SavedPosition
from training.memory_plan import describe, describe_fit, fit, memory_plan
from training.state import build_training_state
from training.step import train_step
from utils.config import load_config

CONFIG = "configs/synthetic_pair.py"
BASE = ["rec=synthetic", "num_classes=600", "num_image=48", "embedding_size=32", "num_workers=0", "optimizer=sgd",
        "momentum=0.9", "network=r18", "network_kwargs={'width_mult':0.0625}", "batch_size=2"]
LOGITS_DOMINATE = "r18 fp32, 2 views, a million classes: the logits are half the step"
CASES = {
    "r18 fp32, 2 views, SGD": "",
    "r18 bf16, 10% of the centres, AdamW, the backbone's EMA": "bf16=True sample_rate=0.1 optimizer=adamw "
                                                               "ema_decay=0.99",
    "mbf fp32, 1 view, dropout, SGD without momentum": "network=mbf network_kwargs={'width_mult':0.25} num_views=1 "
                                                       "batch_size=3 dropout=0.2 momentum=0.0 num_classes=1000 "
                                                       "embedding_size=64",
    "vit_t fp16, 2 micro-batches, inter-class filtering": "network=vit_t network_kwargs={'width_mult':0.125} "
                                                          "fp16=True gradient_acc=2 "
                                                          "interclass_filtering_threshold=0.3",
    "vit_t bf16, checkpointed blocks replayed, sampled": "network=vit_t bf16=True sample_rate=0.1 "
                                                         "network_kwargs={'width_mult':0.125,'using_checkpoint':True,"
                                                         "'drop_path_rate':0.0}",
    "r18 fp32, 3 sub-centres per class, half of them sampled": "margin_family=subcenter sample_rate=0.5",
    "r18 bf16, CurricularFace's second buffer": "margin_family=curricular bf16=True",
    LOGITS_DOMINATE: "batch_size=8 embedding_size=8 num_classes=1000000",
    "r18 fp32, semi-siamese training alone: a queue of 20,000 slots": "sst=True sst_queue_size=20000",
}
EXACT = ("class_centres", "centre_gradient", "centre_optimizer_state", "backbone_parameters", "backbone_gradients",
         "backbone_optimizer_state", "ddp_gradient_buckets", "backbone_ema", "prototype_queue", "gallery_network")
# plan/measured may be this far from 1: measured within 4.1% (the checkpointed ViT's backward: 0.959), but for
# the softmax's small terms (up to 5.7% of its peak in these tiny configurations). The measured items are tensors:
# kernel workspace (what a CPU's bf16/fp16 GEMM and convolution kernels take for themselves, 0.2 to 6 MiB
# here depending on the instruction set) is measured apart, as `kernel_workspace`, which no item plans.
TOLERANCE = {"activations": 0.05, "batch": 0.02, "logits_buffer": 0.10, "backbone_backward": 0.06, "total": 0.06,
             "queue_logits": 0.05}


def config(case: str = "") -> SimpleNamespace:
    return load_config(ROOT / CONFIG, [*BASE, *case.split()])


TWO_PROCESSES = "num_classes=601 sample_rate=0.5"  # rank 0 holds 301 of the 601 classes


def step_memory(*cases: str, processes: int = 0) -> ForkedCommand:
    """tools.step_memory measuring `cases` in one process (or under torchrun), started."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes else []
    command = [sys.executable, *launcher, "-m", "tools.step_memory", CONFIG, "--json"]
    for item in BASE:
        command += ["--set", item]
    for case in cases:
        command += ["--case", case]
    return start_command(command)


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """{case: {"plan": bytes by item, "measured": bytes by item}}: CASES from one process, the last on two
    (rank 0's), started side by side."""
    one, two = step_memory(*CASES.values()), step_memory(TWO_PROCESSES, processes=2)
    results = {}
    for process in (one, two):
        out, err = process.communicate(timeout=900)
        assert process.returncode == 0, err[-3000:]
        results.update((line["case"], line) for line in map(json.loads, out.splitlines()))
    return {name: results[case] for name, case in {**CASES, "two processes": TWO_PROCESSES}.items()}


def assert_close_to_a_real_step(result: dict) -> None:
    plan, real = result["plan"], result["measured"]
    assert {item: plan[item] for item in EXACT} == {item: real[item] for item in EXACT}
    ratios = {item: plan[item] / real[item] for item in TOLERANCE if real[item]}
    assert all(abs(ratio - 1) <= TOLERANCE[item] for item, ratio in ratios.items()), ratios


@pytest.mark.slow  # real steps of eight configurations, profiled
@pytest.mark.parametrize("name", CASES)
def test_each_planned_item_is_what_a_real_step_allocates(measured, name):
    assert_close_to_a_real_step(measured[name])


@pytest.mark.slow
def test_where_the_logits_dominate_two_views_are_planned_with_the_rows_of_both(measured):
    """16 rows (8 records of 2 views) against a million 8-wide centres: the (N, C) buffers are more than half
    the step, so a plan that counted one view's rows would miss a quarter of the peak."""
    result = measured[LOGITS_DOMINATE]
    assert result["measured"]["logits_buffer"] > result["measured"]["total"] / 2
    assert_close_to_a_real_step(result)


def test_two_views_give_the_softmax_the_rows_of_one_view_at_twice_the_batch():
    """The softmax's rows are every view of every record on every rank, and its (N, C) float32 logits grow
    with them: without sampling, two views of B records plan what one view of 2B records does, and at least
    the B x C logits of the second view's rows more than one view of B records."""
    classes = 100_000

    def logits(views: int, batch_size: int, world_size: int = 1) -> int:
        cfg = config(f"num_views={views} batch_size={batch_size} num_classes={classes} embedding_size=16")
        return memory_plan(cfg, classes, world_size)["logits_buffer"]

    for world_size in (1, 2):
        one, two = logits(1, 4, world_size), logits(2, 4, world_size)
        assert two == logits(1, 8, world_size)
        # rank 0 holds half the columns on two processes, and sees both processes' rows
        assert two - one >= 4 * world_size * (classes // world_size) * 4, world_size


def test_a_kernels_workspace_is_kept_apart_from_the_tensor_it_returns():
    """A bf16 GEMM and convolution on this CPU, under tools.step_memory's accounting: what they leave, and
    their peak above what was alive, are exactly their outputs' bytes, whatever scratch the CPU's kernels
    took meanwhile (an AMX Xeon's kernels take 25 to 50 KiB for this GEMM beside its 38 KiB output)."""
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(32, 300).bfloat16()
    images, filters = torch.randn(2, 8, 14, 14).bfloat16(), torch.randn(16, 8, 3, 3).bfloat16()
    device = torch.device("cpu")
    with _recording(device) as marks:
        marks.mark("start")
        product = a @ b
        marks.mark("product")
        features = torch.nn.functional.conv2d(images, filters, padding=1)
        marks.mark("features")
    assert marks.at("product") - marks.at("start") == 64 * 300 * 2 == product.untyped_storage().nbytes()
    assert marks.peak_between("start", "product") - marks.at("start") == 64 * 300 * 2
    assert marks.at("features") - marks.at("product") == 2 * 16 * 14 * 14 * 2 == features.untyped_storage().nbytes()
    assert marks.peak_between("product", "features") - marks.at("product") == 2 * 16 * 14 * 14 * 2


def cpu_tensor_bytes() -> int:
    """Bytes of every CPU tensor's storage alive in this process, after a collection (the plan's fake and meta
    tensors aside: they hold none)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance: the latter reads __class__, which some deprecated objects of torch warn about
        if (issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), FakeTensor) and obj.device.type == "cpu"
                and obj.layout == torch.strided):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values())


def test_a_measured_case_leaves_none_of_its_tensors_alive():
    """tools.step_memory measures its cases one after another in one process, and on a GPU the allocator's
    figures count every byte alive: a case whose tensors outlive it is counted in the next case's peak. The
    first H200 run's vit_b total (6.09 GiB against a plan of 3.95) held the 2.07 GiB of the r50 case before
    it, its million centres and its weights, kept by the measurement's own gradient hooks."""
    before = cpu_tensor_bytes()
    result = compare(config("num_classes=5000 sample_rate=0.1"), torch.device("cpu"))
    assert result["measured"]["class_centres"] == 5000 * 32 * 4
    assert cpu_tensor_bytes() == before


class _Reading(SimpleNamespace):
    """A configuration that notes every key read from it."""

    def __getattribute__(self, key: str):
        if not key.startswith("_"):
            object.__getattribute__(self, "_read").add(key)
        return super().__getattribute__(key)


# Read for host_checkpoint_staging alone (host memory, not a step's): compared below with what a real save's
# staging holds.
HOST_ONLY = {"async_save", "save_all_states"}


def test_the_cases_vary_every_config_key_the_plan_reads():
    reading = _Reading(**vars(config()), _read=set())
    memory_plan(reading, reading.num_classes, 1)
    read = reading._read - HOST_ONLY
    configs = [vars(config(case)) for case in CASES.values()]
    assert {"network", "batch_size", "num_views", "sample_rate", "bf16", "optimizer"} <= read  # it does record
    assert [key for key in sorted(read) if len({repr(c[key]) for c in configs}) < 2] == []


def test_on_two_processes_rank_0_plans_its_centres_the_global_batch_and_the_ddp_buckets(measured):
    result = measured["two processes"]
    assert result["plan"]["class_centres"] == 301 * 32 * 4
    assert result["measured"]["ddp_gradient_buckets"] > 0
    assert_close_to_a_real_step(result)


def test_the_dry_runs_table_shows_each_item_in_gib_under_when_it_is_alive_and_the_moment_that_peaks():
    """The table as the dry run prints it, for given bytes: the items held throughout, then each moment's, in GiB
    with three decimals in one column; with gradient_acc > 1 the earlier micro-batches' gradients join both
    moments; the total names the moment that peaks (the softmax, unless the classifier is unknown); an item
    unknown without num_classes says so; the host's staging stands apart, and so do the backbone's gradients with
    one micro-batch (the backbone's backward holds them)."""
    gib = 2 ** 30
    plan = {"class_centres": 3 * gib // 2, "centre_gradient": gib // 4, "centre_optimizer_state": 3 * gib // 2,
            "logits_buffer": 3 * gib, "backbone_parameters": gib // 8, "backbone_optimizer_state": gib // 8,
            "ddp_gradient_buckets": 0, "backbone_ema": gib // 8, "batch": 1_073_742, "activations": 2 * gib,
            "backbone_backward": 9 * gib // 2,
            "backbone_gradients": gib // 8, "total": 8 * gib, "host_checkpoint_staging": 13 * gib // 4}
    held = ["  held throughout:",
            "    class centres                  1.500 GiB",
            "    centre optimizer state         1.500 GiB",
            "    backbone parameters            0.125 GiB",
            "    backbone optimizer state       0.125 GiB",
            "    ddp gradient buckets           0.000 GiB",
            "    backbone ema                   0.125 GiB",
            "    batch                          0.001 GiB"]
    staging = "  host checkpoint staging          3.250 GiB  (not in the total on its own)"
    # softmax 2 + 3 against backward 0.25 + 4.5 (+ 0.25 + 0.125 and + 0.125 with two micro-batches)
    assert describe(plan, config("gradient_acc=1")).splitlines() == [
        *held,
        "  at the softmax:",
        "    activations                    2.000 GiB",
        "    logits buffer                  3.000 GiB",
        "  in the backbone's backward:",
        "    centre gradient                0.250 GiB",
        "    backbone backward              4.500 GiB",
        "  total                            8.000 GiB  (the step's peak: held throughout + at the softmax)",
        "  backbone gradients               0.125 GiB  (not in the total on its own)",
        staging]
    unknown = {**plan, **dict.fromkeys(("class_centres", "centre_gradient", "centre_optimizer_state",
                                        "logits_buffer", "host_checkpoint_staging"))}
    # softmax 2 + 0.125 against backward 4.5 + 0.125: without the classifier, the backbone's backward peaks
    assert describe(unknown, config("gradient_acc=2")).splitlines() == [
        "  held throughout:",
        "    class centres             unknown (set num_classes)",
        "    centre optimizer state    unknown (set num_classes)",
        *held[3:],
        "  at the softmax:",
        "    activations                    2.000 GiB",
        "    logits buffer             unknown (set num_classes)",
        "    centre gradient           unknown (set num_classes)",
        "    backbone gradients             0.125 GiB",
        "  in the backbone's backward:",
        "    centre gradient           unknown (set num_classes)",
        "    backbone backward              4.500 GiB",
        "    backbone gradients             0.125 GiB",
        "  total                            8.000 GiB  (the step's peak: held throughout + in the backbone's backward)",
        "  host checkpoint staging     unknown (set num_classes)  (not in the total on its own)"]


def dry_run(capsys, *extra: str) -> tuple[int, str, str]:
    status = train.main([str(ROOT / CONFIG), "--dry-run", *extra])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_dry_run_says_whether_it_fits_and_the_largest_batch_and_fewest_processes_that_do(capsys):
    settings = ["--set", "network=r18", "--set", "num_classes=2000000", "--set", "batch_size=128",
                "--world-size", "8"]
    status, out, _ = dry_run(capsys, *settings)
    assert status == 0
    assert "  at the softmax:\n    activations" in out and "\n  total " in out
    assert "pass --device-memory SIZE (e.g. 80GiB) to see whether it fits" in out
    cfg = load_config(ROOT / CONFIG, ["network=r18", "num_classes=2000000", "batch_size=128"])
    total = memory_plan(cfg, 2_000_000, 8)["total"]

    def planned(batch_size: int, processes: int) -> int:
        return memory_plan(SimpleNamespace(**{**vars(cfg), "batch_size": batch_size}), 2_000_000, processes)["total"]

    for available, verdict in ((total + 2 ** 30, "fits: "), (total - 1, "does not fit: ")):
        status, out, _ = dry_run(capsys, *settings, "--device-memory", f"{available}B", "--json")
        memory = json.loads(out)["memory"]
        largest, fewest = memory["largest_batch_size"], memory["fewest_processes"]
        assert memory["fits"] == (verdict == "fits: ")
        assert planned(largest, 8) <= available < planned(largest + 1, 8)
        assert planned(128, fewest) <= available and all(planned(128, p) > available for p in range(1, fewest))
        status, out, _ = dry_run(capsys, *settings, "--device-memory", f"{available}B")
        assert f"\n{verdict}" in out and f"the largest batch_size that fits on 8 process(es) is {largest}" in out
        assert f"batch_size 128 fits from {fewest} processes on" in out  # either way, as docs/operations.md says
    assert fewest > 8


def test_a_plan_that_does_not_fit_names_its_largest_item_and_what_shrinks_that(capsys):
    """Two million centres on one process: the centres dominate, so more processes, not sample_rate (the
    old advice whatever dominated); a tiny classifier with a big batch: the activations."""
    for settings, largest, remedy in (
            (["--set", "num_classes=2000000", "--set", "embedding_size=512"], "centre optimizer state",
             "more processes"),
            (["--set", "num_classes=100", "--set", "batch_size=512"], "backbone backward", "a smaller batch_size")):
        cfg = load_config(ROOT / CONFIG, [item for item in settings if item != "--set"])
        plan = memory_plan(cfg, cfg.num_classes, 1)
        status, out, _ = dry_run(capsys, *settings, "--device-memory", f"{plan['total'] - 1}B")
        assert status == 0 and "does not fit" in out
        item = largest.replace(" ", "_")
        held = [value for key, value in plan.items() if key not in ("total", "host_checkpoint_staging")]
        assert plan[item] == max(held)
        assert f"the largest item is {largest} ({plan[item] / 2 ** 30:.2f} GiB): try {remedy}" in out
        assert "sample_rate" not in out.rpartition("does not fit")[2]


@pytest.mark.parametrize(("arguments", "message"), [
    (["--dry-run", "--device-memory", "80 gigs"],
     "error: --device-memory '80 gigs' is not an amount of memory; write it like 80GiB, 80GB or 81920MiB\n"),
    (["--dry-run", "--device-memory", "80"],
     "error: --device-memory '80' has no unit; write it with one, e.g. 80GiB (or 80GB, 80B for bytes)\n"),
    (["--device-memory", "80GiB"],
     "error: --device-memory only shapes the --dry-run report; add --dry-run, or drop --device-memory to train\n"),
    (["--dry-run", "--set", "batch_size=1", "--set", "num_views=1"],
     "error: batch_size=1 with num_views=1 puts one image in each step, and the embedding's BatchNorm needs two or "
     "more; raise batch_size\n"),
])
def test_a_bad_device_memory_or_a_one_image_step_is_one_error_line(capsys, arguments, message):
    assert train.main([str(ROOT / CONFIG), *arguments]) == 1
    assert capsys.readouterr().err == message


def test_a_run_that_does_not_fit_warns_with_the_largest_batch_and_fewest_processes(data, tmp_path, monkeypatch):
    """On a CPU a process may use the machine's memory shared by its local processes: so many of them
    that the tiny run does not fit."""
    settings = ["max_steps=1", "num_epoch=1"]
    cfg = load_config(ROOT / CONFIG, [f"rec={data}", *QUIET, *settings])
    available = memory_plan(cfg, 20, 1)["total"] * 3 // 4
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(memory // available))
    status, _ = run_here(data, tmp_path / "run", *settings)
    assert status == 0
    log = (tmp_path / "run" / "training.log").read_text()
    result = fit(cfg, 20, 1, memory // (memory // available))
    assert not result.fits and 0 < result.largest_batch_size < 4
    assert (f"the memory plan does not fit: {result.total / 2 ** 30:.2f} GiB planned" in log
            and f"the largest batch_size that fits on 1 process(es) is {result.largest_batch_size}" in log)


def test_the_dry_run_reads_the_class_count_from_the_datas_header_when_the_config_leaves_it_to_the_data(data, capsys):
    """The `data` fixture packs 20 identities: num_classes None plans for 20 centres, read from one record."""
    settings = ["--set", f"rec={data}", "--set", "num_classes=None", "--set", "embedding_size=32"]
    status, out, _ = dry_run(capsys, *settings, "--json")
    report = json.loads(out)
    assert status == 0 and report["config"]["num_classes"] is None and report["memory"]["num_classes"] == 20
    assert report["memory"]["class_centres"] == 20 * 32 * 4
    status, out, _ = dry_run(capsys, *settings)
    assert f"num_classes = None  # 20, read from {data}/train.rec's header" in out.splitlines()


@pytest.mark.parametrize("ema", ["ema_decay=0.0", "ema_decay=0.9"])
def test_the_memory_plan_counts_the_async_staging_copy(ema):
    """`host_checkpoint_staging` is what HostStaging holds after a real step's save: the centres, the backbone's
    state_dict and the momentum of both (none for arcface_torch's frozen `features.weight`); with the backbone's
    EMA, its trained parameters too."""
    cfg = load_config(ROOT / "configs" / "synthetic_pair.py", [
        "rec=synthetic", "network=r18", "network_kwargs={'width_mult': 0.0625}", "embedding_size=16",
        "num_views=1", "batch_size=2", "optimizer=sgd", "momentum=0.9", ema])
    state = build_training_state(cfg, 10, torch.device("cpu"), steps_per_epoch=5)
    images = torch.randint(0, 256, (2, 1, 3, 112, 112), dtype=torch.uint8)
    train_step(state, [(images, torch.tensor([1, 7]))], cfg)
    staging = HostStaging()
    stage_state(state, {"global_step": 1}, SavedPosition({}), {}, {}, staging.copy)
    staged = sum(t.numel() * t.element_size() for t in staging._buffers.values())
    assert memory_plan(cfg, 10, 1)["host_checkpoint_staging"] == staged
    assert memory_plan(load_config(ROOT / "configs" / "synthetic_pair.py", ["async_save=False"]), 10, 1)[
        "host_checkpoint_staging"] == 0


def test_no_plan_counts_on_more_processes_than_the_sst_queue_holds_a_step_of(capsys):
    # A step of W processes enqueues 64 * W gallery features: a queue of 256 holds a step of 4 processes at most.
    sets = ["network=r18", "num_classes=2000000", "batch_size=64", "num_views=2", "sst=True", "sst_queue_size=256"]
    status, out, err = dry_run(capsys, *(word for item in sets for word in ("--set", item)), "--world-size", "8")
    assert status == 1 and not out
    assert err.strip() == ("error: config key 'sst_queue_size' (256) is smaller than the 512 gallery features a step "
                           "of 8 process(es) enqueues; raise it to at least that, or plan for at most 4 process(es)")
    cfg = load_config(ROOT / CONFIG, sets)
    # Memory that 6 processes' share would fit and 4 processes' does not: the fewest that fit are too many.
    result = fit(cfg, 2_000_000, 2, memory_plan(cfg, 2_000_000, 6)["total"])
    assert result.fewest_processes is None and result.most_processes == 4
    assert result.largest_batch_size * 2 <= 256  # the queue holds a step of the batch it names on 2 processes
    assert "no number of processes up to 4 (the most whose step sst_queue_size=256 holds) fits batch_size 64" in \
        describe_fit(result, cfg, 2, memory_plan(cfg, 2_000_000, 2))
