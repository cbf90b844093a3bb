"""Engines over a tiny pair built in code, at a fixed depth or target-only."""

from __future__ import annotations

from tools.tiny_models import TinyPair, as_loaded

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine


def fixed_depth(depth: int) -> SpeculationKnobs:
    """Exactly ``depth`` drafted tokens per step, whatever the batch size or timing."""
    return SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False)


def tiny_engine(pair: TinyPair, depth: int | None, options: EngineOptions) -> SpeculativeEngine:
    """``depth`` None: the target alone (no draft loaded)."""
    tok = pair.tokenizer
    draft = as_loaded(pair.draft, tok, "draft") if depth else None
    return SpeculativeEngine(
        as_loaded(pair.target, tok, "target"), draft, fixed_depth(depth or 1), options=options
    )
