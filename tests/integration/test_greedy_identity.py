"""Greedy speculative decoding yields exactly the target-only greedy tokens."""

from __future__ import annotations

import pytest
import torch
from tools.tiny_models import ModelKind, TinyPair, as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.speculative import SpeculativeEngine, generate
from tests.support.tiny_engines import fixed_depth

PROMPTS = [
    "Hello, how can I help",
    "My order has not",
    "def add(a, b):\n    return",
    "x",  # a one-token prompt: nothing to prefill
    "Café, naïve, über, déjà vu — 東京",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS)


class Case:
    def __init__(self, kind: ModelKind, seed: int) -> None:
        self.pair: TinyPair = build_pair(kind, seed)
        tok = self.pair.tokenizer
        self.prompts = [tok(p)["input_ids"] for p in PROMPTS]
        self.target = as_loaded(self.pair.target, tok, "target")
        self.draft = as_loaded(self.pair.draft, tok, "draft")
        engine = SpeculativeEngine(self.target, None, fixed_depth(1))
        self.baseline = [r.token_ids for r in generate(engine, self.prompts, GREEDY)]

    def engine(self, knobs: SpeculationKnobs) -> SpeculativeEngine:
        return SpeculativeEngine(self.target, self.draft, knobs)


@pytest.fixture(scope="module", params=[("llama", 0), ("gpt2", 0), ("llama", 1), ("gpt2", 2)])
def case(request: pytest.FixtureRequest) -> Case:
    kind, seed = request.param
    return Case(kind, seed)


def test_target_only_engine_matches_transformers_generate(case: Case) -> None:
    for prompt, tokens in zip(case.prompts, case.baseline, strict=True):
        with torch.inference_mode():
            out = case.pair.target.generate(  # type: ignore[operator]
                torch.tensor([prompt]),
                attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=case.pair.tokenizer.pad_token_id,
            )
        assert out[0, len(prompt) :].tolist() == tokens


@pytest.mark.parametrize("depth", range(1, 9))
def test_batched_speculation_equals_target_only(case: Case, depth: int) -> None:
    results = generate(case.engine(fixed_depth(depth)), case.prompts, GREEDY)
    assert [r.token_ids for r in results] == case.baseline
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0 < accepted < drafted  # the draft really was tested: some accepted, some not


@pytest.mark.parametrize("depth", [1, 6])
def test_single_request_speculation_equals_target_only(case: Case, depth: int) -> None:
    engine = case.engine(fixed_depth(depth))
    for prompt, expected in zip(case.prompts, case.baseline, strict=True):
        (result,) = generate(engine, [prompt], GREEDY)
        assert result.token_ids == expected
        assert result.stats.target_passes < NEW_TOKENS or result.stats.accepted_tokens == 0


def test_adaptive_depth_equals_target_only(case: Case) -> None:
    results = generate(case.engine(SpeculationKnobs(max_depth=6)), case.prompts, GREEDY)
    assert [r.token_ids for r in results] == case.baseline
