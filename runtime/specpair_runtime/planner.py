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
    # vLLM's layout (engine vllm): the byte counts above are then per GPU.
    parallel: ParallelLayout | None = None

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


@dataclass(frozen=True)
class _Verdict:
    mode: Mode
    required_bytes: int
    overhead_bytes: int
    reason: str


def _fit_verdict(
    pair: int,
    target_only: int,
    usable: int,
    budget: str,
    *,
    pair_overhead: int,
    target_overhead: int,
    layout: str = "",
    hint: str = "",
    problem: str | None = None,
) -> _Verdict:
    """Which of the pair fits in ``usable`` bytes, and why, in words that name the bytes.

    ``layout`` (" with TP 2") and ``hint`` (where it would fit instead) go into the
    reason; ``problem``: the GPUs cannot be laid out at all.
    """
    if problem is not None:
        return _Verdict("DoesNotFit", pair, pair_overhead, problem + hint)
    if pair <= usable:
        reason = f"target and draft fit{layout}: need {gib(pair)} of {budget}"
        return _Verdict("Colocated", pair, pair_overhead, reason)
    if target_only <= usable:
        reason = (
            f"draft needs {gib(pair - usable)} more{layout}: the pair needs {gib(pair)} "
            f"but only {budget}; speculation is off{hint}"
        )
        return _Verdict("TargetOnly", target_only, target_overhead, reason)
    reason = (
        f"target needs {gib(target_only - usable)} more{layout}: it alone needs "
        f"{gib(target_only)} but only {budget}{hint}"
    )
    return _Verdict("DoesNotFit", target_only, target_overhead, reason)


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

    verdict = _fit_verdict(
        pair,
        target_only,
        usable,
        budget,
        pair_overhead=RUNTIME_OVERHEAD_BYTES + DRAFT_OVERHEAD_BYTES,
        target_overhead=RUNTIME_OVERHEAD_BYTES,
    )
    return result(verdict.mode, verdict.required_bytes, verdict.overhead_bytes, verdict.reason)


# --- vLLM's layout: tensor parallelism over one or more nodes -----------------------------
#
# Per GPU, vLLM holds the target's weights divided by the tensor-parallel size (TP), the
# draft's divided by its own TP (1: a full copy on every GPU; or the target's TP), both KV
# caches for the pair's context and batch (a model's KV heads are split across the ranks;
# where there are fewer KV heads than ranks, each rank keeps one), and a reserve that
# vLLM's memory profile charges before it sizes its KV pool:

# CUDA context, NCCL and custom all-reduce buffers, cuBLAS workspaces (non-torch memory).
VLLM_CONTEXT_BYTES = 1 * GIB
# The profiled peak of one max_num_batched_tokens forward (activations, the sampler's logits).
VLLM_ACTIVATION_BYTES = 2 * GIB
# CUDA graphs captured for the decode batch sizes up to max_num_seqs (target and draft).
VLLM_CUDA_GRAPH_BYTES = 1 * GIB
# On the CPU there is no device context nor graphs; two processes (API server and engine
# core) each import torch and vLLM: about 1.5 GiB resident together, plus activations.
VLLM_CPU_PROCESS_BYTES = 3 * GIB // 2
VLLM_CPU_ACTIVATION_BYTES = 1 * GIB
# Tensor-parallel sizes the planner proposes when it searches for the smallest that fits.
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16, 32, 64)
MAX_TENSOR_PARALLEL_SIZE = 64

Layout = Literal["SingleNode", "MultiNode"]


@dataclass(frozen=True)
class ParallelLayout:
    """How vLLM spreads the pair: per-GPU shares, the GPUs, the nodes."""

    tensor_parallel_size: int
    draft_tensor_parallel_size: int
    nodes: int  # pods in one group (1: a Deployment; more: a LeaderWorkerSet)
    gpus_per_node: int
    reserve_bytes: int  # context, activations and graphs, per GPU
    gpu_memory_utilization: float  # vLLM's --gpu-memory-utilization (CUDA)
    kv_cache_bytes: int  # the pair's KV cache per GPU (vLLM's CPU KV space on the CPU)
    smallest_tensor_parallel_size: int | None  # the fewest GPUs with the draft; None: none

    @property
    def layout(self) -> Layout:
        return "SingleNode" if self.nodes == 1 else "MultiNode"


def _heads_per_rank(kv_heads: int, ranks: int) -> int:
    return max(1, kv_heads // ranks)


def sharded_estimate(
    model: ModelGeometry, tokens: int, ranks: int, *, cuda: bool = True
) -> ModelEstimate:
    """One GPU's share of a model split over ``ranks`` tensor-parallel ranks."""
    whole = estimate(model, 0, cuda=cuda)
    compute_bytes = dtype_bytes(model.dtype, cuda=cuda)
    heads = _heads_per_rank(model.kv_heads, ranks)
    kv_per_token = 2 * model.layers * heads * model.head_dim * compute_bytes
    return ModelEstimate(
        weights_bytes=math.ceil(whole.weights_bytes / ranks), kv_cache_bytes=kv_per_token * tokens
    )


def tensor_parallel_problem(model: ModelGeometry, ranks: int, role: str) -> str | None:
    """Why ``model`` cannot be split over ``ranks`` ranks (vLLM splits whole KV heads)."""
    if ranks < 1 or ranks > MAX_TENSOR_PARALLEL_SIZE:
        return f"tensor-parallel size {ranks} is outside 1..{MAX_TENSOR_PARALLEL_SIZE}"
    if model.kv_heads % ranks and ranks % model.kv_heads:
        return (
            f"the {role}'s {model.kv_heads} KV heads cannot be split over {ranks} GPUs: "
            "one must divide the other"
        )
    return None


@dataclass(frozen=True)
class ParallelRequest:
    """What vLLM's layout is planned from, besides the two geometries."""

    tensor_parallel_size: int
    draft_tensor_parallel_size: int
    max_batch_size: int
    max_model_length: int
    device_bytes: int  # one GPU (CUDA) or the pod's memory (CPU)
    headroom_fraction: float = 0.1
    gpus_per_node: int | None = None  # None: unknown, the GPUs are taken to fit one node
    speculative_tokens: int = 4
    cuda: bool = True


def _reserve(cuda: bool, *, draft: bool) -> int:
    if not cuda:
        return VLLM_CPU_PROCESS_BYTES + VLLM_CPU_ACTIVATION_BYTES
    reserve = VLLM_CONTEXT_BYTES + VLLM_ACTIVATION_BYTES + VLLM_CUDA_GRAPH_BYTES
    return reserve + (DRAFT_OVERHEAD_BYTES if draft else 0)


def _per_gpu(
    target: ModelGeometry, draft: ModelGeometry, request: ParallelRequest, tp: int, draft_tp: int
) -> tuple[ModelEstimate, ModelEstimate]:
    # Each running sequence may hold its full length plus the drafted lookahead slots.
    tokens = request.max_batch_size * (request.max_model_length + request.speculative_tokens)
    return (
        sharded_estimate(target, tokens, tp, cuda=request.cuda),
        sharded_estimate(draft, tokens, draft_tp, cuda=request.cuda),
    )


def _usable(request: ParallelRequest) -> int:
    return request.device_bytes - math.ceil(request.device_bytes * request.headroom_fraction)


def _fits_with_draft(
    target: ModelGeometry, draft: ModelGeometry, request: ParallelRequest, tp: int
) -> bool:
    draft_tp = 1 if request.draft_tensor_parallel_size == 1 else tp
    if tensor_parallel_problem(target, tp, "target") or tensor_parallel_problem(
        draft, draft_tp, "draft"
    ):
        return False
    t, d = _per_gpu(target, draft, request, tp, draft_tp)
    need = t.total_bytes + d.total_bytes + _reserve(request.cuda, draft=True)
    return need <= _usable(request)


def smallest_tensor_parallel_size(
    target: ModelGeometry, draft: ModelGeometry, request: ParallelRequest
) -> int | None:
    """The fewest GPUs (a power of two) on which the pair fits with its draft; None: none."""
    for tp in TENSOR_PARALLEL_SIZES:
        if _fits_with_draft(target, draft, request, tp):
            return tp
    return None


def _nodes(request: ParallelRequest) -> tuple[int, int, str | None]:
    """(nodes, GPUs per pod, why the GPUs cannot be spread) for the request's TP."""
    tp, per_node = request.tensor_parallel_size, request.gpus_per_node
    if not request.cuda or per_node is None or tp <= per_node:
        return 1, tp, None
    if tp % per_node:
        return (
            -(-tp // per_node),
            per_node,
            f"{tp} GPUs cannot be spread evenly over nodes of {per_node} GPUs: "
            f"tensor parallelism needs the same GPUs on every node (use a multiple of {per_node})",
        )
    return tp // per_node, per_node, None


def _check(request: ParallelRequest) -> None:
    if request.max_batch_size < 1 or request.max_model_length < 1 or request.device_bytes < 1:
        raise ValueError("max_batch_size, max_model_length and device_bytes must be >= 1")
    if not 0.0 <= request.headroom_fraction < 1.0:
        raise ValueError(f"headroom_fraction must be in [0, 1), got {request.headroom_fraction}")


def _fewest_gpus_hint(request: ParallelRequest, smallest: int | None) -> str:
    """Where the pair would fit instead, for a reason that is not Colocated."""
    if not request.cuda:
        return ""
    if smallest is None:
        return f"; it does not fit with its draft on up to {MAX_TENSOR_PARALLEL_SIZE} such GPUs"
    if smallest != request.tensor_parallel_size:
        return f"; the pair fits with its draft on {smallest} GPUs (resources.gpus: {smallest})"
    return ""


def _parallel_verdict(
    request: ParallelRequest,
    target_est: ModelEstimate,
    draft_est: ModelEstimate,
    problem: str | None,
    hint: str,
    split: str,
) -> _Verdict:
    """Which of the pair fits per GPU, and why, in words that name the bytes."""
    usable = _usable(request)
    reserve_only = _reserve(request.cuda, draft=False)
    reserve_pair = _reserve(request.cuda, draft=True)
    target_only = target_est.total_bytes + reserve_only
    pair = target_est.total_bytes + draft_est.total_bytes + reserve_pair
    where = "per GPU" if request.cuda else "in the pod"
    budget = (
        f"{gib(usable)} usable {where} ({gib(request.device_bytes)} less "
        f"{request.headroom_fraction:.0%} headroom)"
    )
    return _fit_verdict(
        pair,
        target_only,
        usable,
        budget,
        pair_overhead=reserve_pair,
        target_overhead=reserve_only,
        layout=f" with {split}",
        hint=hint,
        problem=problem,
    )


def plan_parallel(target: ModelGeometry, draft: ModelGeometry, request: ParallelRequest) -> Plan:
    """vLLM's layout of the pair: per-GPU memory, tensor parallelism, nodes.

    The plan's byte counts are per GPU. ``Colocated``: target and draft fit on
    every GPU; ``TargetOnly``: only the target does (vLLM then serves without
    speculation); ``DoesNotFit``: not even the target, or the GPUs cannot be
    laid out. Pipeline parallelism is never planned: vLLM does not combine it
    with speculative decoding, so a larger target takes more tensor-parallel
    GPUs, across nodes where one node has too few.
    """
    tp = request.tensor_parallel_size
    draft_tp = request.draft_tensor_parallel_size
    _check(request)
    target_est, draft_est = _per_gpu(target, draft, request, tp, draft_tp)
    smallest = smallest_tensor_parallel_size(target, draft, request)
    nodes, gpus_per_pod, spread_problem = _nodes(request)
    layout = ParallelLayout(
        tensor_parallel_size=tp,
        draft_tensor_parallel_size=draft_tp,
        nodes=nodes,
        gpus_per_node=gpus_per_pod,
        reserve_bytes=_reserve(request.cuda, draft=True),
        gpu_memory_utilization=math.floor(_usable(request) / request.device_bytes * 1000) / 1000,
        kv_cache_bytes=target_est.kv_cache_bytes + draft_est.kv_cache_bytes,
        smallest_tensor_parallel_size=smallest,
    )
    problem = (
        tensor_parallel_problem(target, tp, "target")
        or tensor_parallel_problem(draft, draft_tp, "draft")
        or spread_problem
    )
    split = f"TP {tp}" + (f" over {nodes} nodes of {gpus_per_pod} GPUs" if nodes > 1 else "")
    hint = _fewest_gpus_hint(request, smallest)
    verdict = _parallel_verdict(request, target_est, draft_est, problem, hint, split)
    return Plan(
        mode=verdict.mode,
        required_bytes=verdict.required_bytes,
        device_bytes=request.device_bytes,
        headroom_bytes=request.device_bytes - verdict.required_bytes,
        reason=verdict.reason,
        target=target_est,
        draft=draft_est,
        overhead_bytes=verdict.overhead_bytes,
        parallel=layout,
    )
