"""The VRAM headroom planner: does the draft fit next to the target?

A contract module (torch-free): the operator calls it before it co-locates
the draft with the target, and ``python -m specpair_operator plan`` calls it
offline for capacity planning. It is a pure function of its inputs.

The estimate per model is

    weights  = parameters × bytes per weight (dtype, or 1 byte for int8)
    KV cache = 2 (K and V) × layers × kv_heads × head_dim × bytes per element × tokens

with ``tokens = max_batch_size × max_model_length`` (every running request
may reach the full length) and the KV cache kept in the compute dtype. On top
of that the plan charges ``RUNTIME_OVERHEAD_BYTES`` once per process and
``DRAFT_OVERHEAD_BYTES`` when the draft is loaded (see their comments).

The plan must leave ``headroom_fraction`` of the device free. It never
splits the pair across devices: moving activations between devices every
speculation step erases the gain, so a draft that does not fit is dropped
(``TargetOnly``), never moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from specpair_runtime.config import Dtype, Quantization

GIB = 1024**3

# CUDA context (~0.3-0.5 GiB), cuBLAS/cuDNN workspaces, the PyTorch caching
# allocator's fragmentation and the activations of one batched forward pass
# (logits over the vocabulary dominate). Measured process overheads of
# HF-transformers serving sit between 0.6 and 1 GiB; 1 GiB is the round,
# conservative figure.
RUNTIME_OVERHEAD_BYTES = 1 * GIB
# A second model adds its own activations, logits and the draft's sampling
# buffers to the same process; a quarter GiB covers a <=3B draft.
DRAFT_OVERHEAD_BYTES = GIB // 4

Mode = Literal["Colocated", "TargetOnly", "DoesNotFit"]

_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
# Bytes per parameter of a quantized draft: int8 codes; int4 codes plus the
# dequantized bf16 copy that calls of many rows run (engine/int4_linears.py).
QUANTIZED_WEIGHT_BYTES: dict[str, float] = {"int8-dynamic": 1, "int4-weight": 2.5}


def dtype_bytes(dtype: Dtype, *, cuda: bool = True) -> int:
    """Bytes per element; ``auto`` is bfloat16 on CUDA and float32 on the CPU (as the runtime)."""
    if dtype == "auto":
        return 2 if cuda else 4
    return _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelGeometry:
    """The size hints of one model (from its config.json)."""

    parameters: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: Dtype = "auto"
    quantization: Quantization = "none"

    def __post_init__(self) -> None:
        for name in ("parameters", "layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ModelEstimate:
    """Memory one model needs on the device."""

    weights_bytes: int
    kv_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


@dataclass(frozen=True)
class Plan:
    """The placement decision. ``headroom_bytes`` is what stays free (negative: short)."""

    mode: Mode
    required_bytes: int
    device_bytes: int
    headroom_bytes: int
    reason: str
    target: ModelEstimate
    draft: ModelEstimate
    overhead_bytes: int

    @property
    def speculation_possible(self) -> bool:
        return self.mode == "Colocated"


def estimate(model: ModelGeometry, tokens: int, *, cuda: bool = True) -> ModelEstimate:
    """Weights plus full-length KV cache for ``tokens`` cached tokens."""
    compute_bytes = dtype_bytes(model.dtype, cuda=cuda)
    weight_bytes = QUANTIZED_WEIGHT_BYTES.get(model.quantization, compute_bytes)
    kv_per_token = 2 * model.layers * model.kv_heads * model.head_dim * compute_bytes
    return ModelEstimate(
        weights_bytes=int(model.parameters * weight_bytes), kv_cache_bytes=kv_per_token * tokens
    )


def gib(value: int) -> str:
    """Bytes as GiB with two decimals, e.g. ``3.10 GiB``."""
    return f"{value / GIB:.2f} GiB"


def plan(
    target: ModelGeometry,
    draft: ModelGeometry,
    *,
    max_batch_size: int,
    max_model_length: int,
    device_bytes: int,
    headroom_fraction: float = 0.1,
    cuda: bool = True,
) -> Plan:
    """Place the pair on one device of ``device_bytes``, keeping ``headroom_fraction`` free."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if max_model_length < 1:
        raise ValueError(f"max_model_length must be >= 1, got {max_model_length}")
    if device_bytes < 1:
        raise ValueError(f"device_bytes must be >= 1, got {device_bytes}")
    if not 0.0 <= headroom_fraction < 1.0:
        raise ValueError(f"headroom_fraction must be in [0, 1), got {headroom_fraction}")
    tokens = max_batch_size * max_model_length
    target_est = estimate(target, tokens, cuda=cuda)
    draft_est = estimate(draft, tokens, cuda=cuda)
    # Round the reserve up so that "fits" never rests on a rounded-down byte.
    usable = device_bytes - math.ceil(device_bytes * headroom_fraction)
    target_only = target_est.total_bytes + RUNTIME_OVERHEAD_BYTES
    pair = target_only + draft_est.total_bytes + DRAFT_OVERHEAD_BYTES
    budget = f"{gib(usable)} usable ({gib(device_bytes)} less {headroom_fraction:.0%} headroom)"

    def result(mode: Mode, required: int, overhead: int, reason: str) -> Plan:
        return Plan(
            mode=mode,
            required_bytes=required,
            device_bytes=device_bytes,
            headroom_bytes=device_bytes - required,
            reason=reason,
            target=target_est,
            draft=draft_est,
            overhead_bytes=overhead,
        )

    both_overhead = RUNTIME_OVERHEAD_BYTES + DRAFT_OVERHEAD_BYTES
    if pair <= usable:
        reason = f"target and draft fit: need {gib(pair)} of {budget}"
        return result("Colocated", pair, both_overhead, reason)
    if target_only <= usable:
        reason = (
            f"draft needs {gib(pair - usable)} more: the pair needs {gib(pair)} "
            f"but only {budget}; speculation is off"
        )
        return result("TargetOnly", target_only, RUNTIME_OVERHEAD_BYTES, reason)
    reason = (
        f"target needs {gib(target_only - usable)} more: it alone needs {gib(target_only)} "
        f"but only {budget}"
    )
    return result("DoesNotFit", target_only, RUNTIME_OVERHEAD_BYTES, reason)
