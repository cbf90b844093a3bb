"""Memory-pressure fallback (forced through the probe's test hook) and the acceptance floor."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_harness import (
    InProcessServer,
    in_process_server,
    metric_value,
    target_only,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPT = "My order has not arrived yet"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(pair: tuple[Path, Path]) -> str:
    (text,) = target_only(*pair, [PROMPT], MAX_TOKENS)
    return text


def complete(base_url: str) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    payload: dict[str, Any] = response.json()
    return payload


def metric(base_url: str, name: str, **labels: str) -> float:
    return metric_value(httpx.get(f"{base_url}/metrics").text, name, **labels)


def test_memory_pressure_pauses_and_resumes_with_hysteresis(
    pair: tuple[Path, Path],
    expected: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="specpair")
    config = write_config(
        tmp_path / "config.yaml", *pair, speculation={"memoryPressureThreshold": 0.8}
    )
    with in_process_server(config) as server:
        url = server.base_url
        first = complete(url)
        assert first["speculation"]["drafted"] > 0
        assert first["choices"][0]["text"] == expected

        server.probe.force(0.9)  # above 0.8: pause, free the draft's KV cache
        paused = complete(url)
        assert paused["choices"][0]["text"] == expected
        assert paused["speculation"]["drafted"] == 0
        assert metric(url, "specpair_fallback_total", reason="memory_pressure") == 1
        assert metric(url, "specpair_speculation_enabled") == 0
        assert "memory pressure above 0.80" in caplog.text

        server.probe.force(0.77)  # inside the hysteresis band: still paused
        still = complete(url)
        assert still["speculation"]["drafted"] == 0
        assert still["choices"][0]["text"] == expected

        server.probe.force(0.5)  # well below: resume, the draft re-prefills
        resumed = complete(url)
        assert resumed["speculation"]["drafted"] > 0
        assert resumed["choices"][0]["text"] == expected
        assert metric(url, "specpair_speculation_enabled") == 1
        assert metric(url, "specpair_fallback_total", reason="memory_pressure") == 1
        assert "speculation resumes" in caplog.text


@pytest.fixture
def floor_server(pair: tuple[Path, Path], tmp_path: Path) -> Iterator[InProcessServer]:
    # A floor of 1.0 over a short window: any rejection turns speculation off.
    config = write_config(
        tmp_path / "config.yaml",
        *pair,
        speculation={"acceptanceFloor": 1.0, "acceptanceWindow": 2, "adaptive": False},
    )
    with in_process_server(config) as server:
        yield server


def test_acceptance_floor_turns_speculation_off(
    floor_server: InProcessServer, expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpair")
    url = floor_server.base_url
    outputs = [complete(url) for _ in range(3)]
    assert all(o["choices"][0]["text"] == expected for o in outputs)
    assert outputs[0]["speculation"]["drafted"] > 0
    assert outputs[-1]["speculation"]["drafted"] == 0
    assert metric(url, "specpair_fallback_total", reason="acceptance_floor") == 1
    assert metric(url, "specpair_speculation_enabled") == 0
    assert "acceptance_floor" in caplog.text
