"""Engine sizing and serving options (how big the KV storage is, the per-step token budget).

The defaults are the serving options' own (``specpair_runtime.config``), so a
default engine is sized as a default server.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpair_runtime.config import (
    CUDA_GRAPH_COMPILE,
    CUDA_GRAPHS,
    MAX_BATCH_SIZE,
    MAX_MODEL_LENGTH,
    MAX_STEP_TOKENS,
    PREFILL_ORDER,
    PREFIX_REUSE,
    PrefillOrder,
    ServingOptions,
)
from specpair_runtime.engine.budget import StepBudget

# With no stream decoding, nobody waits on the step: prompts may take this
# many budgets at once (fewer, larger chunks cost less in total). It is also
# the ceiling of a measured budget.
IDLE_PREFILL_FACTOR = 8


@dataclass(frozen=True)
class EngineOptions:
    """How the engine sizes its fixed storage and plans its steps.

    max_slots: requests decoded at once (one KV slot each); more wait.
    max_length: prompt + output tokens per request (positions per slot).
    max_step_tokens: tokens per step over all rows (chunked prefill budget);
        None measures it (``budget.py``), starting from the device's
        ``MAX_STEP_TOKENS`` default.
    cuda_graphs: on CUDA, replay uniform decode/verify steps as recorded CUDA
        graphs (``graphs.py``). Ignored on the CPU.
    cuda_graph_compile: record ``torch.compile(mode="reduce-overhead")``'s
        fused step instead of capturing the eager one (minutes of warm-up).
    prefill_order: which prompt reads first (``budget.prefill_order``):
        ``shortest-first``, or ``arrival`` (oldest first).
    prefix_reuse: a new request starts after the longest prefix of its prompt
        whose KV a slot still holds (``prefix_reuse.py``), instead of reading
        the whole prompt.
    """

    max_slots: int = MAX_BATCH_SIZE.default
    max_length: int = MAX_MODEL_LENGTH.default
    max_step_tokens: int | None = None
    cuda_graphs: bool = CUDA_GRAPHS.default
    cuda_graph_compile: bool = CUDA_GRAPH_COMPILE.default
    prefill_order: PrefillOrder = PREFILL_ORDER.default
    prefix_reuse: bool = PREFIX_REUSE.default

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")

    def step_budget(self, device: torch.device) -> StepBudget:
        """The configured budget (fixed), or a measured one starting at the device default."""
        kind = "cuda" if device.type == "cuda" else "cpu"
        tokens = int(MAX_STEP_TOKENS.for_device(self.max_step_tokens, kind))
        ceiling = tokens * IDLE_PREFILL_FACTOR
        return StepBudget(tokens, ceiling, fixed=self.max_step_tokens is not None)

    @staticmethod
    def from_serving(serving: ServingOptions) -> EngineOptions:
        return EngineOptions(
            max_slots=serving.max_batch_size,
            max_length=serving.max_model_length,
            max_step_tokens=serving.max_step_tokens,
            cuda_graphs=serving.cuda_graphs,
            cuda_graph_compile=serving.cuda_graph_compile,
            prefill_order=serving.prefill_order,
            prefix_reuse=serving.prefix_reuse,
        )
