"""``vllm serve``'s arguments for a pair (pure): the target, the draft, the parallelism.

Everything here is derived from the pair; `api.VLLM_OWNED_FLAGS` refuses the
same flags in ``spec.vllm.extraArgs``. The speculative config is vLLM's
``draft_model`` method: the draft, ``num_speculative_tokens`` (the pair's
``speculation.maxDepth``), ``draft_tensor_parallel_size`` (the target's: vLLM
0.32's draft-model proposer refuses any other), and, where
``speculation.disableAboveBatchSize`` is below ``serving.maxBatchSize``, the
depth table by batch size (``num_speculative_tokens_per_batch_size``): the
full depth up to that batch size, no drafts above it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specpair_operator.api import PairModel, SpeculativePairSpec
from specpair_runtime.planner import Plan

MODELS_DIR = "/models"  # pvc://claim/path is mounted at /models/<claim>/<path>
MASTER_PORT = 29501  # vLLM's torch.distributed rendezvous between the nodes of a group
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"  # set by the LeaderWorkerSet controller
WORKER_INDEX = "$(LWS_WORKER_INDEX)"


@dataclass(frozen=True)
class Layout:
    """How the pair's GPUs are laid out: TP over ``nodes`` pods of ``gpus_per_pod``."""

    tensor_parallel_size: int
    nodes: int
    gpus_per_pod: int
    gpu_memory_utilization: float | None  # None: vLLM's default (no plan)
    cpu_kv_cache_gib: int | None  # the CPU build's KV space (VLLM_CPU_KVCACHE_SPACE)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


GIB = 1024**3


def layout(spec: SpeculativePairSpec, plan: Plan | None, per_node: int | None) -> Layout:
    """The layout from the plan where there is one; else from the spec and the nodes."""
    gpus = spec.resources.gpus
    if plan is not None and plan.parallel is not None:
        parallel = plan.parallel
        kv = None if gpus else -(-parallel.kv_cache_bytes // GIB)
        utilization = parallel.gpu_memory_utilization if gpus else None
        return Layout(gpus, parallel.nodes, parallel.gpus_per_node, utilization, kv)
    nodes = 1 if per_node is None or gpus <= per_node else -(-gpus // per_node)
    return Layout(gpus, nodes, gpus if nodes == 1 else per_node or gpus, None, None)


def model_reference(model: PairModel) -> tuple[str, str | None]:
    """(what vLLM loads, its revision): a path in the pod, or a Hugging Face repo id."""
    source = model.source
    if source.startswith("hf://"):
        repo, _, at = source.removeprefix("hf://").strip("/").partition("@")
        return repo, (at or model.revision)
    if source.startswith("pvc://"):
        return f"{MODELS_DIR}/{source.removeprefix('pvc://').strip('/')}", None
    return source, None


def depth_table(spec: SpeculativePairSpec) -> list[list[int]] | None:
    """vLLM's depth by batch size, where the knobs give one."""
    above = spec.speculation.disable_above_batch_size
    largest = spec.serving.max_batch_size
    if above is None or above >= largest:
        return None
    return [[1, above, spec.speculation.max_depth], [above + 1, largest, 0]]


def speculative_config(spec: SpeculativePairSpec, tensor_parallel_size: int) -> dict[str, Any]:
    draft, revision = model_reference(spec.draft)
    config: dict[str, Any] = {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": spec.speculation.max_depth,
        "draft_tensor_parallel_size": max(tensor_parallel_size, 1),
    }
    if revision:
        config["revision"] = revision
    table = depth_table(spec)
    if table is not None:
        config["num_speculative_tokens_per_batch_size"] = table
    return config


def speculates(spec: SpeculativePairSpec, plan: Plan | None) -> bool:
    """vLLM loads the draft: speculation is on and the plan (if any) has room for it."""
    return spec.speculation.enabled and (plan is None or plan.mode == "Colocated")


def serve_args(
    name: str, spec: SpeculativePairSpec, shape: Layout, *, speculate: bool
) -> list[str]:
    """The arguments of ``vllm serve`` on the leader (or the only) node."""
    target, revision = model_reference(spec.target)
    args = [target, "--host", "0.0.0.0", "--port", str(spec.serving.port)]
    args += ["--served-model-name", name]
    if revision:
        args += ["--revision", revision]
    args += ["--tensor-parallel-size", str(max(shape.tensor_parallel_size, 1))]
    args += ["--max-model-len", str(spec.serving.max_model_length)]
    args += ["--max-num-seqs", str(spec.serving.max_batch_size)]
    args += ["--dtype", spec.target.dtype]
    if shape.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{shape.gpu_memory_utilization:g}"]
    if speculate:
        config = speculative_config(spec, shape.tensor_parallel_size)
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    if shape.multi_node:
        args += ["--distributed-executor-backend", "mp", "--nnodes", str(shape.nodes)]
        args += ["--node-rank", "0", "--master-addr", LEADER_ADDRESS]
        args += ["--master-port", str(MASTER_PORT)]
    vllm = spec.vllm
    return args + (list(vllm.extra_args) if vllm is not None else [])


def worker_args(leader_args: list[str]) -> list[str]:
    """A worker node's arguments: the leader's, with its own rank, and no API server."""
    args = list(leader_args)
    args[args.index("--node-rank") + 1] = WORKER_INDEX
    return [*args, "--headless"]
