"""No rejected draft token ever reaches a client or the output filter.

The draft here disagrees with the target often (heavy weight noise), so many
drafted tokens are rejected. Greedy decoding makes the target's verified
sequence known in advance (target-only greedy), so every text the filter sees
and every SSE chunk a client receives must extend a prefix of it. A leaked
draft token would break the prefix at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specpair_runtime.server.filters import DenyListFilter, OutputFilter
from tests.support.server_harness import (
    InProcessServer,
    eventually,
    in_process_server,
    metric_value,
    save_tiny_pair,
    sse_events,
    target_only,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPTS = ["Hello, how can I help", "My order has not", "for i in range(10):", "Café, naïve"]
MAX_TOKENS = 40


class RecordingFilter:
    """Wraps the configured filter and records every text it is shown."""

    def __init__(self, inner: OutputFilter) -> None:
        self.inner = inner
        self.seen: list[str] = []

    def check(self, verified_text: str) -> str | None:
        self.seen.append(verified_text)
        return self.inner.check(verified_text)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), draft_noise=1.0)


@pytest.fixture(scope="module")
def server(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    config = write_config(
        tmp_path_factory.mktemp("cfg") / "config.yaml",
        *pair,
        speculation={"maxDepth": 4, "adaptive": False},
        serving={"outputFilter": {"denyPatterns": ["(?!)"]}},  # never matches; filter runs
    )
    with in_process_server(config) as running:
        yield running


def test_client_and_filter_see_only_the_verified_sequence(
    server: InProcessServer, pair: tuple[Path, Path]
) -> None:
    expected = target_only(*pair, PROMPTS, MAX_TOKENS)
    recorder = RecordingFilter(server.state.output_filter)
    server.state.output_filter = recorder
    drafted = accepted = 0
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for prompt, reference in zip(PROMPTS, expected, strict=True):
            recorder.seen.clear()
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
            received = ""
            with client.stream("POST", "/v1/completions", json=body) as response:
                for payload in sse_events(response):
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    received += chunk["choices"][0]["text"]
                    # Checked as each chunk arrives, not only at the end.
                    assert reference.startswith(received), (received, reference)
                    if chunk.get("speculation"):
                        drafted += chunk["speculation"]["drafted"]
                        accepted += chunk["speculation"]["accepted"]
            assert received == reference
            assert recorder.seen, "the filter must see the text before it goes out"
            for seen in recorder.seen:
                assert reference.startswith(seen), (seen, reference)
            assert recorder.seen[-1] == reference
    # The test means something only if drafts were actually rejected.
    assert drafted > 0 and accepted < drafted


def test_deny_pattern_ends_with_content_filter(
    server: InProcessServer, pair: tuple[Path, Path]
) -> None:
    (reference,) = target_only(*pair, [PROMPTS[0]], MAX_TOKENS)
    assert len(reference) > 12, reference
    word = reference[8:12]
    original = server.state.output_filter
    server.state.output_filter = DenyListFilter([re.escape(word)])
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
            payload = client.post("/v1/completions", json=body).json()
            text = payload["choices"][0]["text"]
            assert payload["choices"][0]["finish_reason"] == "content_filter"
            assert word not in text and reference.startswith(text)
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                chunks = [json.loads(p) for p in sse_events(r) if p != "[DONE]"]
            streamed = "".join(c["choices"][0]["text"] for c in chunks)
            assert streamed == text
            assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter"

            def batch_empty() -> None:
                metrics = client.get("/metrics").text
                assert metric_value(metrics, "specpair_requests_running") == 0
                # Both requests counted by the reason their clients saw.
                finished = "specpair_requests_finished_total"
                assert metric_value(metrics, finished, finish_reason="content_filter") == 2

            # The filtered request left the batch.
            eventually(batch_empty)
    finally:
        server.state.output_filter = original
