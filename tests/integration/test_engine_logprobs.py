"""Log-probabilities of committed tokens, on the tiny pair, against transformers' own forward.

Every committed token's logprob must be the target's log-softmax at the
position that scored it, whether it came from an accepted draft, a recovered
token or the bonus token, at any depth and in target-only decoding.
"""

from __future__ import annotations

import pytest
import torch
from tools.tiny_models import TinyPair, build_pair

from specpair_runtime.engine.api import SamplingParams, StepEvent, TokenLogprob
from specpair_runtime.engine.logprobs import MAX_TOP_LOGPROBS
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine
from tests.support.tiny_engines import tiny_engine

NEW = 20
PROMPTS = ["Hello, how can I help you", "def add(a, b):", "one two three"]


@pytest.fixture(scope="module")
def pair() -> TinyPair:
    return build_pair("llama", seed=0)


@pytest.fixture(scope="module")
def prompts(pair: TinyPair) -> list[list[int]]:
    return [pair.tokenizer(p)["input_ids"] for p in PROMPTS]


def _engine(pair: TinyPair, depth: int | None) -> SpeculativeEngine:
    return tiny_engine(pair, depth, EngineOptions(max_slots=4, max_length=128))


def _run(
    engine: SpeculativeEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[tuple[list[int], list[TokenLogprob] | None, list[StepEvent]]]:
    """Each request's tokens, logprobs (None if it never got any) and events."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(request_id, prompt, p)
    events: dict[str, list[StepEvent]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for event in engine.step():
            events[event.request_id].append(event)
    out = []
    for i in ids:
        tokens = [t for e in events[i] for t in e.token_ids]
        with_output = [e for e in events[i] if e.token_ids]
        logprobs = (
            [lp for e in with_output for lp in (e.logprobs or [])]
            if any(e.logprobs is not None for e in with_output)
            else None
        )
        out.append((tokens, logprobs, events[i]))
    return out


def _reference(pair: TinyPair, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every output position: [len(tokens), V]."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = pair.target(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def _assert_matches(
    reference: torch.Tensor, tokens: list[int], logprobs: list[TokenLogprob], top: int
) -> None:
    assert [lp.token_id for lp in logprobs] == tokens
    chosen = torch.tensor([lp.logprob for lp in logprobs])
    expected = reference.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(chosen, expected, atol=1e-4, rtol=1e-4)
    if top:
        values, ids = reference.topk(top, dim=-1)
        for position, lp in enumerate(logprobs):
            assert len(lp.top) == top
            assert [t for t, _ in lp.top] == ids[position].tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in lp.top]), values[position], atol=1e-4, rtol=1e-4
            )


@pytest.mark.parametrize("depth", [None, 1, 4, 8])
def test_greedy_logprobs_match_transformers(
    pair: TinyPair, prompts: list[list[int]], depth: int | None
) -> None:
    params = SamplingParams(max_new_tokens=NEW, logprobs=3)
    results = _run(_engine(pair, depth), prompts, [params] * len(prompts))
    for prompt, (tokens, logprobs, _) in zip(prompts, results, strict=True):
        assert logprobs is not None and len(tokens) == NEW
        _assert_matches(_reference(pair, prompt, tokens), tokens, logprobs, top=3)
        for lp in logprobs:  # greedy: the chosen token is the most likely one
            assert lp.top[0][0] == lp.token_id


def test_speculative_logprobs_equal_target_only(pair: TinyPair, prompts: list[list[int]]) -> None:
    params = [SamplingParams(max_new_tokens=NEW, logprobs=0)] * len(prompts)
    plain = _run(_engine(pair, None), prompts, params)
    speculative = _run(_engine(pair, 4), prompts, params)
    for (tokens_a, lp_a, _), (tokens_b, lp_b, _) in zip(plain, speculative, strict=True):
        assert tokens_a == tokens_b
        assert lp_a is not None and lp_b is not None
        assert all(not lp.top for lp in lp_b)  # 0 alternatives asked for
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in lp_a]),
            torch.tensor([lp.logprob for lp in lp_b]),
            atol=1e-5,
            rtol=1e-5,
        )


def test_sampled_tokens_get_the_raw_target_logprobs(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """With temperature and top-k the values stay the model's own (vLLM's raw logprobs)."""
    params = [
        SamplingParams(max_new_tokens=NEW, temperature=1.3, top_k=5, seed=i, logprobs=2)
        for i in range(len(prompts))
    ]
    results = _run(_engine(pair, 4), prompts, params)
    for prompt, (tokens, logprobs, _) in zip(prompts, results, strict=True):
        assert logprobs is not None
        _assert_matches(_reference(pair, prompt, tokens), tokens, logprobs, top=2)


def test_only_the_asking_request_gets_logprobs(pair: TinyPair, prompts: list[list[int]]) -> None:
    params = [
        SamplingParams(max_new_tokens=NEW),
        SamplingParams(max_new_tokens=NEW, logprobs=1),
        SamplingParams(max_new_tokens=NEW),
    ]
    results = _run(_engine(pair, 4), prompts, params)
    assert results[0][1] is None and results[2][1] is None
    tokens, logprobs, events = results[1]
    assert logprobs is not None and len(logprobs) == len(tokens)
    for event in events:  # aligned per event, not only in total
        assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)


def test_a_stop_cut_keeps_logprobs_aligned(pair: TinyPair, prompts: list[list[int]]) -> None:
    engine = _engine(pair, 8)
    free = _run(engine, prompts[:1], [SamplingParams(max_new_tokens=NEW)])[0]
    text = str(pair.tokenizer.decode(free[0]))
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string from the middle
    assert stop.strip()
    cut = _run(engine, prompts[:1], [SamplingParams(max_new_tokens=NEW, stop=(stop,), logprobs=0)])
    tokens, logprobs, events = cut[0]
    assert events[-1].finish_reason == "stop" and len(tokens) < NEW
    assert logprobs is not None and [lp.token_id for lp in logprobs] == tokens


@pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1])
def test_out_of_range_logprobs_are_refused(
    pair: TinyPair, prompts: list[list[int]], value: int
) -> None:
    engine = _engine(pair, 4)
    with pytest.raises(ValueError, match="logprobs must be in"):
        engine.add_request("bad", prompts[0], SamplingParams(logprobs=value))
