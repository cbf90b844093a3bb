"""Everything one server process holds, shared by the routes and the loader."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpair_runtime.config import RuntimeConfig
from specpair_runtime.engine.grammar import GrammarCompiler
from specpair_runtime.server.auth import KeyFileWatcher, KeyRing
from specpair_runtime.server.filters import OutputFilter, build_filter
from specpair_runtime.server.memory import MemoryProbe
from specpair_runtime.server.metrics import ServerMetrics
from specpair_runtime.server.readiness import Readiness
from specpair_runtime.server.reload import ConfigWatcher
from specpair_runtime.server.scheduler import Scheduler
from specpair_runtime.server.token_pieces import TokenPieces


@dataclass
class ServerState:
    config: RuntimeConfig
    config_path: Path | None = None
    api_keys: KeyRing | None = None  # None: no key file, every caller is anonymous
    device: str | None = None  # None: CUDA when present, else the CPU
    readiness: Readiness = field(default_factory=Readiness)
    metrics: ServerMetrics = field(init=False)
    output_filter: OutputFilter = field(init=False)
    probe: MemoryProbe | None = None
    # Set by the loader once the pair is ready to serve.
    scheduler: Scheduler | None = None
    tokenizer: Any = None
    max_model_length: int = 0
    max_prompt_chars: int | None = None  # None until the tokenizer is known
    token_pieces: TokenPieces | None = None  # each token's bytes and name, for logprobs
    grammars: GrammarCompiler | None = None  # structured outputs, built with the engine
    grammars_unavailable: str | None = None  # why the compiler could not be built
    vocab_size: int = 0  # the target's logits width (token ids a request may name)
    watcher: ConfigWatcher | None = None
    key_watcher: KeyFileWatcher | None = None
    loader: threading.Thread | None = None
    # Graceful shutdown: in-flight /v1 requests, and the drain flag.
    draining: bool = False
    drain_started: asyncio.Event = field(default_factory=asyncio.Event)  # wakes body reads
    in_flight: int = 0
    idle: asyncio.Event | None = None
    forced_stop: bool = False  # a second signal cut the drain short: exit non-zero

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.config.pair.name, self.config.pair.version)
        self.output_filter = build_filter(self.config.serving.output_filter)
        self.max_model_length = self.config.serving.max_model_length

    @property
    def model_id(self) -> str:
        return self.config.pair.name
