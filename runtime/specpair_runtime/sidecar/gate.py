"""The gate sidecar: the pair checks of ``serve``'s start-up, for an engine that is not ours.

``specpair-runtime gate --config gate.yaml`` runs beside vLLM in the pair's
pod (the specpair runtime image, a second container). Its ``/readyz`` is the
pod's readiness, with the runtime's body (``ready``, ``phase``, ``reason``),
so the operator reads a vLLM pod exactly as it reads its own:

1. ``checking_alignment``: the target's and the draft's tokenizers, read
   from the model files (tokenizer files only for ``hf://``), must agree on
   the vocabulary, the special tokens and the chat template
   (``engine/alignment.py``). This runs while vLLM is still loading.
2. ``loading``: wait for vLLM's ``/health`` (``engineStartTimeoutSeconds``).
3. ``golden_prompts``: the golden file through vLLM's OpenAI API
   (`golden_api.py`).
4. ``ready`` while vLLM's ``/health`` answers; ``failed`` (final) with the
   reason when a check fails, so the operator rolls the revision back and
   names the check. The failure also goes to the termination-log file, where
   the kubelet picks it up should the container be restarted.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from specpair_runtime.config import GateConfig, ModelSpec
from specpair_runtime.golden import load_golden
from specpair_runtime.server.readiness import Readiness
from specpair_runtime.sidecar.golden_api import EngineClient, run_golden_api
from specpair_runtime.termination import write_termination_message

log = logging.getLogger("specpair_runtime.gate")

HEALTH_POLL_SECONDS = 2.0
# The files a tokenizer needs; an hf:// model is not downloaded whole for them.
TOKENIZER_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*"]


def _tokenizer(spec: ModelSpec) -> Any:
    from transformers import AutoTokenizer

    from specpair_runtime.engine.loading import download_hf, resolve_source

    if spec.source.startswith("hf://"):
        directory = download_hf(spec.source, spec.revision, None, allow=TOKENIZER_FILES)
    else:
        directory = resolve_source(spec).directory
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def alignment_problem(config: GateConfig) -> str | None:
    """Why the draft cannot speculate for the target, or None (also without a draft)."""
    if config.draft is None:
        return None
    from specpair_runtime.engine.alignment import check_alignment

    try:
        report = check_alignment(_tokenizer(config.target), _tokenizer(config.draft))
    except Exception as error:  # a model that cannot be read fails the check, with why
        return f"cannot read the tokenizers: {type(error).__name__}: {error}"
    return report.refusal_reason


def wait_for_engine(client: EngineClient, timeout: float, stop: threading.Event) -> bool:
    deadline = time.monotonic() + timeout
    while not stop.is_set() and time.monotonic() < deadline:
        if client.healthy():
            return True
        stop.wait(HEALTH_POLL_SECONDS)
    return False


class Gate:
    """The checks, in a thread; `readiness` is what ``/readyz`` reports."""

    def __init__(self, config: GateConfig, client: EngineClient) -> None:
        self.config, self.client = config, client
        self.readiness = Readiness()
        self.stop = threading.Event()

    def fail(self, reason: str) -> None:
        log.error(f"gate failed: {reason}")
        self.readiness.set("failed", reason)
        write_termination_message(reason)

    def run(self) -> None:
        config = self.config
        self.readiness.set("checking_alignment", "comparing the target's and draft's tokenizers")
        problem = alignment_problem(config)
        if problem is not None:
            self.fail(problem)
            return
        self.readiness.set("loading", f"waiting for the engine at {config.engine_url}/health")
        if not wait_for_engine(self.client, config.engine_start_timeout_seconds, self.stop):
            if not self.stop.is_set():
                self.fail(
                    f"the engine did not answer {config.engine_url}/health within "
                    f"{config.engine_start_timeout_seconds:g} s"
                )
            return
        if config.golden_prompts_file is not None:
            self.readiness.set("golden_prompts", "running the golden prompts through the engine")
            golden = load_golden(Path(config.golden_prompts_file))
            outcome = run_golden_api(golden, self.client, cuda=config.cuda)
            for note in outcome.notes():
                log.warning(f"golden: {note}")
            if not outcome.passed:
                self.fail("golden prompts failed: " + "; ".join(outcome.failures()))
                return
        self.readiness.set("ready", "alignment and golden prompts passed")
        log.info("gate: ready")

    def body(self) -> tuple[int, dict[str, object]]:
        state = self.readiness.state
        if state.ready and not self.client.healthy():
            body = {"ready": False, "phase": "loading", "reason": "the engine's /health fails"}
            return 503, body
        return (200 if state.ready else 503), state.body()


def _handler(gate: Gate) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/readyz":
                status, body = gate.body()
            elif self.path == "/healthz":
                status, body = 200, {"alive": True}
            else:
                status, body = 404, {"error": f"no route {self.path}"}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return  # probes every few seconds; the checks log what matters

    return Handler


def serve_gate(config: GateConfig, *, install_signals: Callable[[Callable[[], None]], None]) -> int:
    """Run the checks and serve ``/readyz`` until SIGTERM; exit 0."""
    api_key = os.environ.get(config.api_key_env) if config.api_key_env else None
    client = EngineClient(
        config.engine_url, config.served_model_name, api_key, config.request_timeout_seconds
    )
    gate = Gate(config, client)
    server = ThreadingHTTPServer((config.host, config.port), _handler(gate))
    server.daemon_threads = True

    def shut_down() -> None:
        gate.stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    install_signals(shut_down)
    checks = threading.Thread(target=gate.run, name="gate-checks", daemon=True)
    checks.start()
    log.info(f"gate for {config.pair.name} on {config.host}:{config.port}")
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
    return 0
