# Two entry points: `make demo` and `make test`. Both create .venv if needed and install everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tl_dist-installed
CONSTRAINTS := .ci/constraints.txt
export OMP_WAIT_POLICY ?= PASSIVE

# Debian packages the tests and the demo use, as program:package. `make` installs the missing ones when it
# can (root, or passwordless sudo, with apt-get); otherwise it prints the command and carries on: drawing
# then says how to get Graphviz, and tests that need a program skip with the reason (tests/external.py).
SYSTEM_TOOLS := dot:graphviz h5dump:hdf5-tools chromium:chromium prometheus:prometheus

.PHONY: demo test lint format bench mutation install system-packages

install: system-packages $(STAMP)

system-packages:
	@missing=""; \
	for pair in $(SYSTEM_TOOLS); do \
	    command -v "$${pair%%:*}" >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; \
	done; \
	[ -n "$$missing" ] || exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else sudo=no; fi; \
	if [ "$$sudo" != no ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing system packages:$$missing"; \
	    $$sudo apt-get update -qq && \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing \
	        >/dev/null && exit 0; \
	    echo "tl_dist: apt-get could not install$$missing; carrying on without them"; \
	else \
	    echo "tl_dist: optional system packages missing:$$missing; to get them run:"; \
	    echo "    sudo apt-get install -y$$missing"; \
	    echo "carrying on: tests that need them skip, drawing says how to get Graphviz"; \
	fi

$(STAMP): pyproject.toml setup.py $(wildcard tl_dist/_csrc/*) $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) torch
	# .[dev] pulls every extra (otel, lightning, report) besides the tools: the demo and the tests use them all.
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

# Each part prints where its files are; the last lines say where each part's folder is.
demo: install
	$(PY) examples/demo.py --out out/demo
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --out runs/ddp-demo
	$(PY) examples/lightning_ddp.py --out runs/lightning-demo
	@echo ""
	@echo "demo outputs:"
	@echo "  traced CNN:    $(CURDIR)/out/demo (graph.svg, graph_blocks.svg, ops.csv)"
	@echo "  2-rank DDP:    $(CURDIR)/runs/ddp-demo (rank*/step*.h5, merged.h5, merged.svg, merged.perfetto.json, report.html)"
	@echo "  Lightning DDP: $(CURDIR)/runs/lightning-demo (logs/version_*/metrics.csv; logs/version_*/tl_dist/: shards, merged.h5, timeline.json, graph.svg)"

test: install
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/bench_trace.py

# Mutation testing (mutmut, config in pyproject.toml) of the modules whose answers users trust, each against its
# fast tests; one module at a time on one core (CPU-heavy: about an hour in all on 2 cores). Not part of `make
# test`. Prints killed / total per module (docs/testing.md has the scores and the equivalent survivors).
MUTATED := validate merge.match merge.clocks selectors _opinfo telemetry

mutation: $(STAMP)
	@for m in $(MUTATED); do $(VENV)/bin/mutmut run --max-children 1 "tl_dist.$$m.*" || exit 1; done
	$(PY) tools/mutation_scores.py --target 85
