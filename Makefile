# Strata: `make demo` runs the whole thing, `make test` runs every check. Both install what they need.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test lint format typecheck schemas schemas-check unit integration up demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU wheel on disk; anything else pulls GBs of CUDA.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,s3,torch]'
	touch $(STAMP)

test: install lint typecheck schemas-check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

integration: install
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check libs services tests bench
	$(BIN)/ruff format --check libs services tests bench

format: install
	$(BIN)/ruff check --fix libs services tests bench
	$(BIN)/ruff format libs services tests bench

# mypy sees the installed layout (strata.services -> services/) through a tree of symlinks.
typecheck: install
	rm -rf .typecheck && mkdir -p .typecheck/strata
	for entry in libs/strata/*; do ln -s ../../$$entry .typecheck/strata/; done
	ln -s ../../services .typecheck/strata/services
	$(BIN)/mypy

schemas: install
	$(BIN)/python -m strata.events.schemagen --out schemas

schemas-check: install
	$(BIN)/python -m strata.events.schemagen --out schemas --check

up: install
	$(BIN)/strata up

demo: install
	$(BIN)/strata demo

bench: install
	$(BIN)/python bench/bus.py

clean:
	rm -rf $(VENV) .typecheck .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info
