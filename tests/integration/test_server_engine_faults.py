"""Engine failures reach clients as generic OpenAI errors, and one row's failure is its own.

First for real: a tiny pair whose embedding of one token is NaN gives
non-finite probabilities in the rows of requests that contain it. Then
``FaultyEngine`` wraps the real engine and injects the two failures the
engine contract allows (engine/api.py), a row finishing with
``finish_reason="error"`` and a whole step raising, with a detail text that
must never reach a client. Requests pick their fault through their seed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tools.tiny_models import build_pair, save_model

from specpair_runtime.engine.api import Engine, SamplingParams, StepEvent
from tests.support.server_harness import (
    InProcessServer,
    in_process_server,
    metric_value,
    stream_completion,
    write_config,
)

pytestmark = pytest.mark.integration

ROW_FAULT_SEED = 666
STEP_FAULT_SEED = 667
SECRET = "CUDA error: device-side assert at /internal/kernels.cu:42"


class FaultyEngine:
    """The real engine, failing rows or steps of requests with the fault seeds."""

    def __init__(self, real: Engine) -> None:
        self.real = real
        self.row_faults: set[str] = set()
        self.step_faults: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.real.add_request(request_id, prompt_ids, params)
        if params.seed == ROW_FAULT_SEED:
            self.row_faults.add(request_id)
        if params.seed == STEP_FAULT_SEED:
            self.step_faults.add(request_id)

    def step(self) -> list[StepEvent]:
        if self.step_faults:
            self.step_faults.clear()
            raise RuntimeError(SECRET)
        events = []
        for event in self.real.step():
            if event.request_id in self.row_faults:
                self.row_faults.discard(event.request_id)
                if not event.finished:
                    self.real.abort(event.request_id)
                event = StepEvent(event.request_id, [], "", 0, 0, finished=True,
                                  finish_reason="error", error=f"ValueError: {SECRET}")  # fmt: skip
            events.append(event)
        return events


@pytest.fixture(scope="module")
def server(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    config = write_config(
        tmp_path_factory.mktemp("faults") / "config.yaml", *pair, serving={"maxBatchSize": 6}
    )
    with in_process_server(config) as running:
        scheduler = running.state.scheduler
        assert scheduler is not None
        scheduler.engine = FaultyEngine(scheduler.engine)  # type: ignore[assignment]
        yield running


async def stream(client: httpx.AsyncClient, started: asyncio.Event, **fields: Any) -> list[str]:
    body = {"prompt": "Hello, how can I help", "max_tokens": 30, "temperature": 0,
            "stream": True, **fields}  # fmt: skip
    return await stream_completion(client, body, started)


def stream_error(payloads: list[str]) -> dict[str, Any] | None:
    assert payloads[-1] == "[DONE]"
    last: dict[str, Any] = json.loads(payloads[-2])
    return last.get("error")


def run_with_streams(
    server: InProcessServer, streams: int, doomed: dict[str, Any]
) -> tuple[list[list[str]], httpx.Response, list[str]]:
    """``streams`` streams in flight, then one non-streamed and one streamed doomed request."""

    async def run() -> tuple[list[list[str]], httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            events = [asyncio.Event() for _ in range(streams + 1)]
            running = [asyncio.ensure_future(stream(client, e)) for e in events[:streams]]
            for event in events[:streams]:
                await asyncio.wait_for(event.wait(), 60)
            doomed_stream = asyncio.ensure_future(stream(client, events[-1], **doomed))
            body = {"prompt": "x", "max_tokens": 8, "temperature": 0, **doomed}
            response = await client.post("/v1/completions", json=body)
            return list(await asyncio.gather(*running)), response, await doomed_stream

    return asyncio.run(run())


def errors_counted(server: InProcessServer) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return metric_value(text, "specpair_request_errors_total", reason="engine_error")


def assert_generic(error: dict[str, Any] | None, status_type: str = "server_error") -> None:
    assert error is not None
    assert error["code"] == "engine_error" and error["type"] == status_type
    assert error["message"] == "the server failed while generating this request"


def assert_healthy(server: InProcessServer) -> None:
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


POISON = "~"  # a byte-level token no other prompt here contains


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    root = tmp_path_factory.mktemp("poisoned")
    tiny = build_pair()
    token = tiny.tokenizer.convert_tokens_to_ids(POISON)
    with torch.no_grad():
        for model in (tiny.target, tiny.draft):
            for name, weights in model.named_parameters():
                if name.endswith("embed_tokens.weight"):
                    weights[token] = float("nan")
    target = save_model(tiny.target, tiny.tokenizer, root / "target")
    draft = save_model(tiny.draft, tiny.tokenizer, root / "draft")
    config = write_config(root / "config.yaml", target, draft, serving={"maxBatchSize": 6})
    with in_process_server(config) as running:
        yield running


def test_non_finite_probabilities_fail_only_their_request(
    poisoned: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpair")
    mates, doomed, doomed_stream = run_with_streams(
        poisoned, 3, {"prompt": f"x{POISON}", "temperature": 0.7}
    )
    for payloads in mates:
        assert stream_error(payloads) is None
        assert json.loads(payloads[-2])["choices"][0]["finish_reason"] in ("length", "stop")
    assert doomed.status_code == 500
    assert_generic(doomed.json()["error"])
    assert_generic(stream_error(doomed_stream))
    assert "not finite" in caplog.text
    assert errors_counted(poisoned) == 2
    assert_healthy(poisoned)


def test_a_failed_row_fails_only_its_request(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpair")
    before = errors_counted(server)
    mates, doomed, doomed_stream = run_with_streams(
        server, 3, {"seed": ROW_FAULT_SEED, "temperature": 0.7}
    )
    for payloads in mates:
        assert stream_error(payloads) is None
        assert json.loads(payloads[-2])["choices"][0]["finish_reason"] in ("length", "stop")
    assert doomed.status_code == 500
    assert_generic(doomed.json()["error"])
    assert_generic(stream_error(doomed_stream))
    assert SECRET not in doomed.text + "".join(doomed_stream)
    assert SECRET in caplog.text  # the detail is in the logs
    assert errors_counted(server) - before == 2
    assert_healthy(server)


def test_a_failed_step_leaks_no_exception_text(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpair")
    before = errors_counted(server)
    mates, doomed, doomed_stream = run_with_streams(server, 2, {"seed": STEP_FAULT_SEED})
    # Which row broke is unknown, so the running requests fail with it, all generically.
    bodies = [doomed.text, *("".join(p) for p in [*mates, doomed_stream])]
    assert all(SECRET not in body for body in bodies)
    assert doomed.status_code == 500
    assert_generic(doomed.json()["error"])
    failed = [p for p in [*mates, doomed_stream] if stream_error(p) is not None]
    for payloads in failed:
        assert_generic(stream_error(payloads))
    assert errors_counted(server) - before == 1 + len(failed)
    assert SECRET in caplog.text
    assert_healthy(server)


class BrokenTokenizer:
    """The real tokenizer, except that encoding raises (a bug we did not foresee)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(SECRET)


def test_an_unexpected_exception_gets_an_openai_500_without_its_text(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpair")
    state = server.state
    real = state.tokenizer
    state.tokenizer = BrokenTokenizer(real)
    try:
        body = {"prompt": "Hello", "max_tokens": 2}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    finally:
        state.tokenizer = real
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert SECRET not in response.text and SECRET in caplog.text
    assert_healthy(server)
