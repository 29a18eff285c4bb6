"""PartialFC with ``compile_margin_softmax=True`` (its softmax passes compiled by torch.compile, C++ from
inductor on this CPU) against the same dense float64 references as the eager path: every margin family in one
process, exact and sampled, and the combined family with both of arcface_torch's options and an empty shard on 2
gloo processes; a training run with the config key, resumed bitwise; and tools/check_pfc with the switch.

Compiling costs seconds per graph on this CPU: one view count per case, and the kernels cached for the module in
TORCHINDUCTOR_CACHE_DIR under the test session's temporary folder (the ranks of the 2-process world read what this
process compiled there). Dynamo's counters say that graphs were compiled (in the 2-process world: by each fresh
rank), and fullgraph=True makes a pass dynamo could not take whole an error, not a silent fall back to eager.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils.cpp_extension  # noqa: F401 (below)
from torch._dynamo.utils import counters

import partial_fc
from losses import CombinedMarginLoss
from partial_fc import PartialFC
from tests.distributed_helpers import run_world
from tests.run_helpers import assert_same_run, run_here
from tests.test_check_pfc import run_main
from tests.test_margin_families import family_against_dense
from tests.test_partial_fc import ARCFACE, COSFACE, assert_float64_close, assert_matches_reference, pfc_against_dense

COMBINED = {  # pfc_against_dense's cases: the plain margin, and arcface_torch's options with sampling
    "arcface": dict(views=2, margin=ARCFACE),
    "cosface sampled": dict(views=2, margin=COSFACE, num_classes=41, sample_rate=0.3),
    "options sampled": dict(views=2, margin=ARCFACE, straight_through=True, threshold=0.2, num_classes=41,
                            sample_rate=0.5),
}
# torch.utils.cpp_extension, which inductor's first compile imports, warns once on stderr where a CUDA toolkit is
# installed without a GPU (this machine): imported above, it warns before the training runs whose stderr is read.
FAMILIES = ["subcenter", "adaface", "curricular", "elastic_arc_plus"]  # each with what it adds: K, norms, modulation


@pytest.fixture(autouse=True, scope="module")
def inductor_cache(tmp_path_factory):
    """One cache folder for the module's compiles (and its ranks'), one compile thread (no worker processes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        patch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        yield


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("case", COMBINED)
def test_the_combined_family_compiled_equals_the_dense_reference(case):
    assert_matches_reference(pfc_against_dense(**COMBINED[case], seed=7, compile_margin_softmax=True), case)
    assert graphs_compiled(), "the passes ran compiled"


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("setting", ["exact", "sampled"])
def test_each_family_compiled_equals_its_dense_reference_over_three_steps(name, setting):
    assert_family_matches(family_against_dense(name, 2, setting, seed=3, compile_margin_softmax=True),
                          f"{name}, {setting}")
    assert graphs_compiled(), "the passes ran compiled"


def assert_family_matches(result: dict, what: str) -> None:
    assert result, "rank 0 reports the comparison"
    for name, (actual, expected) in result.items():
        assert_float64_close(actual, expected, f"{what}: {name}")


def test_another_number_of_columns_compiles_nothing_again():
    """Sampling changes the logits' width from step to step: the passes are compiled for any width."""
    def step(num_classes: int) -> None:
        pfc = PartialFC(CombinedMarginLoss(), 8, num_classes, compile_margin_softmax=True)
        loss, _ = pfc([torch.randn(6, 8, requires_grad=True)], torch.randint(0, num_classes, (6,)))
        loss.backward()

    step(30)
    before = graphs_compiled()
    for num_classes in (31, 57, 200):
        step(num_classes)
    assert graphs_compiled() == before


def test_training_with_the_key_resumes_as_the_uninterrupted_run(data, tmp_path, monkeypatch):
    """configs/base.py's compile_margin_softmax reaches PartialFC, and a run resumed with it is bitwise the
    uninterrupted run (sampled centres)."""
    forwards, compiled_passes = [], partial_fc._compiled_passes
    monkeypatch.setattr(partial_fc, "_compiled_passes", lambda: forwards.append(1) or compiled_passes())
    overrides = ["compile_margin_softmax=True", "sample_rate=0.5"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_here(data, whole, *overrides, "max_steps=4") == (0, "")
    assert len(forwards) == 4, "each training step ran the compiled passes"
    assert run_here(data, split, *overrides, "max_steps=2") == (0, "")
    assert run_here(data, split, *overrides, "max_steps=4", resume=True) == (0, "")
    assert_same_run(split, whole)


def test_check_pfc_passes_with_the_softmax_compiled(monkeypatch, capsys):
    status, lines = run_main(monkeypatch, capsys, "--compile-margin-softmax", "--sample-rate", "0.5")
    assert status == 0, lines
    assert lines[0].endswith(", softmax compiled") and lines[-1].startswith("PASS: worst "), lines


def _two_processes(rank: int, world_size: int) -> dict:
    before = graphs_compiled()
    results = {name: pfc_against_dense(**case, seed=7, compile_margin_softmax=True) for name, case in COMBINED.items()}
    # 5 classes on 2 ranks (3 + 2), every label on rank 0's shard: rank 1 samples no centre, its passes skipped
    results["empty shard"] = pfc_against_dense(views=2, margin=ARCFACE, num_classes=5, sample_rate=0.3, labels_below=3,
                                               compile_margin_softmax=True)
    results["curricular"] = family_against_dense("curricular", 2, "sampled", seed=3, compile_margin_softmax=True)
    return dict(results=results, compiled=graphs_compiled() > before)


def test_two_processes_compiled_equal_the_dense_references():
    ranks = run_world(_two_processes, 2)
    assert all(rank["compiled"] for rank in ranks), "every rank ran the compiled passes"
    results = ranks[0]["results"]
    for name in [*COMBINED, "empty shard"]:
        assert_matches_reference(results[name], f"2 processes, {name}")
    assert_family_matches(results["curricular"], "2 processes, curricular sampled")
