"""Shared pytest setup: offline model loading, CUDA skip marker, longest files first."""

from __future__ import annotations

import os
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

from specpair_runtime.openmp import apply_openmp_defaults

pytest_plugins = ["tests.support.k8s_fixtures"]

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The runtime's OpenMP thread waiting (before torch loads), here and in child processes.
apply_openmp_defaults()


# Files holding a test with one of these marks start first, in this order:
# `make test` hands whole files to two workers, and a long file that starts
# last leaves the other worker idle at the end.
LONGEST_FIRST = ("e2e", "vllm", "slow", "integration")


def file_rank(items: list[pytest.Item]) -> dict[str, int]:
    """Each test file's place in LONGEST_FIRST, by its most telling mark (unmarked last)."""
    ranks: dict[str, int] = {}
    for item in items:
        rank = next(
            (i for i, mark in enumerate(LONGEST_FIRST) if mark in item.keywords),
            len(LONGEST_FIRST),
        )
        path = item.nodeid.split("::", 1)[0]
        ranks[path] = min(rank, ranks.get(path, rank))
    return ranks


# The files whose processes need several GiB (the real pair, in process or in
# vLLM; vLLM with tensor parallelism) run on one worker, one after another: two
# at once left vLLM under 1 GiB for its KV cache on a 24 GiB machine.
ONE_WORKER_FOR_BIG_MEMORY = frozenset(
    {
        "tests/integration/test_vllm_engine.py",
        "tests/integration/test_vllm_real_pair.py",
        "tests/integration/test_real_pair.py",
        "tests/integration/test_structured_real_pair.py",
        "tests/integration/test_cuda_real_pair.py",
    }
)


class FilesAndBigMemoryScheduling(LoadFileScheduling):  # type: ignore[misc]
    """--dist loadfile, except that the big-memory files form one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return "big memory" if path in ONE_WORKER_FOR_BIG_MEMORY else path


@pytest.hookimpl(optionalhook=True)  # xdist may be absent (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadFileScheduling | None:
    """Under --dist loadfile, schedule with FilesAndBigMemoryScheduling; else xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    return FilesAndBigMemoryScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the files longest first; skip tests marked `cuda` where no CUDA device is present."""
    ranks = file_rank(items)
    # A stable sort: a file's tests stay together and in their own order.
    items.sort(key=lambda item: ranks[item.nodeid.split("::", 1)[0]])
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
