"""Start-up device-memory plan on CUDA: does the draft fit beside the target and its KV?

The operator plans a pair against the size of a GPU before it places it
(``planner.py``). The pod checks again at start-up against the memory it
really has, with the same planner: a GPU shared with other processes, or a
node label that overstates the memory, must not make the pod run out of
memory once requests fill the KV cache.

The plan uses the memory this process can have, that is the device's free
memory plus what the process already holds (the loaded weights sit in it),
and keeps the planner's default headroom of that free. When the pair does
not fit, the server drops the draft and serves target-only; the reason goes
to the log, to the ``specpair_device_plan`` metric and to /readyz. On the CPU
there is no plan: the operator planned the pod's memory limit.

``decide`` is the pure decision (unit-tested with numbers); ``measure`` and
``plan_for_pair`` read the device and the loaded models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specpair_runtime.config import Dtype, ServingOptions
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.pair import LoadedPair
from specpair_runtime.planner import Mode, ModelGeometry, Plan, gib, plan

# The operator's default (SpeculativePair spec.resources.headroomFraction):
# covers activations and allocator fragmentation that the estimate misses.
HEADROOM_FRACTION = 0.1

_DTYPE_NAMES: dict[torch.dtype, Dtype] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


@dataclass(frozen=True)
class DeviceMemory:
    """One device as this process sees it: free and total bytes, and bytes it holds."""

    free_bytes: int
    total_bytes: int
    held_bytes: int

    def __post_init__(self) -> None:
        for name in ("free_bytes", "total_bytes", "held_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.total_bytes < 1:
            raise ValueError(f"total_bytes must be >= 1, got {self.total_bytes}")

    @property
    def available_bytes(self) -> int:
        """What the pair may use: free memory plus what the process already holds."""
        return self.free_bytes + self.held_bytes


@dataclass(frozen=True)
class DevicePlan:
    """The start-up decision: speculate (draft kept) or serve target-only, and why."""

    mode: Mode
    reason: str
    plan: Plan
    memory: DeviceMemory

    @property
    def speculate(self) -> bool:
        return self.mode == "Colocated"


def decide(
    target: ModelGeometry,
    draft: ModelGeometry,
    *,
    max_batch_size: int,
    max_model_length: int,
    memory: DeviceMemory,
    headroom_fraction: float = HEADROOM_FRACTION,
) -> DevicePlan:
    """Plan the pair on the memory that this process can have (the operator's planner)."""
    result = plan(
        target,
        draft,
        max_batch_size=max_batch_size,
        max_model_length=max_model_length,
        device_bytes=max(memory.available_bytes, 1),
        headroom_fraction=headroom_fraction,
        cuda=True,
    )
    measured = (
        f"measured {gib(memory.free_bytes)} free of {gib(memory.total_bytes)}, "
        f"{gib(memory.held_bytes)} held by the loaded models"
    )
    if result.mode == "Colocated":
        reason = f"{result.reason}; {measured}"
    elif result.mode == "TargetOnly":
        reason = f"target-only: {result.reason}; {measured}"
    else:
        reason = f"target-only, and even that may run out of memory: {result.reason}; {measured}"
    return DevicePlan(result.mode, reason, result, memory)


def geometry(loaded: LoadedModel) -> ModelGeometry:
    """A loaded model's size hints: its real parameter count, layers and KV heads."""
    config: Any = loaded.model.config
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return ModelGeometry(
        parameters=sum(p.numel() for p in loaded.model.parameters()),
        layers=int(config.num_hidden_layers),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        dtype=_DTYPE_NAMES.get(loaded.dtype, "auto"),
        quantization=loaded.quantization,
    )


def plan_for_pair(pair: LoadedPair, serving: ServingOptions, memory: DeviceMemory) -> DevicePlan:
    """The plan of a loaded pair (it must have a draft) on ``memory``."""
    if pair.draft is None:
        raise ValueError("plan_for_pair needs a pair with a draft")
    return decide(
        geometry(pair.target),
        geometry(pair.draft),
        max_batch_size=serving.max_batch_size,
        max_model_length=serving.max_model_length,
        memory=memory,
    )


def measure(device: torch.device) -> DeviceMemory:
    """Free and total memory of a CUDA device, and what this process's allocator holds."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(free), int(total), int(torch.cuda.memory_reserved(device)))


def plan_on_device(pair: LoadedPair, serving: ServingOptions) -> DevicePlan | None:
    """Measure and plan on CUDA; None on the CPU or for a pair without a draft."""
    if pair.draft is None or pair.target.device.type != "cuda":
        return None
    return plan_for_pair(pair, serving, measure(pair.target.device))


def drop_draft(pair: LoadedPair) -> None:
    """Drop the pair's draft in place and give its memory back to the device."""
    pair.draft = None
    pair.alignment = None
    if pair.target.device.type == "cuda":
        torch.cuda.empty_cache()
