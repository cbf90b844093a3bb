"""Prefix reuse in the engine: what a slot still holds is not read again, and outputs stay the same.

Every test compares with an engine that reads every prompt in full
(``prefix_reuse=False``), on the tiny pair, where greedy output is exact.
"""

from __future__ import annotations

import pytest
import torch
from tools.tiny_models import TinyPair, build_pair

from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.budget import MIN_PREFILL_CHUNK
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.prefix_reuse import common_prefix_length
from specpair_runtime.engine.speculative import SpeculativeEngine, generate
from tests.support.tiny_engines import tiny_engine

NEW = 16
GREEDY = SamplingParams(max_new_tokens=NEW)
SYSTEM = "You are a support assistant for a shoe shop. Answer briefly and politely."
QUESTIONS = ["Where is my order", "How do I return shoes", "Do you ship abroad"]


@pytest.fixture(scope="module")
def pair() -> TinyPair:
    return build_pair("llama", seed=0)


@pytest.fixture(scope="module")
def prompts(pair: TinyPair) -> list[list[int]]:
    """Prompts that share a system prompt, then differ."""
    system = pair.tokenizer(SYSTEM)["input_ids"]
    return [system + pair.tokenizer(" " + q)["input_ids"] for q in QUESTIONS]


def _engine(
    pair: TinyPair,
    depth: int | None = 3,
    *,
    reuse: bool = True,
    max_slots: int = 4,
    max_step_tokens: int | None = None,
) -> SpeculativeEngine:
    options = EngineOptions(
        max_slots=max_slots, max_length=256, max_step_tokens=max_step_tokens, prefix_reuse=reuse
    )
    return tiny_engine(pair, depth, options)


@pytest.fixture(scope="module")
def full_reads(pair: TinyPair, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt read in full, target-only."""
    engine = _engine(pair, None, reuse=False)
    return [generate(engine, [p], GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("depth", [None, 1, 4, 8])
def test_a_prompt_sharing_a_finished_requests_prefix_skips_it_and_decodes_the_same(
    pair: TinyPair, prompts: list[list[int]], full_reads: list[list[int]], depth: int | None
) -> None:
    engine = _engine(pair, depth)
    held: list[int] = []  # what the previous request left in its slot
    for prompt, expected in zip(prompts, full_reads, strict=True):
        (result,) = generate(engine, [prompt], GREEDY)
        assert result.token_ids == expected
        shared = min(common_prefix_length(prompt, held), len(prompt) - 2)
        assert result.stats.cached_prompt_tokens == shared
        # The last committed token is never fed, so its KV is not in the slot.
        held = (prompt + result.token_ids)[:-1]
    assert shared >= len(pair.tokenizer(SYSTEM)["input_ids"])


def test_the_same_prompt_again_reads_only_its_last_two_tokens(
    pair: TinyPair, prompts: list[list[int]], full_reads: list[list[int]]
) -> None:
    engine = _engine(pair)
    first, again = (generate(engine, [prompts[1]], GREEDY)[0] for _ in range(2))
    assert first.token_ids == again.token_ids == full_reads[1]
    assert first.stats.cached_prompt_tokens == 0
    assert again.stats.cached_prompt_tokens == len(prompts[1]) - 2


@pytest.mark.parametrize("depth", [None, 3])
def test_a_seeded_request_repeated_samples_the_same_tokens(
    pair: TinyPair, prompts: list[list[int]], depth: int | None
) -> None:
    """The repeat reuses all but its last two prompt tokens and draws the same numbers."""
    sampled = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1234)
    engine = _engine(pair, depth)
    first, again = (generate(engine, [prompts[2]], sampled)[0] for _ in range(2))
    assert again.stats.cached_prompt_tokens == len(prompts[2]) - 2
    assert first.token_ids == again.token_ids


def test_the_first_event_with_output_reports_the_cached_tokens(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    engine = _engine(pair)
    generate(engine, [prompts[0]], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    reported: list[int] = []
    while engine.has_unfinished():
        reported += [e.cached_prompt_tokens for e in engine.step() if e.token_ids]
    assert reported[0] == common_prefix_length(prompts[0], prompts[1]) > 0
    assert not any(reported[1:])


def test_a_running_requests_prefix_is_copied_into_a_fresh_slot(
    pair: TinyPair, prompts: list[list[int]], full_reads: list[list[int]]
) -> None:
    engine = _engine(pair)
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[0], GREEDY)
    while not outputs.get("a"):  # "a" has its whole prompt in its slot
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    engine.add_request("b", prompts[1], GREEDY)  # no slot was ever freed: a copy
    while engine.has_unfinished():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    assert outputs == {"a": full_reads[0], "b": full_reads[1]}
    assert engine.stats("b").cached_prompt_tokens == common_prefix_length(prompts[0], prompts[1])


def test_a_chat_left_in_a_slot_outlives_a_request_that_shares_only_its_system_prompt(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    engine = _engine(pair)
    (first_turn,) = generate(engine, [prompts[0]], GREEDY)
    (other,) = generate(engine, [prompts[1]], GREEDY)  # a copy of the system prompt
    assert other.stats.cached_prompt_tokens == common_prefix_length(prompts[0], prompts[1])
    follow_up = prompts[0] + first_turn.token_ids + pair.tokenizer(" Thanks!")["input_ids"]
    (second_turn,) = generate(engine, [follow_up], GREEDY)
    # Everything but the first turn's last token (never fed) is still in its slot.
    assert second_turn.stats.cached_prompt_tokens == len(prompts[0]) + NEW - 1
    (reference,) = generate(_engine(pair, reuse=False), [follow_up], GREEDY)
    assert second_turn.token_ids == reference.token_ids


def test_with_reuse_off_every_prompt_is_read_in_full(
    pair: TinyPair, prompts: list[list[int]], full_reads: list[list[int]]
) -> None:
    engine = _engine(pair, reuse=False)
    results = [generate(engine, [p], GREEDY)[0] for p in [prompts[0], prompts[0], prompts[1]]]
    assert [r.token_ids for r in results] == [full_reads[0], full_reads[0], full_reads[1]]
    assert all(r.stats.cached_prompt_tokens == 0 for r in results)


def test_the_rest_of_a_reused_prompt_enters_in_chunks_beside_running_streams(
    pair: TinyPair, prompts: list[list[int]], full_reads: list[list[int]]
) -> None:
    long_prompt = prompts[2] + prompts[0] * 3
    other = pair.tokenizer("Thanks, that was quick")["input_ids"]  # shares nothing
    assert other[0] != long_prompt[0]
    references = generate(_engine(pair, None, reuse=False), [long_prompt, other], GREEDY)
    engine = _engine(pair, max_step_tokens=MIN_PREFILL_CHUNK)
    generate(engine, [prompts[2]], GREEDY)  # leaves the long prompt's start in a slot
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", other, GREEDY)
    while not outputs.get("a"):
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    engine.add_request("long", long_prompt, GREEDY)  # joins while "a" decodes
    while engine.has_unfinished():
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    assert outputs == {"a": references[1].token_ids, "long": references[0].token_ids}
    cached = engine.stats("long").cached_prompt_tokens
    assert cached == len(prompts[2])
    assert (len(long_prompt) - cached) // MIN_PREFILL_CHUNK >= 2  # the rest was chunked


def test_seeded_sampling_is_the_same_with_a_reused_prefix(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    sampled = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=11)

    def second_request(reuse: bool) -> tuple[list[int], int]:
        engine = _engine(pair, reuse=reuse)
        generate(engine, [prompts[0]], GREEDY)
        (result,) = generate(engine, [prompts[1]], sampled)
        return result.token_ids, result.stats.cached_prompt_tokens

    with_reuse, cached = second_request(True)
    without, _ = second_request(False)
    assert cached > 0 and with_reuse == without


def test_a_request_that_failed_leaves_nothing_to_reuse(prompts: list[list[int]]) -> None:
    """Its KV may hold the non-finite values that failed it."""
    broken = build_pair("llama", seed=0)
    poison = prompts[2][-1]
    assert all(poison not in p for p in prompts[:2])
    embeddings = broken.target.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)
    with torch.no_grad():
        embeddings.weight[poison] = float("nan")
    engine = _engine(broken, max_slots=1)
    (failed,) = generate(engine, [prompts[2]], GREEDY)
    assert failed.finish_reason == "error"
    (after,) = generate(engine, [prompts[0]], GREEDY)
    assert after.finish_reason == "length" and after.stats.cached_prompt_tokens == 0


def test_after_the_drafts_storage_is_freed_only_the_targets_share_is_reused(
    pair: TinyPair, prompts: list[list[int]], full_reads: list[list[int]]
) -> None:
    engine = _engine(pair)
    generate(engine, [prompts[0]], GREEDY)
    engine.set_speculation_paused("memory_pressure")  # frees the draft's storage
    engine.set_speculation_paused(None)
    (result,) = generate(engine, [prompts[1]], GREEDY)
    assert result.token_ids == full_reads[1]
    assert result.stats.cached_prompt_tokens == common_prefix_length(prompts[0], prompts[1])
    assert result.stats.drafted_tokens > 0  # the draft read the whole prompt and drafted


@pytest.mark.parametrize("depth", [None, 4])
def test_copies_of_a_prompt_sent_together_read_it_once(
    pair: TinyPair, prompts: list[list[int]], full_reads: list[list[int]], depth: int | None
) -> None:
    """n choices of one prompt: the first reads it, the others wait and copy its KV."""
    engine = _engine(pair, depth)
    results = generate(engine, [prompts[2]] * 3, GREEDY)
    assert [r.token_ids for r in results] == [full_reads[2]] * 3
    cached = sorted(r.stats.cached_prompt_tokens for r in results)
    assert cached == [0, len(prompts[2]) - 2, len(prompts[2]) - 2]
