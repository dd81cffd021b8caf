# gpufed — the two commands of the README do all their own set-up.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test chaos chaos-ha lint typecheck check bench clean
# the HA chaos suite's flood in `make chaos` (CI); `make chaos-ha` runs the issue's 10,000
CHAOS_JOBS ?= 2000

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gpufed needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

demo: $(VENV)/.installed
	$(BIN)/gpufed demo

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "not chaos" $(PYTEST_ARGS)

chaos: $(VENV)/.installed-test
	GPUFED_CHAOS_JOBS=$(CHAOS_JOBS) $(BIN)/python -m pytest -q -m chaos $(PYTEST_ARGS) e2e

chaos-ha: $(VENV)/.installed-test
	GPUFED_CHAOS_JOBS=10000 $(BIN)/python -m pytest -q -s -m chaos $(PYTEST_ARGS) e2e/test_chaos_ha.py

lint: $(VENV)/.installed-test
	$(BIN)/ruff check broker member-agent gpufed tests e2e
	$(BIN)/ruff format --check broker member-agent gpufed tests e2e
	$(BIN)/lint-imports --no-cache

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

check: lint typecheck test

bench: $(VENV)/.installed-test
	$(BIN)/python -m e2e.bench_scheduling
	$(BIN)/python -m e2e.bench_store
	$(BIN)/python -m e2e.bench_throughput

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
