"""Shared pytest setup: offline model loading, CUDA skip marker."""

from __future__ import annotations

import os

import pytest

from specpair_runtime.openmp import apply_openmp_defaults

pytest_plugins = ["tests.support.k8s_fixtures"]

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The runtime's OpenMP thread waiting (before torch loads), here and in child processes.
apply_openmp_defaults()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `cuda` where no CUDA device is present."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
