"""Engine sizing and serving options (how big the KV storage is, the per-step token budget)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpair_runtime.config import PrefillOrder, ServingOptions
from specpair_runtime.engine.budget import StepBudget

# Where the per-step token budget starts when none is configured (it is then
# measured, see budget.py). On the CPU one prefill token of a 1.5B model costs
# about as much as one decode row; a GPU is memory-bound far longer (vLLM's
# default for chunked prefill).
DEFAULT_STEP_TOKENS_CPU = 32
DEFAULT_STEP_TOKENS_CUDA = 2048
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
        None measures it (``budget.py``), starting from
        ``DEFAULT_STEP_TOKENS_CPU`` / ``..._CUDA`` by device.
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

    max_slots: int = 8
    max_length: int = 2048
    max_step_tokens: int | None = None
    cuda_graphs: bool = True
    cuda_graph_compile: bool = False
    prefill_order: PrefillOrder = "shortest-first"
    prefix_reuse: bool = True

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")

    def step_budget(self, device: torch.device) -> StepBudget:
        """The configured budget (fixed), or a measured one starting at the device default."""
        if self.max_step_tokens is not None:
            ceiling = self.max_step_tokens * IDLE_PREFILL_FACTOR
            return StepBudget(self.max_step_tokens, ceiling, fixed=True)
        start = DEFAULT_STEP_TOKENS_CUDA if device.type == "cuda" else DEFAULT_STEP_TOKENS_CPU
        return StepBudget(start, start * IDLE_PREFILL_FACTOR)

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
