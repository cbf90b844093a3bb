"""Grammars, tools and tool-call parsing with the real Qwen2.5 tokenizer and chat template.

The tiny tokenizer has a few hundred tokens; the real one has 151,665 in a
logits width of 151,936, added tokens for the tool-call tags and Qwen's own
template. These check that what the unit tests show holds there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specpair_runtime.engine import token_bitmask
from specpair_runtime.engine.grammar import GrammarCompiler, GrammarSpec
from specpair_runtime.engine.grammar_state import GrammarState
from specpair_runtime.server.chat_render import TemplateMessage, encode_conversation
from specpair_runtime.server.tool_calls import parse
from specpair_runtime.server.tools import AssistantToolCall, Tool, plan_tools, template_tool_calls
from tests.support.real_models import require_real_pair

pytestmark = [pytest.mark.slow]

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
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = AutoTokenizer.from_pretrained(require_real_pair().target_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerFast) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, 151936, [151645, 151643])
    yield compiler
    compiler.close()


def takes(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast, spec: GrammarSpec,
          text: str) -> bool:  # fmt: skip
    state = GrammarState(compiler.compile(spec), compiler.vocab_size)
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    consumed = state.align(ids)
    if consumed < len(ids):
        return False
    state.commit(ids)
    return state.accepting


def test_a_forced_call_in_qwens_format(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    plan = plan_tools([WEATHER], "required", None, tokenizer)
    assert plan.lark is not None and "<tool_call>" in plan.lark
    call = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>"
    )
    assert tokenizer(call, add_special_tokens=False).input_ids[0] == 151657  # one token
    spec = GrammarSpec.lark(plan.lark)
    assert takes(compiler, tokenizer, spec, call)
    assert not takes(compiler, tokenizer, spec, call.replace("celsius", "kelvin"))
    decoded = str(tokenizer.decode(tokenizer(call).input_ids, skip_special_tokens=True))
    content, calls = parse(decoded)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]


def test_the_mask_covers_the_logits_width_and_ends_with_eos(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    state = GrammarState(compiler.compile(GrammarSpec.choice(["yes", "no"])), 151936)
    assert state.mask(0).numel() == token_bitmask.words(151936)
    state.commit(list(tokenizer("yes", add_special_tokens=False).input_ids))
    allowed = token_bitmask.allowed_tokens(state.mask(0), 151936).nonzero()[:, 0].tolist()
    assert allowed == [151643, 151645]


def test_a_tool_conversation_through_qwens_template(tokenizer: PreTrainedTokenizerFast) -> None:
    plan = plan_tools([WEATHER], None, None, tokenizer)
    call = AssistantToolCall.model_validate(
        {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    )
    ids = encode_conversation(
        tokenizer,
        [
            TemplateMessage("user", "Weather in Oslo?"),
            TemplateMessage("assistant", None, template_tool_calls([call], "tool_calls")),
            TemplateMessage("tool", '{"temperature": -3}', tool_call_id="call_1"),
        ],
        plan.render,
    )
    text = str(tokenizer.decode(ids))
    assert "# Tools" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in (
        text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temperature": -3}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
