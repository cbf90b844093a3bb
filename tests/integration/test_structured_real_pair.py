"""Structured outputs, forced tool calls and penalties on the real Qwen2.5-Coder pair.

Greedy speculative output equals greedy target-only output under the same
grammar and penalties, token for token, on the CPU (where the kernels make
that exact): a JSON schema at every depth from 1 to 8, a forced tool call in
Qwen's own format and penalised sampling at depth 4, and all of them in one
batch. The real models write natural JSON, so the acceptance rate under a
grammar is measured too (it must stay above zero: the draft's proposals are
masked alike).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from specpair_runtime.config import ModelSpec, SpeculationKnobs, recommended_draft_quantization
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.constraint_processors import processor_factories
from specpair_runtime.engine.grammar import GrammarCompiler, GrammarSpec
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.pair import LoadedPair, load_pair
from specpair_runtime.engine.penalties import Penalties
from specpair_runtime.engine.speculative import GenerationResult, SpeculativeEngine, generate
from specpair_runtime.server.chat_render import TemplateMessage, encode_conversation
from specpair_runtime.server.tool_calls import parse
from specpair_runtime.server.tools import Tool, plan_tools
from tests.support.real_models import require_real_pair

pytestmark = [pytest.mark.slow]

NEW = 24
OPTIONS = EngineOptions(max_slots=4, max_length=512, max_step_tokens=128)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "function_name": {"type": "string"},
        "arguments": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "type": {"enum": ["int", "str"]}},
                "required": ["name", "type"],
            },
        },
        "pure": {"type": "boolean"},
    },
    "required": ["function_name", "arguments", "pure"],
}
ASK = "Describe a Python function that adds two integers, as JSON."
WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
)


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
def compiler(pair: LoadedPair) -> Iterator[GrammarCompiler]:
    engine = pair.engine(speculate=False)
    compiler = GrammarCompiler(pair.target.tokenizer, engine.target.vocab, engine.eos_ids)
    yield compiler
    compiler.close()


def chat(pair: LoadedPair, text: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
    return encode_conversation(pair.target.tokenizer, [TemplateMessage("user", text)], tools)


@pytest.fixture(scope="module")
def requests(
    pair: LoadedPair, compiler: GrammarCompiler
) -> dict[str, tuple[list[int], SamplingParams]]:
    """Each feature's prompt and greedy params."""
    # One call: with parallel calls allowed, the 1.5B model asks again for the other unit.
    plan = plan_tools([WEATHER], "required", False, pair.target.tokenizer)
    assert plan.lark is not None
    json_prompt = chat(pair, ASK)
    tool_prompt = chat(pair, "What is the weather in Paris?", plan.render)
    penalised = chat(pair, "List five fruits, one per line.")
    json_grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    tool_grammar = compiler.compile(GrammarSpec.lark(plan.lark))
    penalties = Penalties.of(presence=0.5, frequency=0.5, repetition=1.2, logit_bias={11: -5.0})

    def params(prompt: list[int], grammar: Any, pen: Penalties, new: int = NEW) -> SamplingParams:
        factories = processor_factories(grammar, pen, prompt)
        return SamplingParams(max_new_tokens=new, logits_processors=factories)

    return {
        "json_schema": (json_prompt, params(json_prompt, json_grammar, Penalties())),
        "tool_call": (tool_prompt, params(tool_prompt, tool_grammar, Penalties(), 48)),
        "penalties": (penalised, params(penalised, None, penalties)),
    }


def engine(pair: LoadedPair, depth: int | None) -> SpeculativeEngine:
    if depth is None:
        return pair.engine(speculate=False)
    knobs = SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False)
    return pair.engine(knobs=knobs)


@pytest.fixture(scope="module")
def target_only(
    pair: LoadedPair, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, GenerationResult]:
    plain = engine(pair, None)
    return {name: generate(plain, [p], params)[0] for name, (p, params) in requests.items()}


def test_the_outputs_follow_their_constraints(target_only: dict[str, GenerationResult]) -> None:
    tool = target_only["tool_call"]
    content, calls = parse(tool.text)
    assert content is None and [c.name for c in calls] == ["get_weather"], tool.text
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, WEATHER.function.parameters or {})
    assert tool.finish_reason == "stop"
    text = target_only["json_schema"].text
    assert text.startswith("{"), text  # the schema's object, maybe cut by the length limit
    if target_only["json_schema"].finish_reason == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("depth", range(1, 9))
def test_a_schema_keeps_greedy_identity_at_every_depth(
    pair: LoadedPair,
    requests: dict[str, tuple[list[int], SamplingParams]],
    target_only: dict[str, GenerationResult],
    depth: int,
) -> None:
    prompt, params = requests["json_schema"]
    (result,) = generate(engine(pair, depth), [prompt], params)
    assert result.token_ids == target_only["json_schema"].token_ids
    assert result.stats.accepted_tokens > 0  # the masked draft still proposes what is taken


def test_every_feature_in_one_batch_keeps_greedy_identity(
    pair: LoadedPair,
    requests: dict[str, tuple[list[int], SamplingParams]],
    target_only: dict[str, GenerationResult],
) -> None:
    names = list(requests)
    results = generate(
        engine(pair, 4), [requests[n][0] for n in names], [requests[n][1] for n in names]
    )
    for name, result in zip(names, results, strict=True):
        assert result.token_ids == target_only[name].token_ids, name
