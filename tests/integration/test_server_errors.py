"""Bad input over real HTTP: 4xx in the OpenAI error format naming the field; 401; 429."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support.server_harness import (
    InProcessServer,
    in_process_server,
    metric_value,
    save_tiny_pair,
    write_config,
)

pytestmark = pytest.mark.integration

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LENGTH = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    root = tmp_path_factory.mktemp("errors")
    pair = save_tiny_pair(root / "pair")
    key_file = root / "api-key"
    key_file.write_text(KEY + "\n")
    config = write_config(
        root / "config.yaml",
        *pair,
        serving={
            "maxModelLength": MAX_MODEL_LENGTH,
            "maxBatchSize": 1,
            "maxWaitingRequests": 1,
            "apiKeyFile": str(key_file),
        },
    )
    with in_process_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as http:
        yield http


def error(response: httpx.Response, status: int) -> dict[str, str | None]:
    assert response.status_code == status, response.text
    body: dict[str, dict[str, str | None]] = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_missing_or_wrong_key_gets_401(server: InProcessServer, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions")]:
        response = httpx.request(
            method, f"{server.base_url}{path}", headers=headers, json={"prompt": "x"}
        )
        err = error(response, 401)
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    # Probes and metrics stay open for the kubelet and Prometheus.
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 200


def test_malformed_json(client: httpx.Client) -> None:
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in str(error(response, 400)["message"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": 2, "best_of": 2}, "best_of"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 2, "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "max_tokens": 2, "n": 17}, "n"),
    ],
)
def test_invalid_fields(client: httpx.Client, body: dict[str, object], param: str) -> None:
    err = error(client.post("/v1/completions", json=body), 400)
    assert err["param"] == param and str(err["message"]).startswith(param)


def test_prompt_longer_than_the_max_model_length(client: httpx.Client) -> None:
    long_prompt = "one two three four five six seven eight nine ten " * 20
    err = error(client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LENGTH) in str(err["message"])
    chat = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 1}
    err = error(client.post("/v1/chat/completions", json=chat), 400)
    assert err["param"] == "messages"


def test_max_tokens_out_of_range(client: httpx.Client) -> None:
    err = error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 500}), 400)
    assert err["param"] == "max_tokens" and "out of range" in str(err["message"])


def test_unknown_model(client: httpx.Client) -> None:
    err = error(client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"}), 404)
    assert err["param"] == "model"


def test_full_queue_gets_429(server: InProcessServer) -> None:
    """One slot, one waiting place: the third concurrent request is refused."""

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, headers=AUTH) as c:
            # This prompt runs to max_tokens on the tiny pair (no early EOS).
            long_body = {
                "prompt": "Hello, how can I help",
                "max_tokens": 50,
                "temperature": 0,
                "stream": True,
            }
            async with c.stream("POST", "/v1/completions", json=long_body) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                async for line in lines:  # generation has started: the slot is taken
                    if line.startswith("data:"):
                        break
                waiting = asyncio.ensure_future(
                    c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                )
                while metric_value((await c.get("/metrics")).text,
                                   "specpair_requests_waiting") < 1:  # fmt: skip
                    await asyncio.sleep(0.01)
                refused = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                body = refused.json()
                assert body["error"]["type"] == "rate_limit_error"
                assert refused.headers["Retry-After"] == "1"
                assert "queue is full" in body["error"]["message"]
                async for _ in lines:
                    pass
                return [running.status_code, (await waiting).status_code, refused.status_code]

    assert asyncio.run(run()) == [200, 200, 429]
    assert json.loads(httpx.get(f"{server.base_url}/readyz").text)["ready"] is True
