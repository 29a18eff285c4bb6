# Every target sets itself up: a fresh machine needs only python3 and pip.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test demo bench clean-venv

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r requirements.txt
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) tools/demo.py

bench: $(STAMP)
	$(PY) bench/bench_pfc.py
	$(PY) bench/bench_backbones.py
	$(PY) bench/bench_data.py
	$(PY) bench/bench_train.py
	$(PY) bench/bench_eval.py

clean-venv:
	rm -rf .venv
