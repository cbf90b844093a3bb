"""The gate sidecar (``specpair-runtime gate``) as a real process beside a vLLM server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from specpair_runtime.config import GateConfig, ModelSpec, PairInfo
from tests.support.server_harness import free_port
from tests.support.vllm_server import VllmServer, stop_group

NAME = "tiny"


def gate_config(
    tmp: Path,
    server: VllmServer,
    target: Path,
    draft: Path | None,
    prompts: list[dict[str, Any]] | None,
    name: str = NAME,
) -> tuple[Path, int]:
    """A gate config for ``server`` (its golden file from ``prompts``) and the gate's port."""
    golden = None
    if prompts is not None:
        golden = tmp / "golden.yaml"
        golden.write_text(yaml.safe_dump({"prompts": prompts}))
    port = free_port()
    config = GateConfig(
        pair=PairInfo(name=name, version="v1"),
        engine_url=server.url,
        served_model_name=name,
        target=ModelSpec(source=str(target)),
        draft=None if draft is None else ModelSpec(source=str(draft)),
        golden_prompts_file=None if golden is None else str(golden),
        host="127.0.0.1",
        port=port,
        cuda=False,
        engine_start_timeout_seconds=60,
    )
    path = tmp / "gate.yaml"
    path.write_text(yaml.safe_dump(config.to_wire()))
    return path, port


def run_gate(config: Path, port: int, log: Path, timeout: float = 180.0) -> dict[str, Any]:
    """Start the gate, wait for a final /readyz (ready or failed), stop it; the last body."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "specpair_runtime", "gate", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    body: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                    body = json.loads(r.read())
            except urllib.error.HTTPError as error:
                body = json.loads(error.read() or b"{}")
            except OSError:
                body = {}
            if body.get("phase") in ("ready", "failed"):
                return body
            time.sleep(0.5)
        raise AssertionError(f"the gate never settled; last {body}:\n{log.read_text()}")
    finally:
        stop_group(process, grace=15)
