"""The real Qwen2.5-Coder pair that ``make models`` puts in the cache, for slow tests.

``real_pair()`` answers cheaply (marker files and stat only, no hashing) and
returns None when the pair is not fetched; ``require_real_pair()`` turns that
into a pytest skip that says how to fetch it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from tools.fetch_models import (
    SOURCES,
    CacheLayout,
    default_cache,
    gguf_is_verified,
    marker_problem,
)

SKIP_REASON = "the real model pair is not in the cache; run `make models`"


@dataclass(frozen=True)
class RealPair:
    """Converted Hugging Face directories and the GGUF files they came from."""

    target_dir: Path
    draft_dir: Path
    target_gguf: Path
    draft_gguf: Path


def real_pair(cache: Path | None = None) -> RealPair | None:
    """The fetched pair under ``cache`` (default ``$SPECPAIR_CACHE``), or None if incomplete."""
    layout = CacheLayout(cache if cache is not None else default_cache())
    for src in SOURCES.values():
        if marker_problem(layout.model_dir(src), src) is not None:
            return None
        if not gguf_is_verified(layout.gguf_path(src), layout.gguf_stamp(src), src):
            return None
    target, draft = SOURCES["target"], SOURCES["draft"]
    return RealPair(
        target_dir=layout.model_dir(target),
        draft_dir=layout.model_dir(draft),
        target_gguf=layout.gguf_path(target),
        draft_gguf=layout.gguf_path(draft),
    )


def require_real_pair(cache: Path | None = None) -> RealPair:
    """The fetched pair, or skip the calling test with a pointer to `make models`."""
    pair = real_pair(cache)
    if pair is None:
        pytest.skip(SKIP_REASON)
    return pair
