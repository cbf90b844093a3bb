"""SIGTERM drain, and a second SIGTERM's forced stop, on a real ``serve`` process."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server_harness import (
    HOST,
    SubprocessServer,
    sse_events,
    subprocess_server,
    wait_until_ready,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sigterm_drains_in_flight_refuses_new_and_exits_zero(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
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
            # An upload still under way is not in-flight work: the drain refuses it at once
            # instead of waiting out its body timeout (30 s by default).
            stalled = socket.create_connection((HOST, port_of(server)), timeout=10)
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Length: 100\r\n\r\n{")  # fmt: skip
            server.process.send_signal(signal.SIGTERM)
            with stalled:
                answer = b""
                while chunk := stalled.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 503") and b"shutting_down" in answer, answer
            # New work is refused while the stream is still running.
            with httpx.Client(base_url=server.base_url, timeout=30) as other:
                refused = other.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                ready = other.get("/readyz")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert int(refused.headers["Retry-After"]) > 0
            assert ready.status_code == 503 and ready.json()["phase"] == "draining"
            rest = list(events)
        assert rest[-1] == "[DONE]"
        chunks += [json.loads(p) for p in rest[:-1]]
        last = chunks[-1]["choices"][0]  # type: ignore[index]
        assert last["finish_reason"] in ("length", "stop"), server.log()
        assert server.process.wait(timeout=60) == 0, server.log()
        assert "drained" in server.log()


def test_second_sigterm_fails_open_streams_with_an_error_and_exits_non_zero(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    config = write_config(tmp_path / "config.yaml", *pair, serving={"drainTimeoutSeconds": 120})
    with subprocess_server(config, tmp_path / "server.log") as server:
        assert wait_until_ready(server.base_url)["ready"], server.log()
        # Long enough to still be running when the second signal comes.
        request = {"prompt": "Hello", "max_tokens": 1000, "temperature": 0, "stream": True}
        with (
            httpx.Client(base_url=server.base_url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=request) as first,
            client.stream("POST", "/v1/completions", json=request) as second,
        ):
            streams = [sse_events(first), sse_events(second)]
            for events in streams:
                json.loads(next(events))  # both are generating
            server.process.send_signal(signal.SIGTERM)
            wait_for_log(server, "draining")
            server.process.send_signal(signal.SIGTERM)
            tails = [list(events) for events in streams]
        for tail in tails:
            assert tail[-1] == "[DONE]", tail[-3:]
            error = json.loads(tail[-2])["error"]
            assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
        assert server.process.wait(timeout=60) != 0, server.log()
        assert "forced stop" in server.log()


def wait_for_log(server: SubprocessServer, needle: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)


def port_of(server: SubprocessServer) -> int:
    return int(server.base_url.rsplit(":", 1)[1])
