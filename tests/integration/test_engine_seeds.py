"""A seeded request reproduces: the same text whatever the depth, the batch and the timing."""

from __future__ import annotations

import pytest
from tools.tiny_models import TinyPair, as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine, generate

NEW = 32
SEEDED = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.95, seed=1234)
TEXTS = ["Hello, how can I help", "My order has not", "The refund will", "one two three"]


@pytest.fixture(scope="module")
def pair() -> TinyPair:
    return build_pair("llama", seed=0)


def _engine(
    pair: TinyPair, knobs: SpeculationKnobs | None, options: EngineOptions | None = None
) -> SpeculativeEngine:
    tok = pair.tokenizer
    draft = as_loaded(pair.draft, tok, "draft") if knobs is not None else None
    return SpeculativeEngine(
        as_loaded(pair.target, tok, "target"),
        draft,
        knobs or SpeculationKnobs(),
        options=options,
    )


@pytest.fixture(scope="module")
def prompts(pair: TinyPair) -> list[list[int]]:
    return [pair.tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def target_only(pair: TinyPair, prompts: list[list[int]]) -> list[int]:
    (result,) = generate(_engine(pair, None), [prompts[0]], SEEDED)
    return result.token_ids


@pytest.mark.parametrize("depth", range(1, 9))
def test_the_same_seed_gives_the_same_tokens_at_every_fixed_depth(
    pair: TinyPair, prompts: list[list[int]], target_only: list[int], depth: int
) -> None:
    knobs = SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False)
    (result,) = generate(_engine(pair, knobs), [prompts[0]], SEEDED)
    assert result.token_ids == target_only
    assert result.stats.drafted_tokens > 0


@pytest.mark.parametrize("max_depth", [1, 4, 8])
def test_the_same_seed_gives_the_same_tokens_with_adaptive_knobs_in_any_batch(
    pair: TinyPair, prompts: list[list[int]], target_only: list[int], max_depth: int
) -> None:
    """Default (adaptive) knobs: depth and the confidence stop follow measured times;
    batch-mates greedy, sampled unseeded and seeded otherwise; a small step budget
    so that prompts enter in chunks beside decoding rows."""
    knobs = SpeculationKnobs(max_depth=max_depth)
    mates = [
        SamplingParams(max_new_tokens=NEW),
        SamplingParams(max_new_tokens=NEW // 2, temperature=1.0),
        SamplingParams(max_new_tokens=NEW, temperature=0.7, seed=99),
    ]
    engine = _engine(pair, knobs, EngineOptions(max_slots=4, max_length=256, max_step_tokens=12))
    (alone,) = generate(engine, [prompts[0]], SEEDED)
    crowd = generate(
        engine, [prompts[1], prompts[0], prompts[2], prompts[3]], [mates[0], SEEDED, *mates[1:]]
    )
    late: dict[str, list[int]] = {}
    engine.add_request("first", prompts[2], mates[1])
    engine.step()
    engine.step()
    engine.add_request("seeded", prompts[0], SEEDED)  # joins a running batch mid-way
    while engine.has_unfinished():
        for event in engine.step():
            late.setdefault(event.request_id, []).extend(event.token_ids)
    assert alone.token_ids == target_only
    assert crowd[1].token_ids == target_only
    assert late["seeded"] == target_only


def test_another_seed_gives_other_tokens(
    pair: TinyPair, prompts: list[list[int]], target_only: list[int]
) -> None:
    other = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.95, seed=1235)
    (result,) = generate(_engine(pair, SpeculationKnobs()), [prompts[0]], other)
    assert result.token_ids != target_only
