"""Engine behaviour: continuous batching, live knobs, pauses, floor, stops, stats."""

from __future__ import annotations

import pytest
import torch
from tools.tiny_models import TinyPair, as_loaded, build_llama, build_pair

from specpair_runtime.config import DRAFT_CONFIDENCE, PrefillOrder, SpeculationKnobs
from specpair_runtime.engine import drafter
from specpair_runtime.engine.api import SamplingParams, StepEvent
from specpair_runtime.engine.budget import MIN_PREFILL_CHUNK, PREFILL_AGING
from specpair_runtime.engine.cost_model import MIN_VERDICT_STEPS
from specpair_runtime.engine.depth import PREFILL
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import GenerationResult, SpeculativeEngine, generate

NEW = 24
GREEDY = SamplingParams(max_new_tokens=NEW)
FIXED = SpeculationKnobs(max_depth=3, min_depth=3, adaptive=False)
# Speculating in steps that read a prompt chunk too, as on CUDA by default.
FIXED_DURING_PREFILL = FIXED.model_copy(update={"during_prefill": True})
# A draft-confidence threshold at which the tiny draft is sometimes sure, sometimes not.
CUTS_SOME = 0.4
TEXTS = ["Hello, how can I help", "My order has not", "The refund will", "one two three"]


@pytest.fixture(scope="module")
def pair() -> TinyPair:
    return build_pair("llama", seed=0)


@pytest.fixture(scope="module")
def prompts(pair: TinyPair) -> list[list[int]]:
    return [pair.tokenizer(t)["input_ids"] for t in TEXTS]


def _engine(
    pair: TinyPair, knobs: SpeculationKnobs = FIXED, draft: bool = True
) -> SpeculativeEngine:
    tok = pair.tokenizer
    return SpeculativeEngine(
        as_loaded(pair.target, tok, "target"),
        as_loaded(pair.draft, tok, "draft") if draft else None,
        knobs,
    )


@pytest.fixture(scope="module")
def alone(pair: TinyPair, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt decoded alone, target-only."""
    engine = _engine(pair, draft=False)
    return [generate(engine, [p], GREEDY)[0].token_ids for p in prompts]


def _drain(engine: SpeculativeEngine, outputs: dict[str, list[int]]) -> list[StepEvent]:
    events = engine.step()
    for event in events:
        outputs.setdefault(event.request_id, []).extend(event.token_ids)
    return events


def test_requests_joining_and_leaving_mid_decode_match_solo_runs(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    engine = _engine(pair)
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[0], GREEDY)
    _drain(engine, outputs)
    _drain(engine, outputs)
    engine.add_request("b", prompts[1], GREEDY)
    engine.add_request("doomed", prompts[3], GREEDY)
    _drain(engine, outputs)
    engine.add_request("c", prompts[2], SamplingParams(max_new_tokens=5))
    _drain(engine, outputs)
    engine.abort("doomed")
    engine.abort("unknown-id")  # ignored
    engine.add_request("d", prompts[3], GREEDY)
    while engine.has_unfinished():
        _drain(engine, outputs)
    assert outputs["a"] == alone[0]
    assert outputs["b"] == alone[1]
    assert outputs["c"] == alone[2][:5]
    assert outputs["d"] == alone[3]
    assert engine.stats("c").generated_tokens == 5
    assert engine.running == 0 and engine.waiting == 0


def test_events_carry_only_verified_tokens_and_consistent_stats(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    engine = _engine(pair)
    engine.add_request("r", prompts[0], GREEDY)
    tokens: list[int] = []
    texts: list[str] = []
    drafted = accepted = steps = 0
    while engine.has_unfinished():
        for event in engine.step():
            tokens.extend(event.token_ids)
            texts.append(event.text)
            drafted += event.drafted
            accepted += event.accepted
            steps += 1
            assert len(event.token_ids) <= event.accepted + 1
    stats = engine.stats("r")
    assert tokens == alone[0]
    assert "".join(texts) == pair.tokenizer.decode(tokens, skip_special_tokens=True)
    assert (stats.drafted_tokens, stats.accepted_tokens) == (drafted, accepted)
    assert stats.target_passes == steps
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
    assert stats.mean_accepted_length == pytest.approx(accepted / stats.speculation_steps + 1)
    assert stats.generated_tokens == NEW and stats.tokens_per_second > 0


def test_seeded_sampling_is_reproducible_regardless_of_companions(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    seeded = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.95, seed=42)
    (solo,) = generate(_engine(pair), [prompts[0]], seeded)
    others = [SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=i) for i in range(3)]
    crowd = generate(_engine(pair), prompts, [seeded, *others])
    assert crowd[0].token_ids == solo.token_ids
    again = generate(
        _engine(pair),
        [prompts[0]],
        SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.95, seed=43),
    )
    assert again[0].token_ids != solo.token_ids


def test_acceptance_floor_turns_speculation_off(prompts: list[list[int]]) -> None:
    bad = build_pair("llama", seed=0, independent_draft=True)
    baseline = generate(_engine(bad, draft=False), prompts, GREEDY)
    knobs = SpeculationKnobs(
        max_depth=3, min_depth=3, adaptive=False, acceptance_floor=0.5, acceptance_window=3
    )
    engine = _engine(bad, knobs)
    assert engine.speculation_active
    results = generate(engine, prompts, GREEDY)
    assert [r.token_ids for r in results] == [b.token_ids for b in baseline]
    assert not engine.speculation_active
    reason = engine.speculation_off_reason
    assert reason is not None and reason.startswith("acceptance_floor")
    assert all(r.stats.speculation_steps == 3 for r in results)  # the window, then off
    engine.update_knobs(knobs.model_copy(update={"acceptance_floor": 0.0}))
    assert engine.speculation_active  # new knobs re-evaluate the floor


def test_live_knobs_and_memory_pressure_pause_keep_outputs(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    engine = _engine(pair)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    _drain(engine, outputs)
    engine.set_speculation_paused("memory_pressure")
    assert not engine.speculation_active and not engine.draft_storage_allocated
    events = _drain(engine, outputs)
    assert all(e.drafted == 0 for e in events)
    engine.add_request("late", prompts[0], GREEDY)  # joins while the draft cache is gone
    _drain(engine, outputs)
    engine.set_speculation_paused(None)  # the draft is re-prefilled lazily
    events = _drain(engine, outputs)
    assert any(e.drafted > 0 for e in events)
    engine.update_knobs(SpeculationKnobs(enabled=False))
    assert engine.speculation_off_reason == "disabled by knobs"
    for _ in range(6):  # the draft falls behind; it catches up with one prefill later
        assert all(e.drafted == 0 for e in _drain(engine, outputs))
    engine.update_knobs(SpeculationKnobs(max_depth=5, min_depth=5, adaptive=False))
    while engine.has_unfinished():
        events = _drain(engine, outputs)
    for i in range(len(prompts)):
        assert outputs[str(i)] == alone[i]
    assert outputs["late"] == alone[0]
    assert engine.fallback_counts.get("memory_pressure", 0) >= 2


def test_stop_strings_end_the_output_before_the_stop(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    full = str(pair.tokenizer.decode(alone[0], skip_special_tokens=True))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    params = SamplingParams(max_new_tokens=NEW, stop=(stop,))
    (result,) = generate(_engine(pair), [prompts[0]], params)
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]
    assert result.token_ids == alone[0][: len(result.token_ids)]
    assert len(result.token_ids) < NEW


def test_eos_ends_a_request(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    eos_engine = _engine(pair)
    eos_engine.eos_ids = {alone[1][5]}  # pretend the 6th greedy token is an EOS
    (result,) = generate(eos_engine, [prompts[1]], GREEDY)
    first = alone[1].index(alone[1][5])
    assert result.token_ids == alone[1][: first + 1]
    assert result.finish_reason == "stop"


def test_bad_requests_name_the_field(pair: TinyPair, prompts: list[list[int]]) -> None:
    engine = _engine(pair)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request("x", [], GREEDY)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request("x", [10**9], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("x", prompts[0], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("x", prompts[0], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request("x", prompts[0], SamplingParams(max_new_tokens=0))
    engine.add_request("x", prompts[0], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", prompts[0], GREEDY)
    with pytest.raises(KeyError):
        engine.stats("nope")


def test_target_only_engine_reports_why(pair: TinyPair) -> None:
    engine = _engine(pair, draft=False)
    assert not engine.speculation_active
    assert engine.speculation_off_reason == "no draft model"
    refused = SpeculativeEngine(
        as_loaded(pair.target, pair.tokenizer, "t"),
        as_loaded(pair.draft, pair.tokenizer, "d"),
        FIXED,
        speculation_refused="chat template differs",
    )
    assert refused.speculation_off_reason == "chat template differs"


def test_greedy_rows_in_a_mixed_batch_stay_greedy(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    sampled = SamplingParams(max_new_tokens=NEW, temperature=1.2, top_k=20, seed=5)
    results = generate(_engine(pair), prompts[:3], [GREEDY, sampled, GREEDY])
    assert results[0].token_ids == alone[0]
    assert results[2].token_ids == alone[2]
    assert len(results[1].token_ids) == NEW


def test_vocab_padding_differs_between_target_and_draft(prompts: list[list[int]]) -> None:
    tok = build_pair("llama", seed=0).tokenizer
    target = build_llama(tok, seed=4, vocab_padding=24)  # logits wider than the tokenizer
    draft = build_llama(tok, seed=4)  # no padding: narrower logits ...
    rows = len(tok)  # ... but the target's weights, cut to the tokenizer's rows
    draft.load_state_dict({k: v[:rows] for k, v in target.state_dict().items()})
    baseline = generate(
        SpeculativeEngine(as_loaded(target, tok, "t"), None, FIXED), prompts, GREEDY
    )
    engine = SpeculativeEngine(as_loaded(target, tok, "t"), as_loaded(draft, tok, "d"), FIXED)
    results = generate(engine, prompts, GREEDY)
    assert [r.token_ids for r in results] == [b.token_ids for b in baseline]
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_chunked_prefill_under_a_tiny_budget_keeps_outputs(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    long_prompt = prompts[0] * 6  # several chunks at a budget of 3 tokens per step
    (reference,) = generate(_engine(pair, draft=False), [long_prompt], GREEDY)
    tok = pair.tokenizer
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "target"),
        as_loaded(pair.draft, tok, "draft"),
        FIXED,
        options=EngineOptions(max_slots=4, max_length=256, max_step_tokens=3),
    )
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[1], GREEDY)
    while not outputs.get("a"):
        _drain(engine, outputs)
    engine.add_request("long", long_prompt, GREEDY)  # joins while "a" decodes
    steps_to_first = 0
    a_done = False
    while not outputs.get("long"):
        events = _drain(engine, outputs)
        steps_to_first += 1
        # The decoding stream gets tokens in every step while the prompt is chunked.
        assert a_done or any(e.request_id == "a" and e.token_ids for e in events)
        a_done = a_done or any(e.request_id == "a" and e.finished for e in events)
    while engine.has_unfinished():
        _drain(engine, outputs)
    assert steps_to_first >= len(long_prompt) // MIN_PREFILL_CHUNK  # really chunked
    assert outputs["a"] == alone[1]
    assert outputs["long"] == reference.token_ids


def test_temperatures_below_the_floor_decode_greedily(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    tiny = [SamplingParams(max_new_tokens=NEW, temperature=t) for t in (1e-38, 1e-30, 1e-6)]
    results = generate(_engine(pair), prompts[:3], tiny)
    assert [r.token_ids for r in results] == alone[:3]


def test_a_row_with_non_finite_probabilities_fails_alone(
    prompts: list[list[int]], alone: list[list[int]]
) -> None:
    """A poisoned embedding row makes one request's logits NaN; its batch-mates go on."""
    broken = build_pair("llama", seed=0)
    poison = prompts[3][0]
    assert all(poison not in p for p in prompts[:3])
    embeddings = broken.target.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)
    with torch.no_grad():
        embeddings.weight[poison] = float("nan")
    for params in (GREEDY, SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=1)):
        engine = _engine(broken)
        results = generate(engine, prompts, [GREEDY, GREEDY, GREEDY, params])
        assert [r.token_ids for r in results[:3]] == alone[:3]
        assert results[3].finish_reason == "error" and results[3].token_ids == []
        assert engine.running == 0


def test_requests_longer_than_the_storage_are_refused(pair: TinyPair) -> None:
    tok = pair.tokenizer
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "t"), None, FIXED, options=EngineOptions(max_length=16)
    )
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request("x", [5] * 10, SamplingParams(max_new_tokens=7))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("x", [5], SamplingParams(temperature=float("nan")))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("x", [5], SamplingParams(temperature=float("inf")))


def _chunking_engine(pair: TinyPair, knobs: SpeculationKnobs) -> SpeculativeEngine:
    """A budget of a few tokens, so a long prompt enters over several steps."""
    tok = pair.tokenizer
    return SpeculativeEngine(
        as_loaded(pair.target, tok, "target"),
        as_loaded(pair.draft, tok, "draft"),
        knobs,
        options=EngineOptions(max_slots=4, max_length=512, max_step_tokens=MIN_PREFILL_CHUNK + 4),
    )


def test_speculation_goes_on_while_a_prompt_is_prefilled_in_chunks(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    # The depth rule's timings come only from steps without prompt chunks. Its
    # target-only probe must wait for such a step: asked for in every step with
    # a chunk, it was never timed, so it was asked for again, and speculation
    # stopped for as long as prompts kept arriving.
    # duringPrefill on, as on CUDA by default (on the CPU such steps do not speculate).
    knobs = SpeculationKnobs(max_depth=3, acceptance_floor=0.0, during_prefill=True)
    engine = _chunking_engine(pair, knobs)
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[1], SamplingParams(max_new_tokens=200))
    while not outputs.get("a"):
        _drain(engine, outputs)
    while engine.controller.cost.speculation_samples < MIN_VERDICT_STEPS:
        _drain(engine, outputs)  # a verdict is due: its t_v(1) is now wanted
    engine.add_request("long", prompts[0] * 12, GREEDY)
    depths: list[int] = []
    while not outputs.get("long"):
        _drain(engine, outputs)
        depths.append(engine.last_step_depth)
    assert len(depths) >= 4  # really chunked
    assert engine.fallback_counts.get("probe", 0) == 0
    assert all(depth > 0 for depth in depths)
    _drain(engine, outputs)  # both decode, no chunk: the probe runs now
    assert engine.fallback_counts.get("probe", 0) == 1


def test_on_the_cpu_a_step_that_reads_a_prompt_does_not_speculate(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    """``duringPrefill`` unset on the CPU: while a prompt enters in chunks, the
    decoding row takes one token per step, its draft and the prompt's keep
    reading, and both rows draft from the first step after the prompt."""
    long_prompt = prompts[0] * 12
    (reference,) = generate(_engine(pair, draft=False), [long_prompt], GREEDY)
    engine = _chunking_engine(pair, FIXED)
    assert engine.device.type == "cpu" and FIXED.during_prefill is None
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[1], GREEDY)
    while not outputs.get("a"):
        _drain(engine, outputs)
    _drain(engine, outputs)
    assert engine.last_step_depth == FIXED.max_depth  # alone, it speculates
    engine.add_request("long", long_prompt, GREEDY)
    chunk_steps = 0
    while not outputs.get("long"):
        before = engine.fallback_counts.get(PREFILL, 0)
        events = _drain(engine, outputs)
        if engine.fallback_counts.get(PREFILL, 0) > before:
            chunk_steps += 1
            assert [e.request_id for e in events if e.token_ids] in (["a"], ["a", "long"])
            assert all(e.drafted == 0 for e in events)
    assert chunk_steps >= 4  # really chunked, and plain
    if engine.last_step_depth == 0:  # the last chunk sampled long's first token
        events = _drain(engine, outputs)
    # Else the prompt's last token was read as a decoding row's, in a step without a
    # chunk. Either way the first such step drafts for both: no draft fell behind.
    assert {e.request_id: e.drafted > 0 for e in events} == {"a": True, "long": True}
    while engine.has_unfinished():
        _drain(engine, outputs)
    assert outputs["a"] == alone[1]
    assert outputs["long"] == reference.token_ids


def test_a_requests_last_token_is_the_targets_alone_and_times_target_only(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    # With one token left a request drafts nothing, so its draft is not fed either,
    # and the step is a target-only step like a probe's: the depth rule takes its
    # time, and needs no probe of its own.
    engine = _engine(pair, SpeculationKnobs(max_depth=3, acceptance_floor=0.0))
    assert engine.draft is not None
    draft_forward = engine.draft.forward
    fed: list[int] = []

    def counting_forward(rows, input_ids, sample_index, **kwargs):  # type: ignore[no-untyped-def]
        fed.append(int(input_ids.numel()))
        return draft_forward(rows, input_ids, sample_index, **kwargs)

    engine.draft.forward = counting_forward  # type: ignore[method-assign]
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[1], SamplingParams(max_new_tokens=2))
    _drain(engine, outputs)  # the prompt (the draft's up to its last token); the first token
    assert fed == [len(prompts[1]) - 1] and len(outputs["a"]) == 1
    _drain(engine, outputs)  # the last token: the target alone
    assert fed == [len(prompts[1]) - 1] and outputs["a"] == alone[1][:2]
    assert not engine.has_unfinished()
    assert engine.last_step_depth == 0
    assert 1 in engine.controller.cost.target_only_seconds
    assert engine.fallback_counts.get("probe", 0) == 0


def test_every_step_reports_its_time_and_what_it_carried(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """``last_step`` feeds the server's ``specpair_step_seconds{kind}``."""
    engine = _chunking_engine(pair, FIXED)
    assert engine.step() == [] and engine.last_step is None  # nothing ran
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[1], SamplingParams(max_new_tokens=40))
    kinds: list[str] = []
    while not outputs.get("a"):
        _drain(engine, outputs)
        assert engine.last_step is not None
        kinds.append(engine.last_step.kind)
    assert set(kinds) == {"prefill"}  # nobody decodes yet
    _drain(engine, outputs)
    assert engine.last_step is not None and engine.last_step.kind == "decode"
    engine.add_request("long", prompts[0] * 12, GREEDY)
    while not outputs.get("long"):
        _drain(engine, outputs)
        assert engine.last_step is not None and engine.last_step.seconds > 0
        kinds.append(engine.last_step.kind)
    assert kinds.count("mixed") >= 4  # "long" entered in chunks beside a's decoding
    while engine.has_unfinished():
        _drain(engine, outputs)
    assert engine.step() == [] and engine.last_step is None


def test_a_step_in_which_a_lagging_draft_catches_up_is_not_a_decode_step(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """The draft reads the tokens of target-only steps before it drafts again.

    That step costs more than a decode step, so neither the budget's pure
    reference nor ``specpair_step_seconds{kind="decode"}`` may take it.
    """
    engine = _chunking_engine(pair, FIXED)
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[1], SamplingParams(max_new_tokens=40))
    _drain(engine, outputs)
    _drain(engine, outputs)
    kinds = [_last_kind(engine)]
    engine.update_knobs(SpeculationKnobs(enabled=False))
    for _ in range(6):  # target-only steps: the draft falls 6 tokens behind
        _drain(engine, outputs)
    engine.update_knobs(FIXED)
    events = _drain(engine, outputs)  # within the budget: it reads them and drafts
    assert events and events[0].drafted > 0
    kinds.append(_last_kind(engine))
    _drain(engine, outputs)
    kinds.append(_last_kind(engine))
    assert kinds == ["decode", "mixed", "decode"]


def _events_of(engine: SpeculativeEngine, outputs: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each request's ``drafted`` count per event, until every request finished."""
    drafted: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for event in _drain(engine, outputs):
            drafted.setdefault(event.request_id, []).append(event.drafted)
    return drafted


def test_the_draft_keeps_pace_with_a_prefill_beside_busy_decodes(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """Four decoding rows use up a 12-token budget; the prompt still enters at the
    floor of 8 tokens a step, and the draft must read as many, so that the new
    row drafts from its first decode step on (it fell 2 tokens a step behind)."""
    engine = _chunking_engine(pair, FIXED_DURING_PREFILL)
    outputs: dict[str, list[int]] = {}
    for i in range(4):
        engine.add_request(f"busy{i}", prompts[i % len(prompts)], SamplingParams(max_new_tokens=60))
    while not all(outputs.get(f"busy{i}") for i in range(4)):
        _drain(engine, outputs)
    engine.add_request("long", prompts[0] * 12, SamplingParams(max_new_tokens=8))
    drafted = _events_of(engine, outputs)["long"]
    assert drafted[0] == 0  # the first token comes from the prompt's last chunk
    assert drafted[1] > 0, drafted


def test_with_no_row_decoding_the_draft_prefills_beside_the_target(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """Nobody waits on such a step: both models take the ceiling, and every row
    drafts from its first decode step on."""
    engine = _chunking_engine(pair, FIXED)
    outputs: dict[str, list[int]] = {}
    for i in range(3):
        engine.add_request(f"r{i}", prompts[i] * 4, SamplingParams(max_new_tokens=8))
    drafted = _events_of(engine, outputs)
    assert all(counts[0] == 0 and counts[1] > 0 for counts in drafted.values()), drafted


def test_a_measured_budget_probes_its_first_mixed_step_with_the_floor(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """Beside decoding rows the first prompt chunk is the floor, not the start
    budget's guess; later chunks follow what that step measured."""
    engine = _engine(pair, FIXED_DURING_PREFILL)  # no maxStepTokens: the budget is measured
    outputs: dict[str, list[int]] = {}
    for i in range(2):
        engine.add_request(f"busy{i}", prompts[i], SamplingParams(max_new_tokens=60))
    while not all(outputs.get(f"busy{i}") for i in range(2)):
        _drain(engine, outputs)
    _drain(engine, outputs)  # a pure decode step: the reference
    start = engine.step_tokens
    engine.add_request("long", prompts[0] * 12, GREEDY)
    _drain(engine, outputs)
    assert _last_kind(engine) == "mixed"
    assert [tokens for tokens, _ in engine.budget.extra] == [MIN_PREFILL_CHUNK]
    assert start - 2 * (1 + FIXED.max_depth) > MIN_PREFILL_CHUNK  # the guess left more


@pytest.mark.parametrize("order", ["shortest-first", "arrival"])
def test_a_short_prompt_is_not_kept_waiting_behind_a_long_one(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]], order: PrefillOrder
) -> None:
    """Shortest remaining prompt first: the short one, admitted a step after the
    long one, gets its first token while the long one is still being read
    (``arrival``: only after it); every output stays what it is alone."""
    tok = pair.tokenizer
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "target"),
        as_loaded(pair.draft, tok, "draft"),
        FIXED,
        options=EngineOptions(
            max_slots=4,
            max_length=512,
            max_step_tokens=MIN_PREFILL_CHUNK + 4,
            prefill_order=order,
        ),
    )
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[1], GREEDY)
    while not outputs.get("a"):
        _drain(engine, outputs)
    long_prompt = prompts[0] * 12
    assert len(long_prompt) > 4 * MIN_PREFILL_CHUNK
    engine.add_request("long", long_prompt, GREEDY)
    _drain(engine, outputs)
    engine.add_request("short", prompts[2], GREEDY)
    while not outputs.get("short"):
        _drain(engine, outputs)
    assert bool(outputs.get("long")) is (order == "arrival")
    while engine.has_unfinished():
        _drain(engine, outputs)
    (long_alone,) = generate(_engine(pair, draft=False), [long_prompt], GREEDY)
    assert outputs["a"] == alone[1] and outputs["short"] == alone[2]
    assert outputs["long"] == long_alone.token_ids


def test_short_prompts_arriving_every_step_pass_a_long_one_only_for_a_while(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """Aging: a new short prompt every step would starve a long one forever under
    shortest-first alone; with aging the long one starts within (its tokens /
    PREFILL_AGING) steps, then reads a chunk every step."""
    tok = pair.tokenizer
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "target"),
        as_loaded(pair.draft, tok, "draft"),
        FIXED,
        # One chunk a step: the decoding row leaves less than the floor.
        options=EngineOptions(max_slots=64, max_length=512, max_step_tokens=MIN_PREFILL_CHUNK),
    )
    outputs: dict[str, list[int]] = {}
    engine.add_request("a", prompts[1], SamplingParams(max_new_tokens=400))
    while not outputs.get("a"):
        _drain(engine, outputs)
    long_prompt = prompts[0] * 12
    engine.add_request("long", long_prompt, SamplingParams(max_new_tokens=2))
    wait = len(long_prompt) // PREFILL_AGING
    chunks = -(-len(long_prompt) // MIN_PREFILL_CHUNK)
    steps = 0
    while not outputs.get("long") and steps < 2 * (wait + chunks):
        engine.add_request(f"short{steps}", prompts[3], SamplingParams(max_new_tokens=1))
        _drain(engine, outputs)
        steps += 1
    assert outputs.get("long"), f"starved for {steps} steps"
    assert steps <= wait + chunks + 1  # passed for at most its aging bound, then read on
    assert steps > chunks  # the short ones did go first for a while


def _last_kind(engine: SpeculativeEngine) -> str:
    assert engine.last_step is not None
    return engine.last_step.kind


def _confidence_engine(pair: TinyPair, threshold: float) -> SpeculativeEngine:
    return _engine(
        pair, SpeculationKnobs(max_depth=3, min_depth=3, adaptive=False, draft_confidence=threshold)
    )


def _drafts_per_step(results: list[GenerationResult]) -> float:
    drafted = sum(r.stats.drafted_tokens for r in results)
    return drafted / sum(r.stats.speculation_steps for r in results)


@pytest.mark.parametrize("threshold", [0.0, CUTS_SOME, 1.0])
def test_the_draft_confidence_stop_keeps_greedy_output(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]], threshold: float
) -> None:
    results = generate(_confidence_engine(pair, threshold), prompts, GREEDY)
    assert [r.token_ids for r in results] == alone
    per_step = _drafts_per_step(results)
    if threshold == 0.0:  # never stops: every step drafts the depth (but near the end)
        assert per_step > 2.5
    elif threshold == 1.0:  # a tiny model is never sure: every row stops after one token
        assert per_step == 1.0
    else:  # rows of one batch stop at different positions
        assert 1.0 < per_step < 2.5


def test_the_stop_reads_the_product_of_the_drafts_probabilities(
    pair: TinyPair,
    prompts: list[list[int]],
    alone: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A token pays only if every draft before it is accepted: the stop reads the product.

    With every drafted token at probability 0.8 and a threshold of 0.6, each
    token alone is sure, but the product falls to 0.512 at the third: rows
    draft 3 tokens (of depth 6) and stop there; the single token's probability
    would never stop them.
    """

    def sure_at(logits: torch.Tensor, tokens: torch.Tensor, *_: object) -> torch.Tensor:
        return torch.full(tokens.shape, 0.8)

    monkeypatch.setattr(drafter, "draft_confidence", sure_at)
    knobs = SpeculationKnobs(max_depth=6, min_depth=6, adaptive=False, draft_confidence=0.6)
    results = generate(_engine(pair, knobs), prompts, GREEDY)
    assert [r.token_ids for r in results] == alone
    for result in results:  # 3 drafts a step, fewer only near max_new_tokens
        assert result.stats.drafted_tokens <= 3 * result.stats.speculation_steps
    assert _drafts_per_step(results) > 2.5


def test_the_stop_is_off_unless_set(
    pair: TinyPair, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    """Unset, no row stops early; a set threshold stays fixed while the engine runs."""
    engine = _engine(pair, SpeculationKnobs())
    (result,) = generate(engine, prompts[:1], GREEDY)
    assert result.token_ids == alone[0]
    assert engine.confidence_threshold() == DRAFT_CONFIDENCE.default == 0.0
    fixed = _engine(pair, SpeculationKnobs(draft_confidence=0.3))
    generate(fixed, prompts[:1], GREEDY)
    assert fixed.confidence_threshold() == 0.3


def test_a_seeded_row_stops_drafting_where_it_would_alone(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """The stop reads a row's own draft distribution, so companions change nothing."""
    seeded = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=7)
    (solo,) = generate(_confidence_engine(pair, CUTS_SOME), [prompts[0]], seeded)
    others = [SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=i) for i in range(3)]
    crowd = generate(_confidence_engine(pair, CUTS_SOME), prompts, [seeded, *others])
    assert crowd[0].token_ids == solo.token_ids
    assert crowd[0].stats.drafted_tokens == solo.stats.drafted_tokens
    assert crowd[0].stats.accepted_per_position == solo.stats.accepted_per_position


def test_the_step_budget_times_steps_at_the_depth_really_drafted(
    pair: TinyPair, prompts: list[list[int]]
) -> None:
    """A step the confidence stop cut to one draft is a depth-1 step for the budget."""
    engine = _confidence_engine(pair, 1.0)  # a tiny draft is never sure: one draft per row
    generate(engine, prompts[:2], GREEDY)
    depths = {depth for _, depth in engine.budget.pure}
    assert depths == {1}
