"""Greedy identity on the real Qwen2.5-Coder 0.5B -> 1.5B pair (``make models``).

The pair is loaded once for the module, with the draft that the CPU runs by
default (``recommended_draft_quantization``), and every engine is sized to
the few short requests here: the default sizing allocates (and zeroes) KV
for 8 requests of 2048 tokens per engine, which costs seconds per engine on
this machine and tests nothing that the tiny pairs do not.
"""

from __future__ import annotations

import pytest

from specpair_runtime.config import ModelSpec, SpeculationKnobs, recommended_draft_quantization
from specpair_runtime.engine.api import SamplingParams, TokenLogprob
from specpair_runtime.engine.oneshot import Completion, run_request
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.pair import LoadedPair, load_pair
from specpair_runtime.engine.prompting import encode_prompt
from specpair_runtime.engine.speculative import SpeculativeEngine, eos_token_ids
from tests.support.real_models import require_real_pair

SUPPORT = "My order has not arrived yet. What should I do?"
CODING = "Write a Python function that returns the sum of a list."
BATCH = (
    "Hi!",
    CODING,
    "Write fib(n) in Python, iteratively, with a docstring, type hints and two doctests.",
)
NEW_TOKENS = 16
OPTIONS = EngineOptions(max_slots=4, max_length=256, max_step_tokens=16)


@pytest.fixture(scope="module")
def pair() -> LoadedPair:
    real = require_real_pair()
    return load_pair(
        ModelSpec(source=str(real.target_dir)),
        ModelSpec(source=str(real.draft_dir), quantization=recommended_draft_quantization("cpu")),
        SpeculationKnobs(),
        "cpu",
        OPTIONS,
    )


@pytest.fixture(scope="module")
def target_only(pair: LoadedPair) -> dict[str, Completion]:
    """Each prompt's greedy target-only completion, decoded alone."""
    engine = pair.engine(speculate=False)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    return {text: run_request(engine, _encode(pair, text), params) for text in (SUPPORT, *BATCH)}


def _encode(pair: LoadedPair, text: str) -> list[int]:
    return encode_prompt(pair.target.tokenizer, text, chat=True)


@pytest.mark.slow
def test_real_pair_greedy_identity_with_default_knobs(
    pair: LoadedPair, target_only: dict[str, Completion]
) -> None:
    """The default knobs (adaptive depth) on a support and a coding prompt, one at a time."""
    assert pair.alignment is not None and pair.alignment.aligned, pair.alignment
    speculative = pair.engine()
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    accepted = 0
    for text in (SUPPORT, CODING):
        fast = run_request(speculative, _encode(pair, text), params)
        assert fast.token_ids == target_only[text].token_ids, text
        assert fast.text == target_only[text].text
        assert len(fast.token_ids) == NEW_TOKENS  # an instruct answer is longer than 16 tokens
        assert fast.stats.drafted_tokens > 0
        accepted += fast.stats.accepted_tokens
    # The pair agrees on most greedy tokens (measured 0.70-0.94), so some drafts must land.
    assert accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 4, 8])
def test_real_pair_batches_with_chunked_prefill_and_joins_keep_identity(
    pair: LoadedPair, target_only: dict[str, Completion], depth: int
) -> None:
    """Unequal prompts, one joining mid-decode, prompts split into 16-token chunks."""
    prompts = [_encode(pair, text) for text in BATCH]
    assert len({len(p) for p in prompts}) == len(prompts)  # unequal lengths
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    # Speculating beside the prompt chunks too (duringPrefill is off on the CPU by
    # default): the harder case, and CUDA's default.
    knobs = SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False, during_prefill=True)
    engine = pair.engine(knobs=knobs)
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
    assert [outputs[str(i)] for i in range(3)] == [target_only[t].token_ids for t in BATCH]


@pytest.mark.slow
def test_a_raw_completion_ends_where_the_model_writes_endoftext(pair: LoadedPair) -> None:
    """The pair's GGUF files name one EOS, ``<|im_end|>``; upstream Qwen also ends on
    ``<|endoftext|>``, and so must the converted pair: this raw (no chat template)
    completion writes one sentence, then ``<|endoftext|>``; with only the GGUF's
    EOS it would run on into a new document."""
    tokenizer = pair.target.tokenizer
    ends = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert ends <= eos_token_ids(pair.target)
    prompt = encode_prompt(tokenizer, "Hello, how can I help you", chat=False)
    done = run_request(pair.engine(), prompt, SamplingParams(max_new_tokens=64))
    assert done.finish_reason == "stop"
    assert done.token_ids[-1] in ends and len(done.token_ids) < 64
    assert "<|endoftext|>" not in done.text


def _logprobs(
    engine: SpeculativeEngine, prompt: list[int], params: SamplingParams
) -> list[TokenLogprob]:
    engine.add_request("lp", prompt, params)
    entries: list[TokenLogprob] = []
    while engine.has_unfinished():
        for event in engine.step():
            assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)
            entries += event.logprobs
    return entries


@pytest.mark.slow
def test_real_pair_logprobs_equal_target_only(pair: LoadedPair) -> None:
    """Each committed token's logprob at depth 4 is the one a target-only step gives."""
    prompt = _encode(pair, CODING)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=2)
    plain = _logprobs(pair.engine(speculate=False), prompt, params)
    knobs = SpeculationKnobs(max_depth=4, min_depth=4, adaptive=False)
    fast = _logprobs(pair.engine(knobs=knobs), prompt, params)
    assert [e.token_id for e in fast] == [e.token_id for e in plain]
    for a, b in zip(fast, plain, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.top[0][0] == a.token_id  # greedy: the most likely token
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
