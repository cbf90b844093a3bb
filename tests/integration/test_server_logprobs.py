"""``logprobs`` through the OpenAI API, streaming and not, on the tiny pair over real HTTP.

The values themselves are checked against transformers' forward in
``test_engine_logprobs.py``; here: the shapes OpenAI clients parse, one
entry per completion token, streaming equal to non-streaming, speculative
equal to target-only, and clear errors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_harness import (
    InProcessServer,
    in_process_server,
    stream_chunks,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPT = "def add(a, b):"
MAX_TOKENS = 16


def _server(pair: tuple[Path, Path], root: Path, depth: int) -> Any:
    speculation = {"maxDepth": depth, "adaptive": False} if depth else {"enabled": False}
    return in_process_server(write_config(root / "config.yaml", *pair, speculation=speculation))


@pytest.fixture(scope="module")
def server(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    with _server(pair, tmp_path_factory.mktemp("cfg"), 4) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        yield http


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json={"max_tokens": MAX_TOKENS, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    payload: dict[str, Any] = response.json()
    return payload


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return stream_chunks(client, path, {"max_tokens": MAX_TOKENS, "temperature": 0, **body})


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": PROMPT}], **fields}


def test_completion_logprobs_shape(client: httpx.Client) -> None:
    payload = post(client, "/v1/completions", {"prompt": PROMPT, "logprobs": 3})
    choice = payload["choices"][0]
    logprobs = choice["logprobs"]
    count = payload["usage"]["completion_tokens"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == count
    assert len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == count
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert value <= 0.0 and math.isfinite(value)
        assert top[token] == value  # the chosen token leads its own alternatives
        # Greedy: the chosen token is the most likely, so it is one of the three.
        assert len(top) == 3
        assert value == max(top.values())


def token_bytes(name: str) -> bytes:
    """A token's bytes from its name: ``bytes:\\xe4`` (OpenAI's form) or its text."""
    if name.startswith("bytes:"):
        return bytes(int(code, 16) for code in name[len("bytes:") :].split("\\x")[1:])
    return name.encode()


def test_completion_logprobs_lose_no_alternative_and_rebuild_the_text(
    client: httpx.Client,
) -> None:
    """Byte tokens (halves of CJK characters, emoji) have names of their own: none collide."""
    payload = post(
        client,
        "/v1/completions",
        {"prompt": "日本語 😀 héllo", "logprobs": 20, "max_tokens": 24, "ignore_eos": True},
    )
    logprobs = payload["choices"][0]["logprobs"]
    assert all(len(top) == 20 for top in logprobs["top_logprobs"])
    names = {name for top in logprobs["top_logprobs"] for name in top}
    assert any(name.startswith("bytes:") for name in names), "the tiny model offers byte tokens"
    data = b"".join(token_bytes(t) for t in logprobs["tokens"])
    text = payload["choices"][0]["text"]
    assert data.decode("utf-8", errors="replace") == text
    # Offsets point into the text: at each token's first character.
    assert all(0 <= o <= len(text) for o in logprobs["text_offset"])


def test_chat_logprobs_shape(client: httpx.Client) -> None:
    payload = post(client, "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=2))
    content = payload["choices"][0]["logprobs"]["content"]
    assert len(content) == payload["usage"]["completion_tokens"]
    for entry in content:
        assert entry["bytes"] == list(token_bytes(entry["token"]))
        assert len(entry["top_logprobs"]) == 2
        best = entry["top_logprobs"][0]
        assert (best["token"], best["logprob"]) == (entry["token"], entry["logprob"])
        assert entry["top_logprobs"][1]["logprob"] <= best["logprob"]


def test_chat_bytes_are_the_tokens_real_bytes(client: httpx.Client) -> None:
    """Part of a character is named by its bytes and carries them, never U+FFFD's."""
    messages = [{"role": "user", "content": "日本語 😀 héllo"}]
    body = {"messages": messages, "logprobs": True, "top_logprobs": 20, "max_tokens": 24}
    payload = post(client, "/v1/chat/completions", body)
    content = payload["choices"][0]["logprobs"]["content"]
    everything = [*content, *(top for entry in content for top in entry["top_logprobs"])]
    assert all(e["bytes"] == list(token_bytes(e["token"])) for e in everything)
    assert all("\ufffd" not in e["token"] for e in everything)
    partial = [e for e in everything if e["token"].startswith("bytes:")]
    assert partial, "the tiny model offers byte tokens among its alternatives"
    assert all(
        bytes(e["bytes"]).decode(errors="ignore") != bytes(e["bytes"]).decode(errors="replace")
        for e in partial
    )
    message = payload["choices"][0]["message"]["content"]
    data = b"".join(bytes(entry["bytes"]) for entry in content)
    assert data.decode(errors="replace").startswith(message)  # then EOS's text, if it ended


def test_streamed_logprobs_equal_the_non_streamed(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "logprobs": 1}
    whole = post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    chunks = stream(client, "/v1/completions", body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    assert [v for p in parts for v in p["token_logprobs"]] == whole["token_logprobs"]
    assert [o for p in parts for o in p["text_offset"]] == whole["text_offset"]
    # A chunk's logprobs belong to the text it carries.
    for chunk in chunks:
        choice = chunk["choices"][0]
        if choice["text"] and choice["logprobs"]:
            data = b"".join(token_bytes(t) for t in choice["logprobs"]["tokens"])
            assert data.decode(errors="replace").endswith(choice["text"][-1:])

    chat_whole = post(client, "/v1/chat/completions", chat_body(logprobs=True))
    chat_chunks = stream(client, "/v1/chat/completions", chat_body(logprobs=True))
    streamed = [
        entry
        for c in chat_chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for entry in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == chat_whole["choices"][0]["logprobs"]["content"]
    assert all(entry["top_logprobs"] == [] for entry in streamed)


def test_stop_string_keeps_one_entry_per_token(client: httpx.Client) -> None:
    full = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24})
    text = full["choices"][0]["text"]
    stop = text[3:6]
    assert stop
    payload = post(
        client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "stop": stop, "logprobs": 0}
    )
    assert payload["choices"][0]["finish_reason"] == "stop"
    tokens = payload["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == payload["usage"]["completion_tokens"] < 24


def test_without_the_field_logprobs_are_null(client: httpx.Client) -> None:
    assert post(client, "/v1/completions", {"prompt": PROMPT})["choices"][0]["logprobs"] is None
    chat = post(client, "/v1/chat/completions", chat_body())
    assert chat["choices"][0]["logprobs"] is None
    for chunk in stream(client, "/v1/chat/completions", chat_body()):
        assert all(choice["logprobs"] is None for choice in chunk["choices"])


def test_speculative_logprobs_equal_target_only(
    client: httpx.Client, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    body = chat_body(logprobs=True, top_logprobs=3)
    speculative = post(client, "/v1/chat/completions", body)
    with (
        _server(pair, tmp_path, 0) as plain_server,
        httpx.Client(base_url=plain_server.base_url, timeout=120) as plain,
    ):
        target_only = post(plain, "/v1/chat/completions", body)
    assert speculative["speculation"]["drafted"] > 0
    assert target_only["speculation"]["drafted"] == 0
    left = speculative["choices"][0]["logprobs"]["content"]
    right = target_only["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in left] == [e["token"] for e in right]
    for a, b in zip(left, right, strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", chat_body(top_logprobs=2), "top_logprobs"),
        ("/v1/chat/completions", chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
        ("/v1/chat/completions", chat_body(logprobs=3), "logprobs"),
    ],
)
def test_bad_logprobs_fields_are_named(
    client: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    response = client.post(path, json={"max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
