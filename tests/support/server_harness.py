"""Start the runtime server on loopback for tests: in-process or as a subprocess.

Both ways are always stopped by their context managers, also on failure.
In-process servers expose their ``ServerState`` so that tests can reach the
memory probe's test hook and the output filter.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from specpair_runtime.config import load_runtime_config, parse_runtime_config
from specpair_runtime.server.command import start_key_watcher
from specpair_runtime.server.memory import MemoryProbe
from specpair_runtime.server.runner import DrainingServer, build_server
from specpair_runtime.server.startup import start_loader, stop_serving
from specpair_runtime.server.state import ServerState

if TYPE_CHECKING:
    from specpair_runtime.engine.oneshot import Completion

HOST = "127.0.0.1"
READY_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def bare_server_state(serving: dict[str, Any] | None = None) -> ServerState:
    """A ServerState over a config whose models are never loaded (unit tests)."""
    config = parse_runtime_config(
        {
            "pair": {"name": "p", "version": "1"},
            "target": {"source": "/models/target"},
            "draft": {"source": "/models/draft"},
            "serving": serving or {},
        }
    )
    return ServerState(config)


def write_config(
    path: Path,
    target: Path,
    draft: Path,
    *,
    speculation: dict[str, Any] | None = None,
    serving: dict[str, Any] | None = None,
    name: str = "tiny",
    version: str = "v1",
) -> Path:
    data = {
        "pair": {"name": name, "version": version},
        "target": {"source": str(target), "dtype": "float32"},
        "draft": {"source": str(draft), "dtype": "float32"},
        # Fixed depth by default: adaptive depth may choose target-only on a
        # busy CPU, and most tests need speculation to actually happen.
        "speculation": {"adaptive": False, **(speculation or {})},
        "serving": {"host": HOST, "port": free_port(), **(serving or {})},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def wait_until_ready(base_url: str, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
    """Poll /readyz until it settles on ready or failed; return its body."""
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{base_url}/readyz", timeout=5)
            body = response.json()
            if body["phase"] in ("ready", "failed"):
                return body
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server at {base_url} not settled after {timeout}s: {body}")


@dataclass
class InProcessServer:
    base_url: str
    state: ServerState
    server: DrainingServer

    @property
    def probe(self) -> MemoryProbe:
        assert self.state.probe is not None
        return self.state.probe


@contextmanager
def in_process_server(
    config_path: Path,
    *,
    watch_interval: float = 0.2,
    wait_ready: bool = True,
) -> Iterator[InProcessServer]:
    """uvicorn in a thread of this process, the real engine in another.

    The API key file (``serving.apiKeyFile``) is loaded and watched as ``serve`` does.
    """
    config = load_runtime_config(config_path)
    state = ServerState(config, config_path=config_path, device="cpu", probe=MemoryProbe("cpu"))
    start_key_watcher(state, watch_interval)
    server = build_server(state, config.serving.host, config.serving.port, log_level="warning")
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    start_loader(state, watch_interval)
    base_url = f"http://{config.serving.host}:{config.serving.port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)
        handle = InProcessServer(base_url, state, server)
        if wait_ready:
            body = wait_until_ready(base_url)
            assert body["ready"], body
        yield handle
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if state.loader is not None:
            state.loader.join(timeout=120)
        stop_serving(state)
        if state.key_watcher is not None:
            state.key_watcher.stop()


@dataclass
class SubprocessServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def subprocess_server(
    config_path: Path, log_path: Path, *extra_args: str
) -> Iterator[SubprocessServer]:
    """``specpair-runtime serve`` as a real child process; killed if still alive."""
    config = load_runtime_config(config_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    command = [
        sys.executable,
        "-m",
        "specpair_runtime",
        "serve",
        "--config",
        str(config_path),
        "--device",
        "cpu",
        *extra_args,
    ]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://{config.serving.host}:{config.serving.port}"
    try:
        yield SubprocessServer(base_url, process, log_path)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)


def save_tiny_pair(directory: Path, draft_noise: float = 0.08) -> tuple[Path, Path]:
    """The tiny Llama pair (tools/tiny_models.py) in Hugging Face layout."""
    from tools.tiny_models import save_pair

    return save_pair(directory, draft_noise=draft_noise)


def target_only(
    target: Path, draft: Path, prompts: list[str], max_tokens: int, *, chat: bool = False
) -> list[str]:
    """Greedy target-only text for each prompt: the reference the API must match."""
    return [c.text for c in target_only_completions(target, draft, prompts, max_tokens, chat=chat)]


def target_only_completions(
    target: Path, draft: Path, prompts: list[str], max_tokens: int, *, chat: bool = False
) -> list[Completion]:
    """Greedy target-only completions (token ids and text) for each prompt."""
    from specpair_runtime.config import ModelSpec, SpeculationKnobs
    from specpair_runtime.engine.api import SamplingParams
    from specpair_runtime.engine.oneshot import run_request
    from specpair_runtime.engine.pair import load_pair
    from specpair_runtime.engine.prompting import encode_prompt

    pair = load_pair(
        ModelSpec(source=str(target), dtype="float32"),
        ModelSpec(source=str(draft), dtype="float32"),
        SpeculationKnobs(enabled=False),
        "cpu",
    )
    engine = pair.engine(speculate=False)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    return [
        run_request(engine, encode_prompt(pair.target.tokenizer, p, chat=chat), params)
        for p in prompts
    ]


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


def stream_chunks(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """All chunks of a streamed response to ``body``; asserts it ends with [DONE]."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = list(sse_events(response))
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


async def stream_completion(
    client: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event
) -> list[str]:
    """POST a streaming completion; its ``data:`` payloads. ``started`` is set at the first."""
    payloads: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                payloads.append(line[len("data:") :].strip())
                started.set()
    return payloads


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one series in Prometheus text format (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if all(f'{key}="{val}"' in series for key, val in labels.items()):
            return float(value)
    return 0.0


def eventually(check: Any, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Retry ``check()`` (which asserts) until it passes or ``timeout`` ends."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(interval)
