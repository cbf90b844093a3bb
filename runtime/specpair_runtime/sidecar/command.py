"""``specpair-runtime gate --config FILE``: the pair's checks beside vLLM (see `gate.py`)."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specpair_runtime.config import load_gate_config


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    gate = subparsers.add_parser(
        "gate", help="alignment and golden prompts beside another engine; serves /readyz"
    )
    gate.add_argument("--config", type=Path, required=True, metavar="FILE", help="gate config")
    gate.add_argument("--host", help="address to bind (host)")
    gate.add_argument("--port", type=int, help="port to bind (port)")
    gate.set_defaults(handler=cmd_gate)


def _on_sigterm(stop: Callable[[], None]) -> None:
    def handle(signum: int, frame: object) -> None:
        stop()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def cmd_gate(args: argparse.Namespace) -> int:
    from specpair_runtime.sidecar.gate import serve_gate

    logging.getLogger("specpair_runtime").setLevel(logging.INFO)
    config = load_gate_config(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        config = config.model_copy(update=overrides)
    return serve_gate(config, install_signals=_on_sigterm)
