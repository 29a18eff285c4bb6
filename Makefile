# Every target sets itself up: a fresh machine needs only python3 and pip.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test test-flaky test-compat lint demo bench mutants clean-venv FORCE

# The project itself goes in editable (pyproject.toml), so that `python tools/x.py` finds its packages in
# this checkout. Installed again when pyproject.toml changes, and when the venv's install is missing or points
# at another checkout (a venv shared between checkouts, or moved).
EDITABLE := .venv/.editable
INSTALLED_FROM := $(shell $(PY) -I -c 'import importlib.metadata as m, json; \
	print(json.loads(m.distribution("pairface").read_text("direct_url.json"))["url"])' 2>/dev/null)

# constraints.txt: the exact torch/torchvision the suite runs on here (requirements.txt has ranges).
# requirements-detect.txt: the optional face detector (--detect), without the dependencies it declares.
$(STAMP): requirements.txt requirements-dev.txt requirements-detect.txt constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -c constraints.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-detect.txt
	touch $(STAMP)

$(EDITABLE): $(STAMP) pyproject.toml $(if $(filter file://$(CURDIR),$(INSTALLED_FROM)),,FORCE)
	$(PY) -m pip install -q --no-deps -e .
	touch $(EDITABLE)

FORCE:

lint: $(EDITABLE)
	$(PY) -m ruff check .
	.venv/bin/lint-imports --no-cache --no-logo

# Two workers, each taking whole files (module fixtures run once): the tests keep torch at one thread. Files in
# collection order, where the slow ones come first (tests/conftest.py), not xdist's most-tests-first.
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# The suite 3 times in 3 random orders on two workers (not part of `make test`): every test that failed in any
# run, with the seeds that replay it (`pytest -p randomly --randomly-seed=N`).
test-flaky: $(EDITABLE)
	$(PY) -m dev.flaky

# The compatibility tier (docs/testing.md): `make test-compat TORCH=2.4.1` makes .venv-torch-2.4.1 with that
# torch, its torchvision (0.(minor + 15).patch: 2.4.1 -> 0.19.1, 2.11.0 -> 0.26.0; or TORCHVISION=) and the other
# requirements, and runs COMPAT_TESTS there (the checkout on PYTHONPATH, no editable install), then
# COMPAT_CHECKS_<torch>, a command line run with that venv's python first on PATH (empty: none).
TORCH ?= 2.11.0
TORCHVISION ?= $(shell echo $(TORCH) | awk -F. '{ print "0." $$2 + 15 "." $$3 }')
COMPAT_VENV := .venv-torch-$(TORCH)
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_TESTS := \
	tests/test_compat.py \
	tests/test_partial_fc.py::test_world1_ddp_equals_dense_reference \
	tests/test_partial_fc.py::test_world2_ddp_gradients_equal_dense_reference \
	tests/test_partial_fc.py::test_under_bf16_autocast_the_softmax_sees_cosines_far_more_exact_than_bfloat16 \
	tests/test_train.py::test_two_process_run_logs_verifies_and_checkpoints \
	tests/test_train.py::test_resume_on_one_process_continues_at_the_saved_step_with_the_saved_lr \
	'tests/test_fault_injection.py::test_a_damaged_or_hostile_checkpoint_file_is_one_error_line_and_changes_nothing[checkpoint-000000002/.metadata-forged payload]' \
	'tests/test_fault_injection.py::test_a_damaged_or_hostile_checkpoint_file_is_one_error_line_and_changes_nothing[checkpoint-000000002/.metadata-truncated]' \
	'tests/test_fault_injection.py::test_a_damaged_or_hostile_checkpoint_file_is_one_error_line_and_changes_nothing[checkpoint-000000002/__1_0.distcp-flipped]' \
	'tests/test_fault_injection.py::test_a_damaged_or_hostile_checkpoint_file_is_one_error_line_and_changes_nothing[checkpoint-000000002/__1_0.distcp-forged payload]' \
	'tests/test_fault_injection.py::test_a_damaged_or_hostile_checkpoint_file_is_one_error_line_and_changes_nothing[checkpoint-000000002/backbone.pth-forged payload]' \
	'tests/test_fault_injection.py::test_a_damaged_or_hostile_checkpoint_file_is_one_error_line_and_changes_nothing[checkpoint-000000002/state.json-flipped]' \
	tests/test_fault_injection.py::test_a_run_folder_without_its_pointer_resumes_from_its_newest_complete_folder_after_checking_it \
	tests/test_backbones.py::test_builds_on_the_meta_device_for_the_memory_plan \
	tests/test_memory_plan.py::test_the_dry_run_says_whether_it_fits_and_the_largest_batch_and_fewest_processes_that_do \
	tests/test_export_inference.py::test_export_of_mbf_matches_pytorch_in_onnxruntime
# The device check's CPU rehearsal (every row for real at tiny shapes, ~3-8 minutes) under the GPU machine's
# torch: PY=python is that venv's (the script would otherwise take .venv's).
COMPAT_CHECKS_2.11.0 := PY=python bash gpu_acceptance/gpu_check.sh --tiny

$(COMPAT_VENV)/.installed: requirements.txt
	test -x $(COMPAT_PY) || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q torch==$(TORCH) torchvision==$(TORCHVISION) -r requirements.txt pytest pytest-timeout
	touch $@

test-compat: $(COMPAT_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(COMPAT_PY) -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)
	$(if $(COMPAT_CHECKS_$(TORCH)),PATH=$(CURDIR)/$(COMPAT_VENV)/bin:$$PATH PYTHONPATH=$(CURDIR) $(COMPAT_CHECKS_$(TORCH)))

# Mutation testing (minutes per module, not part of `make test`): per module, mutants, killed, survived.
mutants: $(EDITABLE)
	$(PY) -m dev.mutants $(MODULES)

demo: $(EDITABLE)
	$(PY) -m tools.demo

bench: $(EDITABLE)
	$(PY) -m bench.bench_pfc
	$(PY) -m bench.bench_backbones
	$(PY) -m bench.bench_data
	$(PY) -m bench.bench_train
	$(PY) -m bench.bench_train --split
	$(PY) -m bench.bench_eval

clean-venv:
	rm -rf .venv .venv-torch-*
