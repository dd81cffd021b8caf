# gpufed — the two commands of the README do all their own set-up.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test chaos chaos-ha lint typecheck check bench clean image image-test image-clean
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
	$(BIN)/python -m pytest -q -m "not chaos and not image" $(PYTEST_ARGS)

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

# The container image (broker and agent: one image) from Debian's and PyPI's packages, no
# Docker: an OCI layout at $(IMAGE_DIR)/oci and an archive beside it. As root; the stages are
# cached in $(IMAGE_DIR)/cache (IMAGE_REFRESH=1 rebuilds them all). See deploy/IMAGES.md.
IMAGE_DIR ?= build/image

image: $(BIN)/python
	PYTHON=$(abspath $(BIN)/python) IMAGE_DIR=$(IMAGE_DIR) deploy/image/build.sh

# builds the image, then runs a broker and an agent from it (e2e/test_image.py); not as root,
# neither can run: the test says so in one line and skips (fails with GPUFED_REQUIRE_IMAGE=1)
image-test: $(VENV)/.installed-test
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory image; fi
	GPUFED_IMAGE_LAYOUT=$(abspath $(IMAGE_DIR))/oci $(BIN)/python -m pytest -q -m image $(PYTEST_ARGS) e2e/test_image.py

image-clean:
	rm -rf $(IMAGE_DIR)
