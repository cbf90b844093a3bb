"""Golden-prompt checks over real engines on tiny in-memory models."""

from __future__ import annotations

import torch
from tools.tiny_models import build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.golden_check import first_difference, run_golden, run_golden_with
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.pair import LoadedPair, check_pair
from specpair_runtime.engine.speculative import SpeculativeEngine
from specpair_runtime.golden import GoldenFile, parse_golden

KNOBS = SpeculationKnobs(max_depth=3)


def loaded(model: torch.nn.Module, tokenizer: object, name: str) -> LoadedModel:
    return LoadedModel(model, tokenizer, torch.device("cpu"), torch.float32, name, name)


def tiny_pair(seed: int = 0) -> LoadedPair:
    tiny = build_pair("llama", seed)
    target = loaded(tiny.target, tiny.tokenizer, "target")
    draft = loaded(tiny.draft, tiny.tokenizer, "draft")
    return LoadedPair(target, draft, check_pair(target, draft), KNOBS)


def golden(expect: dict[str, object], chat: bool = False) -> GoldenFile:
    return parse_golden(
        {
            "prompts": [
                {"name": "p1", "prompt": "Hello, how can", "maxNewTokens": 10, "expect": expect},
                {"name": "p2", "prompt": "Where is my order?", "chat": chat, "maxNewTokens": 6},
            ]
        }
    )


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_golden_passes_when_speculation_matches_and_expectations_hold() -> None:
    pair = tiny_pair()
    first = run_golden(
        parse_golden({"prompts": [{"name": "p", "prompt": "Hello, how can", "maxNewTokens": 10}]}),
        pair,
    )
    text = first.results[0].text
    assert text, "the tiny target produced no text"
    report = run_golden(golden({"equals": text, "notContains": ["zzz"]}, chat=True), pair)
    assert report.passed, report.failures()
    assert [r.name for r in report.results] == ["p1", "p2"]
    assert all(r.token_ids == r.baseline_token_ids for r in report.results)
    assert report.results[0].drafted_tokens > 0


def test_golden_names_failed_expectations() -> None:
    report = run_golden(golden({"contains": ["refund-zzz"], "regex": "^\\d+$"}), tiny_pair())
    assert not report.passed
    assert report.failures() == [
        "p1: output does not contain 'refund-zzz'",
        "p1: output does not match regex '^\\\\d+$'",
    ]
    assert report.results[1].passed


def test_golden_catches_speculative_output_that_differs() -> None:
    # Two target-only engines over *different* targets stand in for a broken speculator.
    pair, other = tiny_pair(0), tiny_pair(7)
    report = run_golden_with(
        golden({}),
        pair.target.tokenizer,
        SpeculativeEngine(other.target, None, KNOBS),
        SpeculativeEngine(pair.target, None, KNOBS),
    )
    assert not report.passed
    failure = report.results[0].failures[0]
    assert failure.startswith("speculative output differs from target-only output at token ")


def test_golden_chat_prompt_without_template_fails_with_reason() -> None:
    pair = tiny_pair()
    pair.target.tokenizer.chat_template = None
    report = run_golden(golden({}, chat=True), pair)
    assert report.results[1].failures == [
        "the target tokenizer has no chat template, so a chat prompt cannot be encoded"
    ]
