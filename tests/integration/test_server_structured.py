"""Structured outputs, tools, n, penalties and prompt shapes through the ``openai`` SDK.

A real ``specpair-runtime serve`` process over the tiny pair whose tokenizer
has Qwen2.5's tool format (``tools/tiny_models.build_tool_tokenizer``). The
models are random, so the grammar alone makes the JSON valid: every output
below is checked for what the constraint promises.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tools.tiny_models import build_tool_tokenizer, save_pair
from transformers import PreTrainedTokenizerFast

from tests.support.server_harness import subprocess_server, wait_until_ready, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 10},
                "tier": {"enum": ["gold", "silver", "bronze"]},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "status": {"enum": ["open", "shipped", "lost"]},
                },
                "required": ["id", "status"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "refund": {"type": "boolean"},
    },
    "required": ["customer", "orders", "refund"],
    "additionalProperties": False,
}

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("structured")
    target, draft = save_pair(root / "pair", tokenizer=build_tool_tokenizer())
    config = write_config(
        root / "config.yaml",
        target,
        draft,
        speculation={"maxDepth": 4, "minDepth": 4},
        serving={"maxBatchSize": 16},
    )
    with subprocess_server(config, root / "server.log") as server:
        assert wait_until_ready(server.base_url)["ready"], server.log()
        with openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300
        ) as sdk:
            yield sdk


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "case", "schema": SCHEMA,
                                                        "strict": True}}  # fmt: skip


def test_fifty_sampled_completions_validate_against_the_schema(client: Any) -> None:
    texts: list[str] = []
    for seed in range(3):  # 3 requests of 9 choices, sampled
        reply = client.chat.completions.create(
            model=MODEL, messages=user("Summarise the case."), response_format=SCHEMA_FORMAT,
            temperature=1.0, n=9, seed=seed, max_completion_tokens=300,
        )  # fmt: skip
        assert [c.index for c in reply.choices] == list(range(9))
        assert all(c.finish_reason == "stop" for c in reply.choices)
        texts += [c.message.content or "" for c in reply.choices]
    for seed in range(3):  # and 3 streamed ones of 8
        pieces: dict[int, str] = {}
        finishes: dict[int, str | None] = {}
        for chunk in client.chat.completions.create(
            model=MODEL, messages=user("Summarise the case."), response_format=SCHEMA_FORMAT,
            temperature=1.0, n=8, seed=100 + seed, max_completion_tokens=300, stream=True,
        ):  # fmt: skip
            for choice in chunk.choices:
                pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
                finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        assert sorted(pieces) == list(range(8)) and set(finishes.values()) == {"stop"}
        texts += list(pieces.values())
    assert len(texts) == 51
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10  # sampled, not one output repeated


class Customer(BaseModel):
    name: Annotated[str, Field(max_length=10)]
    tier: Literal["gold", "silver", "bronze"]


class Case(BaseModel):
    customer: Customer
    tags: Annotated[list[Annotated[str, Field(max_length=6)]], Field(max_length=3)]
    refund: bool


def test_the_sdks_parse_fills_a_pydantic_model(client: Any) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=user("Summarise the case."), response_format=Case,
        temperature=0, max_completion_tokens=300,
    )  # fmt: skip
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Case)
    assert parsed.customer.tier in ("gold", "silver", "bronze")


def test_a_tool_calling_loop(client: Any) -> None:
    messages: list[Any] = user("What is the weather in Paris?")
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
        temperature=0, max_completion_tokens=200, parallel_tool_calls=False,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    # The result goes back in a tool turn; the model answers in text.
    # As agent loops do: the SDK's own message object goes back into the conversation.
    messages += [
        choice.message,
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="none",
        temperature=0, max_completion_tokens=12,
    )  # fmt: skip
    final = answer.choices[0]
    assert final.message.tool_calls is None and final.message.content
    assert final.finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens


class GetWeather(BaseModel):
    city: Annotated[str, Field(max_length=12)]
    unit: Literal["celsius", "fahrenheit"]


def test_the_sdks_parse_fills_a_pydantic_tools_arguments(client: Any) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=user("Weather in Oslo?"),
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        temperature=0, max_completion_tokens=200,
    )  # fmt: skip
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_a_named_tool_streams_as_openai_streams_calls(client: Any) -> None:
    fields: dict[str, Any] = dict(
        model=MODEL, messages=user("Weather?"), tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_completion_tokens=200,
    )  # fmt: skip
    whole = client.chat.completions.create(**fields)
    (call,) = whole.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    heads, arguments, finish = [], "", None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                if delta.id is not None:
                    heads.append((delta.id, delta.type, delta.function and delta.function.name))
                arguments += (delta.function and delta.function.arguments) or ""
            finish = choice.finish_reason or finish
    assert len(heads) == 1 and heads[0][1:] == ("function", "get_weather")
    assert arguments == call.function.arguments  # the same call, in pieces
    assert finish == "tool_calls"


def test_vllm_constraint_fields_and_completions(client: Any) -> None:
    choices = ["refund approved", "refund denied", "escalate"]
    reply = client.chat.completions.create(
        model=MODEL, messages=user("Decide."), temperature=0, max_completion_tokens=20,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert reply.choices[0].message.content in choices
    completion = client.completions.create(
        model=MODEL, prompt="Order number:", temperature=1.0, max_tokens=20, n=4, seed=3,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{5}"}},
    )  # fmt: skip

    assert all(re.fullmatch("[A-Z]{2}-[0-9]{5}", c.text) for c in completion.choices)
    obj = client.completions.create(
        model=MODEL, prompt="JSON:", temperature=0, max_tokens=40,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert obj.choices[0].text.startswith("{")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tool_tokenizer()  # the server's, built the same way


def test_logit_bias_forces_and_bans_tokens(client: Any, tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = "Hello, how can I"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    the = tokenizer(" the", add_special_tokens=False).input_ids
    assert len(the) == 1
    forced = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logit_bias={str(the[0]): 100}
    )
    assert forced.choices[0].text == " the" * 4
    first = tokenizer(plain.choices[0].text, add_special_tokens=False).input_ids[0]
    banned = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != plain.choices[0].text
    assert tokenizer(banned.choices[0].text, add_special_tokens=False).input_ids[0] != first


def test_prompt_lists_token_ids_n_and_echo(client: Any, tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = "Hello, how can I"
    ids = tokenizer(prompt).input_ids
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    other = "My order has not"
    many = client.completions.create(
        model=MODEL, prompt=[prompt, other], n=2, max_tokens=5, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices[:2]] == [by_text.choices[0].text] * 2
    assert many.usage is not None and by_text.usage is not None
    single_other = client.completions.create(model=MODEL, prompt=other, max_tokens=5, temperature=0)
    assert many.choices[3].text == single_other.choices[0].text
    assert (
        many.usage.prompt_tokens == by_text.usage.prompt_tokens + single_other.usage.prompt_tokens
    )
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + by_text.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == tokenizer.decode(ids) + by_text.choices[0].text


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema", "strin"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "unclosed group"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                    "function": {"name": "get_news"}}},
         "tool_choice.function.name", "not one of the tools"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"n": 40, "extra_body": {}}, "n", "less than or equal"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_gets_a_400_naming_the_field(
    client: Any, fields: dict[str, Any], param: str, fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=user("Hi"), max_completion_tokens=4, **fields
        )
    assert error.value.param == param
    assert fragment in str(error.value)


def test_echo_with_logprobs_is_refused(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, echo=True, logprobs=1)
    assert error.value.param == "echo"
