# fedcomp: the two commands of the README (`make run`, `make test`) and helpers.
# Each target bootstraps .venv when it is missing or older than pyproject.toml.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

# The local CPU build of torch 2.13.0 is a cp311 wheel: prefer Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Flower phones home and installs dependencies at run time unless told not to
# (telemetry, update checks, run-time installs); these hold for every command below.
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO := 0
export FLWR_HOME := $(CURDIR)/.flwr
export PYTHONUNBUFFERED := 1

.PHONY: run test test-fast lint bench bench-quick datasets venv clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing fedcomp into $(VENV) (torch 2.13.0 CPU build first)..."
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

## run: the main job: a Flower simulation (digits, 10 clients, both directions compressed)
run: $(STAMP)
	$(VENV)/bin/fedcomp simulate --num-supernodes 10 $(if $(RUN_CONFIG),--run-config "$(RUN_CONFIG)")

## datasets: Debian's Fashion-MNIST files (the benchmark dataset), if missing
FASHION_DIR := /usr/share/datasets/fashion-mnist
datasets:
	@if [ -f $(FASHION_DIR)/train-images-idx3-ubyte.gz ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "Installing Debian's dataset-fashion-mnist..."; \
	  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && \
	    apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)) || \
	  echo "warning: could not install dataset-fashion-mnist; its tests will be skipped"; \
	else echo "note: Fashion-MNIST missing; run 'sudo apt-get install dataset-fashion-mnist'"; fi

## test: lint, then the whole test suite; "no tests collected" is an error
test: $(STAMP) datasets
	$(VENV)/bin/ruff check .
	@rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "ERROR: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

## test-fast: lint, then the tests that run no Flower simulation (about a minute)
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

## bench-quick: the codec benchmark on 1M elements
bench-quick: $(STAMP)
	$(PY) experiments/bench_codecs.py --quick --json results/bench_codecs_quick.json

## bench: the full codec benchmark (10M elements, one thread)
bench: $(STAMP)
	$(PY) experiments/bench_codecs.py --json results/bench_codecs.json

clean:
	rm -rf $(VENV) .flwr results .pytest_cache .ruff_cache .hypothesis
