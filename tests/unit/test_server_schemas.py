"""Request validation: 400 in the OpenAI error format, naming the field.

These checks happen before the models matter, so a server whose models never
load (readiness stays "loading") serves them without torch work.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from specpair_runtime.cli import build_parser
from specpair_runtime.config import RuntimeConfig, parse_runtime_config
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.server.app import create_app
from specpair_runtime.server.command import apply_overrides
from specpair_runtime.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from specpair_runtime.server.state import ServerState

CONFIG = parse_runtime_config(
    {
        "pair": {"name": "tiny", "version": "v1"},
        "target": {"source": "/nonexistent/t"},
        "draft": {"source": "/nonexistent/d"},
    }
)


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(ServerState(CONFIG))) as test_client:
        yield test_client


def error_of(client: TestClient, path: str, body: object) -> tuple[int, dict[str, object]]:
    response = client.post(path, json=body)
    payload = response.json()
    assert set(payload) == {"error"}
    error: dict[str, object] = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return response.status_code, error


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "greater than"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens", "integer"),
        ("/v1/completions", {"prompt": "hi", "temprature": 0.5}, "temprature", "unknown field"),
        ("/v1/completions", {"max_tokens": 3}, "prompt", "field required"),
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n", "less than or equal to 16"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
        ("/v1/completions", {"prompt": [[1], "x"]}, "prompt[1]", "expected an array"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "not a token"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias.5", "100"),
        (
            "/v1/completions",
            {"prompt": "hi", "repetition_penalty": 0},
            "repetition_penalty",
            "greater",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "response_format": {"type": "json_schema"}},
            "response_format",
            "json_schema: required",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice", "at least 1"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "42"}]},
            "messages[0]",
            "tool_call_id",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant"}]},
            "messages[0]",
            "content: required",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "a b"}}],
            },
            "tools[0].function.name",
            "pattern",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
            "tool_choice",
            "",
        ),
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, "temperature", "less than"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "greater than"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 5}, "stop", "at most 4"),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop", "expected a string or an array"),
        ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "system",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "presence_penalty": 2.5},
            "presence_penalty",
            "less than or equal to 2",
        ),
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty", "2"),
        ("/v1/completions", {"prompt": "hi", "priority": 5000}, "priority", "1000"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"x": 1}},
            "stream_options.x",
            "unknown",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]},
            "messages[0].content[0].type",
            "text",
        ),
    ],
)
def test_invalid_fields_are_named(
    client: TestClient, path: str, body: object, param: str, fragment: str
) -> None:
    status, error = error_of(client, path, body)
    assert status == 400
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    message = str(error["message"])
    assert message.startswith(f"{param}:") and fragment in message


def test_malformed_json_and_non_object_body(client: TestClient) -> None:
    response = client.post(
        "/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]
    status, error = error_of(client, "/v1/completions", ["prompt"])
    assert status == 400 and "JSON object" in str(error["message"])


def test_valid_request_waits_for_readiness(client: TestClient) -> None:
    status, error = error_of(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503 and error["code"] == "not_ready"
    retry = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert int(retry.headers["Retry-After"]) > 0
    assert "loading" in str(error["message"])
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["phase"] == "loading"
    assert client.get("/healthz").status_code == 200


def test_unknown_route_uses_the_error_format(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_flag_overrides_are_validated_under_their_field_name() -> None:
    merged = apply_overrides(CONFIG, {"port": 9001, "max_batch_size": 2, "host": None})
    assert merged.serving.port == 9001 and merged.serving.max_batch_size == 2
    assert merged.serving.host == CONFIG.serving.host
    with pytest.raises(ValueError, match=r"serving\.maxBatchSize"):
        apply_overrides(CONFIG, {"max_batch_size": 0})


def test_the_prefill_order_flag_reaches_the_engine_options() -> None:
    assert EngineOptions.from_serving(CONFIG.serving).prefill_order == "shortest-first"
    merged = apply_overrides(CONFIG, {"prefill_order": "arrival"})
    assert EngineOptions.from_serving(merged.serving).prefill_order == "arrival"
    with pytest.raises(ValueError, match="prefillOrder"):
        apply_overrides(CONFIG, {"prefill_order": "fifo"})


OFF_IN_FILE = apply_overrides(CONFIG, {"prefix_reuse": False})


@pytest.mark.parametrize(
    ("config", "flags", "expected"),
    [
        (CONFIG, [], True),  # the default
        (CONFIG, ["--no-prefix-reuse"], False),
        (OFF_IN_FILE, [], False),  # no flag: the file's value stands
        (OFF_IN_FILE, ["--prefix-reuse"], True),
    ],
)
def test_the_prefix_reuse_flag_reaches_the_engine_options(
    config: RuntimeConfig, flags: list[str], expected: bool
) -> None:
    args = build_parser().parse_args(["serve", "--config", "runtime.yaml", *flags])
    merged = apply_overrides(config, vars(args))
    assert EngineOptions.from_serving(merged.serving).prefix_reuse is expected


def test_usage_always_carries_the_cached_prompt_tokens() -> None:
    # OpenAI's shape: clients read usage.prompt_tokens_details.cached_tokens without a None check.
    plain = Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7)
    assert plain.model_dump(exclude_none=True)["prompt_tokens_details"] == {"cached_tokens": 0}
    reused = Usage(
        prompt_tokens=5,
        completion_tokens=2,
        total_tokens=7,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=4),
    )
    assert reused.model_dump()["prompt_tokens_details"] == {"cached_tokens": 4}


def test_both_length_fields_must_agree(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "max_completion_tokens": 4}  # fmt: skip
    status, error = error_of(client, "/v1/chat/completions", body)
    assert status == 400 and "max_completion_tokens" in str(error["message"])


def typed_fields(model: type[BaseModel]) -> dict[str, str]:
    """Each integer, number and boolean field of a request model, from its JSON schema."""
    fields = {}
    for name, spec in model.model_json_schema()["properties"].items():
        types = {branch.get("type") for branch in spec.get("anyOf", [spec])}
        for kind in ("integer", "number", "boolean"):
            if kind in types:
                fields[name] = kind
    return fields


# What each kind refuses, with how the 400 names what came: never coerced.
WRONG = {
    "integer": [("3", "a string"), (True, "a boolean"), (2.0, "a decimal number")],
    "number": [("0.5", "a string"), (False, "a boolean")],
    "boolean": [("true", "a string"), (1, "an integer")],
}
BODIES: dict[str, tuple[type[BaseModel], dict[str, object]]] = {
    "/v1/completions": (CompletionRequest, {"prompt": "hi"}),
    "/v1/chat/completions": (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x"}]},
    ),
}


@pytest.mark.parametrize("path", BODIES)
def test_every_numeric_and_boolean_field_refuses_strings_and_booleans(
    client: TestClient, path: str
) -> None:
    model, base = BODIES[path]
    fields = typed_fields(model)
    assert {"max_tokens", "temperature", "top_p", "seed", "n", "stream", "logprobs"} <= set(fields)
    for field, kind in fields.items():
        for value, given in WRONG[kind]:
            status, error = error_of(client, path, {**base, field: value})
            assert status == 400 and error["param"] == field, (field, value, error)
            assert str(error["message"]).endswith(f"got {given}"), (field, value, error)


def test_nested_request_models_are_strict_too(client: TestClient) -> None:
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}
    status, error = error_of(client, "/v1/completions", body)
    assert (status, error["param"]) == (400, "stream_options.include_usage")


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1, "top_p": 1, "presence_penalty": 0},  # integers where floats belong
        {"temperature": None, "max_tokens": None, "n": None, "stream": None, "stop": None},
    ],
)
def test_integers_for_numbers_and_nulls_for_defaults_pass_validation(
    client: TestClient, fields: dict[str, object]
) -> None:
    # 503: past validation, waiting for the models that never load here.
    response = client.post("/v1/completions", json={"prompt": "hi", **fields})
    assert response.status_code == 503, response.text
