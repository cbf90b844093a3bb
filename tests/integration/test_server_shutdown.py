"""SIGTERM drain on a real ``specpair-runtime serve`` process."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.support.server_harness import (
    save_tiny_pair,
    sse_events,
    subprocess_server,
    wait_until_ready,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sigterm_drains_in_flight_refuses_new_and_exits_zero(tmp_path: Path) -> None:
    pair = save_tiny_pair(tmp_path / "pair")
    config = write_config(tmp_path / "config.yaml", *pair, serving={"drainTimeoutSeconds": 60})
    with subprocess_server(config, tmp_path / "server.log") as server:
        body = wait_until_ready(server.base_url)
        assert body["ready"], server.log()
        request = {"prompt": "Hello", "max_tokens": 400, "temperature": 0, "stream": True}
        chunks: list[dict[str, object]] = []
        with (
            httpx.Client(base_url=server.base_url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=request) as response,
        ):
            events = sse_events(response)
            chunks.append(json.loads(next(events)))
            server.process.send_signal(signal.SIGTERM)
            # New work is refused while the stream is still running.
            with httpx.Client(base_url=server.base_url, timeout=30) as other:
                refused = other.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                ready = other.get("/readyz")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert ready.status_code == 503 and ready.json()["phase"] == "draining"
            rest = list(events)
        assert rest[-1] == "[DONE]"
        chunks += [json.loads(p) for p in rest[:-1]]
        last = chunks[-1]["choices"][0]  # type: ignore[index]
        assert last["finish_reason"] in ("length", "stop"), server.log()
        assert server.process.wait(timeout=60) == 0, server.log()
        assert "drained" in server.log()
