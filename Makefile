# Every target sets itself up: a fresh machine needs only python3 and pip.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test lint demo bench mutants clean-venv

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	.venv/bin/lint-imports --no-cache --no-logo

test: lint
	$(PY) -m pytest -q tests

# Mutation testing (minutes per module, not part of `make test`): per module, mutants, killed, survived.
mutants: $(STAMP)
	$(PY) -m tests.mutants $(MODULES)

demo: $(STAMP)
	$(PY) -m tools.demo

bench: $(STAMP)
	$(PY) -m bench.bench_pfc
	$(PY) -m bench.bench_backbones
	$(PY) -m bench.bench_data
	$(PY) -m bench.bench_train
	$(PY) -m bench.bench_eval

clean-venv:
	rm -rf .venv
