# Two entry points: `make demo` and `make test`. Both create .venv if needed and install everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tl_dist-installed
CONSTRAINTS := .ci/constraints.txt
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: demo test lint format bench install

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) torch
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --out runs/ddp-demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/bench_trace.py
