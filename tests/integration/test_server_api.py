"""Endpoint contracts over real HTTP, streaming and not, on the tiny pair."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_harness import (
    InProcessServer,
    in_process_server,
    metric_value,
    stream_chunks,
    target_only,
    target_only_completions,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPTS = ["Hello, how can I help", "The package left our", "def add(a, b):", "one two three"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    config = write_config(
        tmp_path_factory.mktemp("cfg") / "config.yaml",
        *pair,
        speculation={"maxDepth": 4, "adaptive": False},
    )
    with in_process_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        yield http


def complete(client: httpx.Client, prompt: str, **fields: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    payload: dict[str, Any] = response.json()
    return payload


def token_counts(usage: dict[str, Any]) -> dict[str, Any]:
    """The usage without ``prompt_tokens_details``: a repeated prompt may reuse its KV."""
    details = usage["prompt_tokens_details"]
    assert 0 <= details["cached_tokens"] < usage["prompt_tokens"]  # the first token is computed
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def test_health_ready_and_models(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "tiny" and card["pair"] == "tiny" and card["pair_version"] == "v1"


def test_completion_contract_and_usage(client: httpx.Client, server: InProcessServer) -> None:
    payload = complete(client, PROMPTS[0])
    assert payload["object"] == "text_completion" and payload["id"].startswith("cmpl-")
    assert payload["model"] == "tiny"
    (choice,) = payload["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("length", "stop")
    usage = payload["usage"]
    prompt_tokens = len(server.state.tokenizer(PROMPTS[0]).input_ids)
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}
    token_counts(usage)
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == MAX_TOKENS
    spec = payload["speculation"]
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])


def test_greedy_through_the_api_equals_target_only(
    client: httpx.Client, pair: tuple[Path, Path]
) -> None:
    expected = target_only(*pair, PROMPTS, MAX_TOKENS)
    got = [complete(client, prompt)["choices"][0]["text"] for prompt in PROMPTS]
    assert got == expected


def test_stream_chunks_concatenate_to_the_non_streaming_text(client: httpx.Client) -> None:
    for prompt in PROMPTS:
        whole = complete(client, prompt)
        chunks = stream_chunks(
            client,
            "/v1/completions",
            {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
             "stream_options": {"include_usage": True}},
        )  # fmt: skip
        usage_chunk = chunks.pop()
        assert usage_chunk["choices"] == []
        assert token_counts(usage_chunk["usage"]) == token_counts(whole["usage"])
        texts = [c["choices"][0]["text"] for c in chunks]
        # One chunk per accept step: never empty, except the closing chunk.
        assert all(texts[:-1]) and texts[-1] == ""
        assert "".join(texts) == whole["choices"][0]["text"]
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        last = chunks[-1]
        assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        assert last["usage"] is None  # only the usage chunk counts the tokens
        assert last["speculation"]["drafted"] > 0


def test_multi_token_commits_go_out_as_one_chunk(client: httpx.Client) -> None:
    body = {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    *chunks, usage_chunk = stream_chunks(client, "/v1/completions", body)
    usage = usage_chunk["usage"]
    spec = chunks[-1]["speculation"]
    assert spec["accepted"] > 0, "the tiny draft should agree with the target sometimes"
    # Fewer chunks than tokens: accepted drafts were sent together with their step.
    assert len(chunks) - 1 < usage["completion_tokens"]


def test_chat_streaming_and_not(client: httpx.Client, pair: tuple[Path, Path]) -> None:
    messages = [{"role": "user", "content": PROMPTS[0]}]
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["object"] == "chat.completion" and payload["id"].startswith("chatcmpl-")
    message = payload["choices"][0]["message"]
    assert message["role"] == "assistant"
    (expected,) = target_only(*pair, [PROMPTS[0]], MAX_TOKENS, chat=True)
    assert message["content"] == expected
    chunks = stream_chunks(client, "/v1/chat/completions", body)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == payload["choices"][0]["finish_reason"]
    assert all("usage" not in c for c in chunks)  # not asked for: OpenAI sends none
    with_usage = stream_chunks(
        client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert [c["usage"] for c in with_usage[:-1]] == [None] * (len(with_usage) - 1)
    assert with_usage[-1]["choices"] == []
    assert token_counts(with_usage[-1]["usage"]) == token_counts(payload["usage"])


def test_stop_string_is_held_back_and_cut(client: httpx.Client) -> None:
    full = complete(client, PROMPTS[2], max_tokens=32)["choices"][0]["text"]
    assert len(full) > 6, full
    stop = full[3:6]  # inside the output, so the stop must trigger
    cut = full[: full.index(stop)]
    payload = complete(client, PROMPTS[2], max_tokens=32, stop=[stop])
    assert payload["choices"][0]["text"] == cut
    assert payload["choices"][0]["finish_reason"] == "stop"
    chunks = stream_chunks(
        client,
        "/v1/completions",
        {"prompt": PROMPTS[2], "max_tokens": 32, "temperature": 0, "stop": stop},
    )
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == cut
    # No chunk ever carried (part of) the stop string past the cut.
    assert all(stop not in "".join(texts[: i + 1]) for i in range(len(texts)))


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    fields = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 20}
    first = complete(client, PROMPTS[3], **fields)["choices"][0]["text"]
    second = complete(client, PROMPTS[3], **fields)["choices"][0]["text"]
    assert first == second


def test_metrics_carry_pair_labels_on_every_series(client: httpx.Client) -> None:
    complete(client, PROMPTS[0])
    text = client.get("/metrics").text
    names = [
        "specpair_draft_tokens_total",
        "specpair_accepted_tokens_total",
        "specpair_accepted_tokens_per_position_total",
        "specpair_speculation_steps_total",
        "specpair_held_back_steps_total",
        "specpair_speculation_enabled",
        "specpair_fallback_total",
        "specpair_time_to_first_token_seconds_bucket",
        "specpair_inter_token_latency_seconds_bucket",
        "specpair_request_latency_seconds_count",
        "specpair_requests_running",
        "specpair_requests_waiting",
        "specpair_step_token_budget",
    ]
    for name in names:
        assert f"\n{name}{{" in text, name
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all('pair="tiny"' in s and 'pair_version="v1"' in s for s in samples)
    assert metric_value(text, "specpair_draft_tokens_total") > 0
    assert metric_value(text, "specpair_accepted_tokens_per_position_total", position="0") > 0
    assert metric_value(text, "specpair_speculation_enabled") == 1
    assert metric_value(text, "specpair_requests_running") == 0
    assert metric_value(text, "specpair_step_token_budget") >= 8
    # The prompt entered with nobody decoding, then the request decoded alone.
    assert metric_value(text, "specpair_step_seconds_count", kind="prefill") >= 1
    assert metric_value(text, "specpair_step_seconds_count", kind="decode") >= 1
    counts = [line for line in samples if line.startswith("specpair_step_seconds_count{")]
    for kind in ("decode", "mixed", "prefill"):  # every series exists, at 0 until used
        assert any(f'kind="{kind}"' in line for line in counts), kind


def test_vllm_sampling_extras(
    client: httpx.Client, server: InProcessServer, pair: tuple[Path, Path]
) -> None:
    """top_k, stop_token_ids and ignore_eos, as vLLM's clients send them."""
    greedy = complete(client, PROMPTS[2])
    # top_k=1 leaves one token to sample: greedy output at any temperature.
    for seed in (1, 2):
        sampled = complete(client, PROMPTS[2], temperature=1.5, top_k=1, seed=seed)
        assert sampled["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert (
        complete(client, PROMPTS[2], top_k=-1)["choices"][0]["text"] == greedy["choices"][0]["text"]
    )
    (reference,) = target_only_completions(*pair, [PROMPTS[2]], MAX_TOKENS)
    assert reference.text == greedy["choices"][0]["text"]
    stop = reference.token_ids[len(reference.token_ids) // 2]
    stopped = complete(client, PROMPTS[2], stop_token_ids=[stop])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < greedy["usage"]["completion_tokens"]
    forced = complete(client, PROMPTS[2], ignore_eos=True)
    assert forced["usage"]["completion_tokens"] == MAX_TOKENS
    for body, param in (
        ({"top_k": -2}, "top_k"),
        ({"stop_token_ids": [len(server.state.tokenizer)]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ):
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(param), error
