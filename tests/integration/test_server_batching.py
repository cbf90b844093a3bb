"""Continuous batching: concurrent streams, batch-size pause, priority, disconnects."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_harness import (
    InProcessServer,
    eventually,
    in_process_server,
    metric_value,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPTS = [
    "Hello, how can I help",
    "My order has not arrived",
    "Please share your order",
    "The refund will appear",
    "def add(a, b):",
    "for i in range(10):",
    "one two three four",
    "the quick brown fox",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    config = write_config(
        tmp_path_factory.mktemp("cfg") / "config.yaml",
        *pair,
        speculation={"maxDepth": 4, "disableAboveBatchSize": 4},
        serving={"maxBatchSize": 8},
    )
    with in_process_server(config) as running:
        yield running


async def stream_one(client: httpx.AsyncClient, prompt: str, **fields: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, **fields}
    text = ""
    last: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                break
            last = json.loads(payload)
            text += last["choices"][0]["text"]
    return {"text": text, "finish": last["choices"][0]["finish_reason"], **last}


def fallbacks(base_url: str, reason: str) -> float:
    return metric_value(
        httpx.get(f"{base_url}/metrics").text, "specpair_fallback_total", reason=reason
    )


def test_eight_concurrent_streams_equal_the_same_requests_alone(server: InProcessServer) -> None:
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            alone = [await stream_one(client, prompt) for prompt in PROMPTS]
            together = await asyncio.gather(*(stream_one(client, p) for p in PROMPTS))
        return alone, list(together)

    before = fallbacks(server.base_url, "batch_size")
    alone, together = asyncio.run(run())
    assert [r["text"] for r in together] == [r["text"] for r in alone]
    assert all(r["finish"] in ("length", "stop") for r in together)
    # Alone, each request speculated (batch 1 <= 4).
    assert all(r["speculation"]["drafted"] > 0 for r in alone)
    # Together the batch went above 4, so speculation paused, and metrics say so.
    assert fallbacks(server.base_url, "batch_size") > before
    drafted_alone = sum(r["speculation"]["drafted"] for r in alone)
    drafted_together = sum(r["speculation"]["drafted"] for r in together)
    assert drafted_together < drafted_alone

    def idle() -> None:
        text = httpx.get(f"{server.base_url}/metrics").text
        assert metric_value(text, "specpair_requests_running") == 0
        assert metric_value(text, "specpair_requests_waiting") == 0
        assert metric_value(text, "specpair_speculation_enabled") == 1

    eventually(idle)


def finished_requests(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return metric_value(text, "specpair_request_latency_seconds_count")


def wait_running(base_url: str, count: int) -> None:
    def check() -> None:
        text = httpx.get(f"{base_url}/metrics").text
        assert metric_value(text, "specpair_requests_running") == count

    eventually(check, timeout=20)


def test_stream_disconnect_cancels_and_frees_the_slot(server: InProcessServer) -> None:
    before = finished_requests(server.base_url)
    body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()  # kept: dropping it would close the stream early
        assert any(line.startswith("data:") for line in lines)
        wait_running(server.base_url, 1)
    wait_running(server.base_url, 0)
    # Aborted, not run to the end: no finished request was recorded.
    assert finished_requests(server.base_url) == before


def test_non_streaming_disconnect_cancels_too(server: InProcessServer) -> None:
    before = finished_requests(server.base_url)
    # PROMPTS[0] runs to max_tokens on the tiny pair (no early EOS).
    body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.3)
    wait_running(server.base_url, 0)
    assert finished_requests(server.base_url) == before


@pytest.fixture(scope="module")
def single_slot_server(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    config = write_config(
        tmp_path_factory.mktemp("cfg1") / "config.yaml",
        *pair,
        serving={"maxBatchSize": 1, "maxWaitingRequests": 8},
    )
    with in_process_server(config) as running:
        yield running


def test_priority_first_then_fifo(single_slot_server: InProcessServer) -> None:
    base_url = single_slot_server.base_url
    finished: list[str] = []

    async def tagged(client: httpx.AsyncClient, tag: str, priority: int) -> None:
        await stream_one(client, PROMPTS[1], max_tokens=4, priority=priority)
        finished.append(tag)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            # Occupy the only slot long enough for the others to queue behind it.
            blocker = asyncio.ensure_future(stream_one(client, PROMPTS[0], max_tokens=900))

            async def queued() -> None:
                while True:
                    text = (await client.get("/metrics")).text
                    if metric_value(text, "specpair_requests_running") == 1:
                        return
                    await asyncio.sleep(0.02)

            await queued()
            tasks = []
            # Without API keys every caller may use priority 0 or lower (test_server_hostile
            # covers per-key priority classes).
            for tag, priority in [("low-1", -5), ("high-1", 0), ("low-2", -5), ("high-2", 0)]:
                tasks.append(asyncio.ensure_future(tagged(client, tag, priority)))
                # Wait until this one is in the waiting queue, to fix arrival order.
                want = len(tasks)
                while metric_value((await client.get("/metrics")).text,
                                   "specpair_requests_waiting") < want:  # fmt: skip
                    await asyncio.sleep(0.01)
            # Hang up on the blocker: its slot frees and the queue drains in order.
            blocker.cancel()
            await asyncio.gather(*tasks)

    start = time.monotonic()
    asyncio.run(run())
    assert finished == ["high-1", "high-2", "low-1", "low-2"], (finished, time.monotonic() - start)


def test_a_serving_process_keeps_its_loaded_heap_out_of_collections(
    server: InProcessServer,
) -> None:
    # A full collection over the models' objects stalls every stream (startup.py).
    assert gc.get_freeze_count() > 10_000
