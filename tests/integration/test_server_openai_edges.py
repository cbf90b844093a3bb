"""The API details OpenAI clients rely on, against a real ``specpair-runtime serve`` process.

Streaming usage exactly as OpenAI sends it, strict types that name the
field, logprobs that lose no alternative, and the vLLM-style metrics, read
the way a client and a Prometheus scrape read them: raw SSE, the official
``openai`` SDK, and /metrics.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_harness import (
    metric_value,
    sse_events,
    subprocess_server,
    wait_until_ready,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny"
PROMPT = "Hello, how can I help"
ENDPOINTS: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": PROMPT},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}]},
}


@pytest.fixture(scope="module")
def base_url(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("edges")
    config = write_config(root / "config.yaml", *pair)
    with subprocess_server(config, root / "server.log") as server:
        assert wait_until_ready(server.base_url)["ready"], server.log()
        yield server.base_url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def sdk(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def raw_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        payloads = list(sse_events(response))
    assert payloads[-1] == "[DONE]"
    return [json.loads(payload) for payload in payloads[:-1]]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_stream_without_include_usage_carries_no_usage(client: httpx.Client, path: str) -> None:
    chunks = raw_stream(client, path, {**ENDPOINTS[path], "max_tokens": 6, "temperature": 0})
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("path", ENDPOINTS)
def test_include_usage_sends_usage_once_in_a_last_empty_choices_chunk(
    client: httpx.Client, path: str
) -> None:
    body = {**ENDPOINTS[path], "max_tokens": 6, "temperature": 0}
    whole = client.post(path, json=body).json()
    chunks = raw_stream(client, path, {**body, "stream_options": {"include_usage": True}})
    *content, last = chunks
    assert last["choices"] == [] and last["usage"] is not None
    assert [chunk["usage"] for chunk in content] == [None] * len(content)  # explicit nulls
    finish = [c for c in content if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["usage"] is None
    # A client that sums usage over the chunks bills it once.
    summed = sum(c["usage"]["completion_tokens"] for c in chunks if c["usage"])
    assert summed == whole["usage"]["completion_tokens"]
    assert last["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_the_sdk_sees_usage_once_and_only_when_asked(sdk: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    asked = list(
        sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    with_usage = [chunk for chunk in asked if chunk.usage is not None]
    assert with_usage == [asked[-1]] and asked[-1].choices == []
    plain = list(
        sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True
        )
    )
    assert all(chunk.usage is None for chunk in plain)
    legacy = list(
        sdk.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert [chunk for chunk in legacy if chunk.usage is not None] == [legacy[-1]]
    assert legacy[-1].choices == [] and legacy[-1].usage is not None
    assert legacy[-1].usage.completion_tokens == 6


def test_stream_options_without_a_stream_are_refused(client: httpx.Client) -> None:
    body = {**ENDPOINTS["/v1/completions"], "stream_options": {"include_usage": True}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    ("field", "value", "given"),
    [
        ("max_tokens", "3", "a string"),
        ("max_tokens", True, "a boolean"),
        ("max_tokens", 2.0, "a decimal number"),
        ("temperature", "0.5", "a string"),
        ("temperature", True, "a boolean"),
        ("top_p", "1", "a string"),
        ("seed", "7", "a string"),
        ("top_k", 1.5, "a decimal number"),
        ("n", True, "a boolean"),
        ("priority", "0", "a string"),
        ("stream", "true", "a string"),
        ("ignore_eos", 1, "an integer"),
    ],
)
def test_string_and_boolean_numbers_get_a_400_naming_the_field(
    client: httpx.Client, path: str, field: str, value: object, given: str
) -> None:
    response = client.post(path, json={**ENDPOINTS[path], field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}: expected ") and error["message"].endswith(given)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_integers_for_floats_and_nulls_for_defaults_are_accepted(
    client: httpx.Client, path: str
) -> None:
    # As OpenAI: any JSON number where a number belongs, null for the default.
    body = {**ENDPOINTS[path], "max_tokens": 2, "temperature": 0, "top_p": 1, "seed": None}
    response = client.post(path, json={**body, "presence_penalty": 0, "stop": None})
    assert response.status_code == 200, response.text


def test_the_sdk_gets_every_alternative_it_asked_for(sdk: openai.OpenAI) -> None:
    completion = sdk.completions.create(
        model=MODEL, prompt="日本語 😀", max_tokens=12, temperature=0, logprobs=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert [len(top) for top in logprobs.top_logprobs] == [5] * 12
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "日本語 😀"}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=5,
    )  # fmt: skip
    content = reply.choices[0].logprobs
    assert content is not None and content.content
    for entry in content.content:
        name = entry.token
        expected = (
            bytes(int(code, 16) for code in name[len("bytes:") :].split("\\x")[1:])
            if name.startswith("bytes:")
            else name.encode()
        )
        assert entry.bytes == list(expected)  # the real bytes, never U+FFFD's
        assert len(entry.top_logprobs) == 5


def test_metrics_have_no_created_series_and_count_what_vllm_users_look_for(
    client: httpx.Client,
) -> None:
    def scrape() -> str:
        return client.get("/metrics").text

    finished = "specpair_requests_finished_total"
    before = scrape()
    body = {**ENDPOINTS["/v1/completions"], "max_tokens": 3, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    after = scrape()
    assert "_created" not in after
    length = metric_value(after, finished, finish_reason="length")
    assert length == metric_value(before, finished, finish_reason="length") + 1
    queued = "specpair_request_queue_time_seconds_count"
    assert metric_value(after, queued) == metric_value(before, queued) + 1
    assert "specpair_kv_slot_usage{" in after
    assert metric_value(after, "specpair_kv_slot_usage") == 0.0  # nothing runs now
