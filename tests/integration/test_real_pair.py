"""Greedy identity on the real Qwen2.5-Coder 0.5B -> 1.5B pair (``make models``)."""

from __future__ import annotations

import pytest

from specpair_runtime.config import ModelSpec, SpeculationKnobs, recommended_draft_quantization
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.oneshot import run_request
from specpair_runtime.engine.options import EngineOptions
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


@pytest.mark.slow
def test_real_pair_batches_with_chunked_prefill_and_joins_keep_identity() -> None:
    """Unequal prompts, one joining mid-decode, prompts split into chunks, depths 1/4/8."""
    real = require_real_pair()
    pair = load_pair(
        ModelSpec(source=str(real.target_dir)),
        ModelSpec(source=str(real.draft_dir), quantization=recommended_draft_quantization("cpu")),
        SpeculationKnobs(max_depth=4),
        "cpu",
    )
    tokenizer = pair.target.tokenizer
    texts = (
        "Hi!",
        "Write a Python function that returns the sum of a list.",
        "Write fib(n) in Python, iteratively, with a docstring, type hints and two doctests.",
    )
    prompts = [encode_prompt(tokenizer, text, chat=True) for text in texts]
    assert len({len(p) for p in prompts}) == len(prompts)  # unequal lengths
    options = EngineOptions(max_slots=4, max_length=256, max_step_tokens=16)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    solo = [
        run_request(pair.engine(speculate=False, options=options), p, params).token_ids
        for p in prompts
    ]
    for depth in (1, 4, 8):
        knobs = SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False)
        engine = pair.engine(knobs=knobs, options=options)
        outputs: dict[str, list[int]] = {}
        engine.add_request("0", prompts[0], params)
        engine.add_request("1", prompts[1], params)
        steps = 0
        while engine.has_unfinished() or "2" not in outputs:
            if steps == 3:  # joins while the others decode (or still prefill)
                engine.add_request("2", prompts[2], params)
                outputs["2"] = []
            for event in engine.step():
                outputs.setdefault(event.request_id, []).extend(event.token_ids)
            steps += 1
        assert [outputs[str(i)] for i in range(3)] == solo, depth
