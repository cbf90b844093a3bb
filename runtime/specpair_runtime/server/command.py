"""``specpair-runtime serve --config FILE``: flags override the file."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from specpair_runtime.config import (
    PrefillOrder,
    RuntimeConfig,
    load_runtime_config,
    parse_runtime_config,
)

if TYPE_CHECKING:
    from specpair_runtime.server.state import ServerState

log = logging.getLogger("specpair.server")

# flag dest -> key under `serving` in the config file
SERVING_FLAGS = {
    "host": "host",
    "port": "port",
    "max_batch_size": "maxBatchSize",
    "max_model_length": "maxModelLength",
    "max_waiting_requests": "maxWaitingRequests",
    "api_key_file": "apiKeyFile",
    "golden_prompts_file": "goldenPromptsFile",
    "drain_timeout_seconds": "drainTimeoutSeconds",
    "max_request_body_bytes": "maxRequestBodyBytes",
    "header_timeout_seconds": "headerTimeoutSeconds",
    "body_timeout_seconds": "bodyTimeoutSeconds",
    "cpu_threads": "cpuThreads",
    "prefill_order": "prefillOrder",
    "prefix_reuse": "prefixReuse",
}


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    serve = subparsers.add_parser("serve", help="serve the pair over an OpenAI-compatible API")
    serve.add_argument("--config", type=Path, required=True, metavar="FILE", help="runtime config")
    serve.add_argument("--host", help="address to bind (serving.host)")
    serve.add_argument("--port", type=int, help="port to bind (serving.port)")
    serve.add_argument("--max-batch-size", type=int, metavar="N", help="serving.maxBatchSize")
    serve.add_argument("--max-model-length", type=int, metavar="N", help="serving.maxModelLength")
    serve.add_argument(
        "--max-waiting-requests", type=int, metavar="N", help="serving.maxWaitingRequests"
    )
    serve.add_argument("--api-key-file", metavar="FILE", help="serving.apiKeyFile")
    serve.add_argument("--golden-prompts-file", metavar="FILE", help="serving.goldenPromptsFile")
    serve.add_argument(
        "--drain-timeout-seconds", type=float, metavar="S", help="serving.drainTimeoutSeconds"
    )
    serve.add_argument(
        "--max-request-body-bytes", type=int, metavar="N", help="serving.maxRequestBodyBytes"
    )
    serve.add_argument(
        "--header-timeout-seconds", type=float, metavar="S", help="serving.headerTimeoutSeconds"
    )
    serve.add_argument(
        "--body-timeout-seconds", type=float, metavar="S", help="serving.bodyTimeoutSeconds"
    )
    serve.add_argument(
        "--prefill-order",
        choices=get_args(PrefillOrder),
        help="which waiting prompt reads first (serving.prefillOrder)",
    )
    serve.add_argument(
        "--prefix-reuse",
        action=argparse.BooleanOptionalAction,
        help="start a request after the prompt prefix a KV slot still holds (serving.prefixReuse)",
    )
    serve.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present)")
    serve.add_argument(
        "--cpu-threads", type=int, metavar="N", help="threads for CPU kernels (serving.cpuThreads)"
    )
    serve.add_argument(
        "--reload-interval", type=float, default=2.0, metavar="S",
        help="seconds between config file checks for live knob changes",
    )  # fmt: skip
    serve.set_defaults(handler=cmd_serve)


def apply_overrides(config: RuntimeConfig, overrides: dict[str, object]) -> RuntimeConfig:
    """The config with flag values (dest -> value, None = not given) merged into serving.

    Re-validated as a whole, so a bad flag value is reported under its field name.
    """
    wire = config.to_wire()
    serving = dict(wire.get("serving") or {})  # type: ignore[call-overload]
    for dest, key in SERVING_FLAGS.items():
        value = overrides.get(dest)
        if value is not None:
            serving[key] = value
    wire["serving"] = serving
    return parse_runtime_config(wire)


def cmd_serve(args: argparse.Namespace) -> int:
    # Imported here: `--help` and the other commands must not pay for them.
    from specpair_runtime.cpu_threads import apply_cpu_threads
    from specpair_runtime.hardware import cpu_info
    from specpair_runtime.server.runner import build_server
    from specpair_runtime.server.startup import start_loader, stop_serving
    from specpair_runtime.server.state import ServerState

    logging.getLogger("specpair").setLevel(logging.INFO)
    config = apply_overrides(load_runtime_config(args.config), vars(args))
    serving = config.serving
    state = ServerState(config, config_path=args.config, device=args.device)
    # Before any other thread starts: the engine and loader threads inherit the count.
    threads, why = apply_cpu_threads(serving.cpu_threads)
    state.metrics.cpu_threads.set(threads)
    log.info("cpu threads: %d (%s)", threads, why)
    cpu = cpu_info()
    state.metrics.cpu.info(
        {key: str(v).lower() if isinstance(v, bool) else str(v) for key, v in cpu.items()}
    )
    log.info(
        "cpu: %s (%s, %s)",
        cpu["cpu_model"],
        cpu["cpu_isa"],
        "native bf16 GEMM" if cpu["bf16_gemm"] else "no native bf16 GEMM",
    )
    start_key_watcher(state, args.reload_interval)
    server = build_server(state, serving.host, serving.port)
    start_loader(state, args.reload_interval)
    log.info("serving pair %s on %s:%d", config.pair.name, serving.host, serving.port)
    try:
        server.run()
    finally:
        stop_serving(state)
        if state.key_watcher is not None:
            state.key_watcher.stop()
    if state.forced_stop:
        log.error("stopped by a second signal before the drain finished")
        return 1
    return 0


def start_key_watcher(state: ServerState, interval_seconds: float) -> None:
    """Load the API key file, if any, and watch it for rotation."""
    from specpair_runtime.server.auth import KeyFileWatcher, KeyRing, load_key_file

    path = state.config.serving.api_key_file
    if path is None:
        return
    state.api_keys = KeyRing(load_key_file(Path(path)))
    state.key_watcher = KeyFileWatcher(Path(path), state.api_keys, interval_seconds)
    state.key_watcher.start()
