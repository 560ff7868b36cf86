# Atto Cloud usage limits. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Every package of .venv, pinned (`make lock` writes it); pip itself is pinned here.
LOCK   := constraints.txt
PIP_VERSION ?= 26.3
TOOLS  := .tools
SAM    := $(TOOLS)/bin/sam
export SAM_CLI_TELEMETRY := 0
export AWS_EC2_METADATA_DISABLED := true

FN    ?= structured
# events/$(FN).json, else the function's only event (the auditor's: events/auditor_schedule.json)
EVENT ?= $(firstword $(wildcard events/$(FN).json events/$(FN)_*.json) events/$(FN).json)

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml client/pyproject.toml $(LOCK)
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found (set PYTHON=...)"; exit 1; }
	@echo "make: installing the project and its pinned packages into $(VENV) (once; about 80 s)"
	$(PYTHON) -m venv $(VENV)
	@# -qq: errors only (pip's index and build warnings would fill the first screen)
	$(PY) -m pip install -qq pip==$(PIP_VERSION)
	$(PY) -m pip install -qq -c $(LOCK) -e '.[dev]' -e ./client
	@touch $@

.PHONY: venv
venv: $(STAMP) ## Create .venv with the project and its dev dependencies, as pinned in constraints.txt.

# A fresh resolve of pyproject.toml's dependencies and dev extra, and client/pyproject.toml's,
# in a throwaway venv, with the deps layer's pins as constraints (the packages both ship stay
# equal), frozen.
LOCK_VENV := .venv-lock
.PHONY: lock
lock: ## Re-resolve pyproject.toml (dependencies + dev extra) and the client's into constraints.txt.
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found (set PYTHON=...)"; exit 1; }
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -qq pip==$(PIP_VERSION)
	$(LOCK_VENV)/bin/python -m pip install -qq -c layers/deps/requirements.txt -e '.[dev]' -e ./client
	{ echo "# Every package of .venv, pinned: \`make venv\` installs with \`-c $(LOCK)\`."; \
	  echo "# Written by \`make lock\` (do not edit): a fresh resolve of pyproject.toml's"; \
	  echo "# dependencies and dev extra and client/pyproject.toml's, with"; \
	  echo "# layers/deps/requirements.txt's pins, on"; \
	  echo "# $$($(LOCK_VENV)/bin/python -c 'import platform as p; print("CPython", p.python_version(), p.machine())')."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

.PHONY: redis-server
redis-server: ## Install Debian's redis-server when it is missing.
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || { \
	  echo "installing redis-server with apt-get"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; }
	@# Debian's package starts a system redis on 6379; the project never uses it.

# `make test` runs the suite in two parts: every test but the timing ones in TEST_WORKERS
# pytest-xdist workers (the suite mostly waits on servers and subprocesses; each module, per
# engine, runs in one worker), then the timing tests (`-m timing`: load runs, rates and
# wake-ups measured across processes) alone, one at a time. Both parts always run.
TEST_WORKERS ?= 2

.PHONY: test
test: $(STAMP) redis-server tools checkov-tools ## Every test, 9-15 min: TEST_WORKERS=2 workers, then the timing tests alone (Redis 7 and Valkey 8).
	@status=0; \
	echo "$(PY) -m pytest -n $(TEST_WORKERS) -m 'not timing'"; \
	$(PY) -m pytest -n $(TEST_WORKERS) -m 'not timing' || status=$$?; \
	echo "$(PY) -m pytest -m timing"; \
	$(PY) -m pytest -m timing || status=$$?; \
	exit $$status

# Lambda runs CPython 3.12; .venv is 3.11. No registry the project reaches ships a CPython
# 3.12 (docs/development.md), so this uses the machine's own when it has one (PY312, found
# by mk/sam.mk: python3.12 on PATH or pyenv's) and says so when it has none.
VENV312 := .venv312
.PHONY: test-py312
test-py312: ## On CPython 3.12 (Lambda's), when the machine has one: the unit tests (no servers).
	@if [ -z "$(PY312)" ]; then \
	  echo "test-py312: no CPython 3.12 on this machine; skipped (see docs/development.md)"; \
	  exit 0; fi; \
	set -e; echo "test-py312: $$($(PY312) -V) at $(PY312)"; \
	[ -x $(VENV312)/bin/python ] || $(PY312) -m venv $(VENV312); \
	$(VENV312)/bin/python -m pip install -qq pip==$(PIP_VERSION); \
	$(VENV312)/bin/python -m pip install -qq -c $(LOCK) -e '.[dev]' -e ./client; \
	$(VENV312)/bin/python -m pytest -n $(TEST_WORKERS) -m 'not timing' -p no:cacheprovider tests/unit

# `make test-quick`: the fast part, for the edit-test loop: the unit and client tests and
# every function and web-layer test in process, on Redis 7 standalone; no cluster, no
# multi-process or end-to-end (`slow`) or timing tests, nothing that needs the SAM or checkov
# venvs. About 1-2 minutes on 2 cores.
QUICK_TESTS := tests/unit tests/client tests/integration/test_fn_*.py tests/integration/test_web_*.py

.PHONY: test-quick
test-quick: $(STAMP) redis-server ## The fast part of the tests, about 1-2 minutes (make test runs all of it).
	$(PY) -m pytest -n $(TEST_WORKERS) -m 'not slow and not timing and not cluster' --engine redis7 \
	  --deselect tests/unit/test_template.py::test_checkov_passes_with_a_reason_for_every_skip \
	  $(QUICK_TESTS)

.PHONY: serve
serve: $(STAMP) redis-server ## Run the API locally (PORT=8000, WORKERS=1); its state stays in .local/ across restarts.
	ATTO_LOCAL_DATA="$${ATTO_LOCAL_DATA-$(CURDIR)/.local}" $(PY) -m local.serve

.PHONY: reset-local
reset-local: ## Forget the local state of make serve (budgets, grants, audit in .local/).
	rm -rf .local

.PHONY: invoke
invoke: $(STAMP) redis-server ## Run one function (any, the scheduled auditor too) on the local stack: make invoke FN=auditor
	$(PY) -m local.invoke $(FN) $(EVENT)

.PHONY: admin
admin: $(STAMP) ## Operator CLI: make admin ARGS="show alice" (a running make serve, else ARGS="--stack NAME ...").
	PYTHONPATH=tools$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m atto_admin $(ARGS)

.PHONY: bench
bench: $(STAMP) redis-server ## Run the benchmarks and print their tables (QUICK=1 for a short run).
	$(PY) bench/hotpath.py $(if $(QUICK),--quick)
	$(PY) bench/script_cost.py $(if $(QUICK),--calls 100)
	$(PY) bench/budget.py $(if $(QUICK),--quick)
	$(PY) bench/throttle.py $(if $(QUICK),--quick)
	$(PY) bench/throttle_fair.py $(if $(QUICK),--quick)
	$(PY) bench/request_overhead.py $(if $(QUICK),--quick)
	$(PY) bench/usage_records.py $(if $(QUICK),--quick)
	$(PY) bench/cold_start.py $(if $(QUICK),--quick)

.PHONY: lint
lint: $(STAMP) checkov-tools ## ruff, mypy and checkov.
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(CHECKOV) $(CHECKOV_ARGS)

include mk/sam.mk
include mk/checkov.mk
-include mk/fleet.mk
