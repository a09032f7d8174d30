# Strata: `make demo` runs the whole thing, `make test` runs every check. Both install what they need.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The install stamp is named by the hash of the files pip installs from, so `make install` is a
# no-op until their content changes (a checkout that only touches them installs nothing).
INSTALL_HASH := $(shell cat pyproject.toml setup.py | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(INSTALL_HASH)
PYTEST_ARGS ?=

.PHONY: install dashboard dashboard-modules dashboard-test wheel test check chaos faults lint format typecheck schemas schemas-check unit integration up demo bench clean

install: $(STAMP)

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU wheel on disk; anything else pulls GBs of CUDA.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# The distribution was called "strata" before it became strata-ctl: drop an old editable install.
	$(BIN)/python -m pip uninstall --quiet --yes strata 2>/dev/null || true
	# Every extra: the tests run the SDK, the stack, S3 and torch.
	$(BIN)/python -m pip install --quiet -e '.[dev,s3,torch,server]'
	# The browser tests drive Debian's Chromium (a browser download is not possible here).
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	rm -f $(VENV)/.installed*
	touch $(STAMP)

# The dashboard: npm ci (only when node_modules does not match package-lock.json, see
# scripts/dashboard_modules.py), event types from schemas/, API types from the gateway's OpenAPI
# document, vite build.
# The gateway serves dashboard/dist/ at "/".
dashboard-modules:
	$(PYTHON) scripts/dashboard_modules.py

dashboard: $(STAMP) dashboard-modules
	$(BIN)/python scripts/gen_types.py
	$(BIN)/python scripts/gen_api_types.py
	cd dashboard && npm run build

# The dashboard's own checks: eslint (with the rules of hooks) and vitest (hooks, formatters).
dashboard-test: dashboard-modules
	cd dashboard && npm run lint && npm test

# A wheel (and sdist) under dist/ that carries the built dashboard: pip install dist/strata_ctl-*.whl.
wheel: install dashboard
	$(BIN)/python -m build --outdir dist .

# Two test processes (pytest-xdist): each has its own servers on free ports, so they share nothing.
TEST_PROCESSES ?= 2

test: install dashboard dashboard-test lint typecheck schemas-check
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) $(PYTEST_ARGS)

# The fast tier for every change (tests/tiers.py): lint, types, schemas, the dashboard's own checks,
# the unit tests and the integration tests not marked slow, on two processes, property tests with a
# fifth of their examples.
check: install dashboard-test lint typecheck schemas-check
	STRATA_TEST_TIER=check $(BIN)/python -m pytest tests/unit tests/integration -m "not slow" --dist worksteal \
		-n $(TEST_PROCESSES) -p no:cacheprovider $(PYTEST_ARGS)

chaos: install
	$(BIN)/python -m pytest tests/chaos -s $(PYTEST_ARGS)

faults: install
	$(BIN)/python -m pytest tests/faults $(PYTEST_ARGS)

unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

integration: install
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check libs services tests bench scripts
	$(BIN)/ruff format --check libs services tests bench scripts

format: install
	$(BIN)/ruff check --fix libs services tests bench scripts
	$(BIN)/ruff format libs services tests bench scripts

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
	$(BIN)/python scripts/gen_api_types.py --check

up: install dashboard
	$(BIN)/strata up

demo: install dashboard
	$(BIN)/strata demo

bench: install
	$(BIN)/python bench/bus.py

clean:
	rm -rf $(VENV) .typecheck .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info build dist
	rm -rf dashboard/node_modules dashboard/dist dashboard/src/generated test-artifacts
