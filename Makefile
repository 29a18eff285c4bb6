# Every target sets itself up: a fresh machine needs only python3 and pip.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test test-flaky lint demo bench mutants clean-venv FORCE

# The project itself goes in editable (pyproject.toml), so that `python tools/x.py` finds its packages in
# this checkout. Installed again when pyproject.toml changes, and when the venv's install is missing or points
# at another checkout (a venv shared between checkouts, or moved).
EDITABLE := .venv/.editable
INSTALLED_FROM := $(shell $(PY) -I -c 'import importlib.metadata as m, json; \
	print(json.loads(m.distribution("pairface").read_text("direct_url.json"))["url"])' 2>/dev/null)

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

$(EDITABLE): $(STAMP) pyproject.toml $(if $(filter file://$(CURDIR),$(INSTALLED_FROM)),,FORCE)
	$(PY) -m pip install -q --no-deps -e .
	touch $(EDITABLE)

FORCE:

lint: $(EDITABLE)
	$(PY) -m ruff check .
	.venv/bin/lint-imports --no-cache --no-logo

# Two workers, each taking whole files (module fixtures run once): the tests keep torch at one thread.
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The suite 3 times in 3 random orders on two workers (not part of `make test`): every test that failed in any
# run, with the seeds that replay it (`pytest -p randomly --randomly-seed=N`).
test-flaky: $(EDITABLE)
	$(PY) -m tests.flaky

# Mutation testing (minutes per module, not part of `make test`): per module, mutants, killed, survived.
mutants: $(EDITABLE)
	$(PY) -m tests.mutants $(MODULES)

demo: $(EDITABLE)
	$(PY) -m tools.demo

bench: $(EDITABLE)
	$(PY) -m bench.bench_pfc
	$(PY) -m bench.bench_backbones
	$(PY) -m bench.bench_data
	$(PY) -m bench.bench_train
	$(PY) -m bench.bench_eval

clean-venv:
	rm -rf .venv
