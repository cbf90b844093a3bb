"""A seeded request to a real server process reproduces with the default knobs.

Default knobs: adaptive depth and the measured confidence stop, which follow
the step times, and a measured step budget. Identical seeded requests sent
alone, together and beside other requests (greedy, unseeded sampled, other
seeds) get identical text; another seed gets other text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_harness import (
    SubprocessServer,
    subprocess_server,
    wait_until_ready,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPT = "Hello, how can I help you with your order"
SEEDED = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 1234}
OTHERS = [
    {"prompt": "My order has not arrived", "max_tokens": 24, "temperature": 0},
    {"prompt": "The refund will appear", "max_tokens": 12, "temperature": 1.0},
    {"prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0.7, "seed": 5},
    {"prompt": "one two three four", "max_tokens": 30, "temperature": 0.9},
]


@pytest.fixture(scope="module")
def server(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SubprocessServer]:
    root = tmp_path_factory.mktemp("seeds")
    config = write_config(
        root / "config.yaml", *pair, speculation={"adaptive": True}, serving={"maxBatchSize": 8}
    )
    with subprocess_server(config, root / "server.log") as running:
        assert wait_until_ready(running.base_url)["ready"], running.log()
        yield running


async def complete(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_identical_seeded_requests_get_identical_text(server: SubprocessServer) -> None:
    async def run() -> tuple[str, list[str], list[str], str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            alone = await complete(client, SEEDED)
            together = await asyncio.gather(*(complete(client, SEEDED) for _ in range(3)))
            mixed = await asyncio.gather(
                *(complete(client, body) for body in [*OTHERS[:2], SEEDED, *OTHERS[2:], SEEDED])
            )
            other_seed = await complete(client, {**SEEDED, "seed": 4321})
        return alone, list(together), [mixed[2], mixed[5]], other_seed

    alone, together, mixed, other_seed = asyncio.run(run())
    assert alone  # it generated something
    assert together == [alone] * 3
    assert mixed == [alone] * 2
    assert other_seed != alone
