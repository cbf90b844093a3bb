"""Structured outputs, penalties and logit bias keep greedy speculation lossless.

For each feature, greedy speculative output equals greedy target-only output
under the same constraint, token for token, on the tiny pair: every feature's
request in one batch beside a plain one at every depth from 1 to 8, and each
alone at two depths. Constrained JSON parses and validates against its schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
from tools.tiny_models import TinyPair, build_pair

from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.constraint_processors import processor_factories
from specpair_runtime.engine.grammar import GrammarCompiler, GrammarSpec
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.penalties import Penalties
from specpair_runtime.engine.speculative import GenerationResult, SpeculativeEngine, generate
from tests.support.tiny_engines import tiny_engine

NEW = 160
PROMPT = "My order has not arrived yet and the tracking page"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                "status": {"enum": ["shipped", "lost", "returned"]},
            },
            "required": ["id", "status"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 3,
        },
        "urgent": {"type": "boolean"},
    },
    "required": ["order", "items", "urgent"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Feature:
    name: str
    grammar: GrammarSpec | None = None
    penalties: Penalties = field(default_factory=Penalties)


FEATURES = [
    Feature("json_schema", GrammarSpec.json_schema(SCHEMA)),
    Feature("json_object", GrammarSpec.json_object()),
    Feature("choice", GrammarSpec.choice(["shipped on Monday", "lost", "returned to sender"])),
    Feature("regex", GrammarSpec.regex(r"[A-Z]{2}-[0-9]{4}( [a-z]{1,6}){1,3}\.")),
    Feature("penalties", penalties=Penalties.of(presence=0.8, frequency=0.5, repetition=1.3)),
    Feature("logit_bias", penalties=Penalties.of(logit_bias={40: 4.0, 41: 3.0, 100: -100.0})),
    Feature(
        "schema_and_penalties",
        GrammarSpec.json_schema(SCHEMA),
        Penalties.of(frequency=1.0, logit_bias={8: 2.0}),
    ),
]


@pytest.fixture(scope="module")
def pair() -> TinyPair:
    return build_pair("llama", seed=0)


@pytest.fixture(scope="module")
def compiler(pair: TinyPair) -> Iterator[GrammarCompiler]:
    tok = pair.tokenizer
    compiler = GrammarCompiler(tok, pair.target.config.vocab_size, [tok.eos_token_id])
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def prompt(pair: TinyPair) -> list[int]:
    return list(pair.tokenizer(PROMPT)["input_ids"])


def params(feature: Feature, compiler: GrammarCompiler, prompt: list[int]) -> SamplingParams:
    grammar = compiler.compile(feature.grammar) if feature.grammar is not None else None
    return SamplingParams(
        max_new_tokens=NEW,
        logits_processors=processor_factories(grammar, feature.penalties, prompt),
    )


def engine(pair: TinyPair, depth: int | None, slots: int = 8) -> SpeculativeEngine:
    return tiny_engine(pair, depth, EngineOptions(max_slots=slots, max_length=256))


@pytest.fixture(scope="module")
def target_only(
    pair: TinyPair, compiler: GrammarCompiler, prompt: list[int]
) -> dict[str, GenerationResult]:
    plain = engine(pair, None)
    return {f.name: generate(plain, [prompt], params(f, compiler, prompt))[0] for f in FEATURES}


def test_the_constraints_hold_and_change_the_output(
    pair: TinyPair, prompt: list[int], target_only: dict[str, GenerationResult]
) -> None:
    (free,) = generate(engine(pair, None), [prompt], SamplingParams(max_new_tokens=NEW))
    for name, result in target_only.items():
        assert result.token_ids != free.token_ids, name
    for name in ("json_schema", "schema_and_penalties"):
        assert target_only[name].finish_reason == "stop", name
        jsonschema.validate(json.loads(target_only[name].text), SCHEMA)
    # Free-form JSON may not end within the budget (a random model's strings run on).
    assert target_only["json_object"].text.startswith("{")
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}( [a-z]{1,6}){1,3}\.", target_only["regex"].text)
    assert target_only["choice"].text in ("shipped on Monday", "lost", "returned to sender")
    assert 100 not in target_only["logit_bias"].token_ids


@pytest.mark.parametrize("depth", [3, 7])
def test_greedy_speculation_equals_target_only_under_each_feature_alone(
    pair: TinyPair,
    compiler: GrammarCompiler,
    prompt: list[int],
    target_only: dict[str, GenerationResult],
    depth: int,
) -> None:
    speculative = engine(pair, depth)
    drafted = 0
    for feature in FEATURES:
        (result,) = generate(speculative, [prompt], params(feature, compiler, prompt))
        assert result.token_ids == target_only[feature.name].token_ids, feature.name
        drafted += result.stats.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("depth", range(1, 9))
def test_every_feature_in_one_batch_beside_a_plain_request(
    pair: TinyPair,
    compiler: GrammarCompiler,
    prompt: list[int],
    target_only: dict[str, GenerationResult],
    depth: int,
) -> None:
    (free,) = generate(engine(pair, None), [prompt], SamplingParams(max_new_tokens=NEW))
    batch = [params(f, compiler, prompt) for f in FEATURES] + [SamplingParams(max_new_tokens=NEW)]
    results = generate(engine(pair, depth), [prompt] * len(batch), batch)
    for feature, result in zip(FEATURES, results, strict=False):
        assert result.token_ids == target_only[feature.name].token_ids, feature.name
    assert results[-1].token_ids == free.token_ids
