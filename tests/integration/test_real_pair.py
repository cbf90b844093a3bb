"""Greedy identity on the real Qwen2.5-Coder 0.5B -> 1.5B pair (``make models``)."""

from __future__ import annotations

import pytest

from specpair_runtime.config import ModelSpec, SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.oneshot import run_request
from specpair_runtime.engine.pair import load_pair
from specpair_runtime.engine.prompting import encode_prompt
from tests.support.real_models import require_real_pair

PROMPTS = (
    "My order has not arrived yet. What should I do?",
    "Write a Python function that returns the sum of a list.",
)
NEW_TOKENS = 16


@pytest.mark.slow
def test_real_pair_greedy_identity() -> None:
    real = require_real_pair()
    pair = load_pair(
        ModelSpec(source=str(real.target_dir)),
        ModelSpec(source=str(real.draft_dir)),
        SpeculationKnobs(max_depth=4),
        "cpu",
    )
    assert pair.alignment is not None and pair.alignment.aligned, pair.alignment
    speculative = pair.engine()
    target_only = pair.engine(speculate=False)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    accepted = 0
    for text in PROMPTS:
        prompt = encode_prompt(pair.target.tokenizer, text, chat=True)
        fast = run_request(speculative, prompt, params)
        slow = run_request(target_only, prompt, params)
        assert fast.token_ids == slow.token_ids, text
        assert fast.text == slow.text
        assert len(fast.token_ids) == NEW_TOKENS  # an instruct answer is longer than 16 tokens
        assert fast.stats.drafted_tokens > 0
        accepted += fast.stats.accepted_tokens
    # The pair agrees on most greedy tokens (measured ~78%), so some drafts must land.
    assert accepted > 0
