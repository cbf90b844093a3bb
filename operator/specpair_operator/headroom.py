"""Headroom: how much memory one device has, and the VRAM plan for a spec.

The device memory comes from ``spec.resources.gpuMemory`` when set. Else it
is the smallest ``nvidia.com/gpu.memory`` label (MiB, set by GPU feature
discovery) among the Ready, schedulable nodes that the pair's nodeSelector,
tolerations and required node affinity admit: a pod may land on any of them,
so the plan must hold on the smallest. A NotReady or cordoned node takes no
new pods, so it does not count. With ``gpus: 0`` (CPU mode) the device is the pod's
``resources.memory``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from specpair_operator.api import (
    QUANTITY_PATTERN,
    QUANTITY_SUFFIXES,
    PairModel,
    SpeculativePairSpec,
    Toleration,
)
from specpair_runtime.planner import ModelGeometry, ParallelRequest, Plan, plan, plan_parallel

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
# GPU feature discovery's count of a node's GPUs (engine vllm: GPUs one pod may take).
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
MIB = 1024**2

_QUANTITY = re.compile(QUANTITY_PATTERN)  # the CRD's own pattern: (number)(fraction)(suffix)


def parse_quantity(text: str, *, field: str = "quantity") -> int:
    """A Kubernetes quantity as a whole number of bytes (rounded down)."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise ValueError(f"{field}: {text!r} is not a quantity such as 80Gi or 81920Mi")
    number, suffix = match.group(1), match.group(3) or ""
    return int(Decimal(number) * QUANTITY_SUFFIXES[suffix])


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one device, and where that number came from."""

    bytes: int
    source: str
    cuda: bool
    gpus_per_node: int | None = None  # engine vllm: GPUs one node gives a pod, when known


def _tolerates(taint: Mapping[str, Any], tolerations: Sequence[Toleration]) -> bool:
    effect = taint.get("effect")
    if effect == "PreferNoSchedule":
        return True
    for tol in tolerations:
        if tol.effect is not None and tol.effect != effect:
            continue
        if tol.operator == "Exists" and (tol.key is None or tol.key == taint.get("key")):
            return True
        same_value = (tol.value or "") == (taint.get("value") or "")
        if tol.operator == "Equal" and tol.key == taint.get("key") and same_value:
            return True
    return False


def _expression_matches(labels: Mapping[str, str], expr: Mapping[str, Any]) -> bool:
    key, op, values = expr.get("key", ""), expr.get("operator"), expr.get("values") or []
    present = key in labels
    if op == "In":
        return present and labels[key] in values
    if op == "NotIn":
        return not present or labels[key] not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and values:
        try:
            left, right = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return left > right if op == "Gt" else left < right
    return False


def _affinity_admits(labels: Mapping[str, str], affinity: Mapping[str, Any] | None) -> bool:
    required = ((affinity or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    # Terms are ORed; the expressions inside one term are ANDed.
    return any(
        all(_expression_matches(labels, e) for e in term.get("matchExpressions") or [])
        for term in terms
    )


def node_admits(node: Mapping[str, Any], spec: SpeculativePairSpec) -> bool:
    """Whether the scheduler could place one of the pair's pods on ``node``."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    selector = spec.scheduling.node_selector
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    taints = (node.get("spec") or {}).get("taints") or []
    hard = [t for t in taints if t.get("effect") in ("NoSchedule", "NoExecute")]
    if not all(_tolerates(t, spec.scheduling.tolerations) for t in hard):
        return False
    return _affinity_admits(labels, spec.scheduling.affinity)


def node_usable(node: Mapping[str, Any]) -> bool:
    """Ready and schedulable: a node the scheduler would place a new pod on."""
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    if (node.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def device_memory(
    spec: SpeculativePairSpec, nodes: Iterable[Mapping[str, Any]] = ()
) -> DeviceMemory | None:
    """The device the plan must fit; None when nothing says how large it is."""
    nodes = list(nodes)
    res = spec.resources
    per_node = gpus_per_node(spec, nodes) if spec.engine == "vllm" else None
    if res.gpus == 0:
        if res.memory is None:
            return None
        return DeviceMemory(
            parse_quantity(res.memory, field="spec.resources.memory"),
            "spec.resources.memory",
            cuda=False,
        )
    if res.gpu_memory is not None:
        return DeviceMemory(
            parse_quantity(res.gpu_memory, field="spec.resources.gpuMemory"),
            "spec.resources.gpuMemory",
            cuda=True,
            gpus_per_node=per_node,
        )
    sizes: list[tuple[int, str]] = []
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        value = labels.get(GPU_MEMORY_LABEL)
        if value is None or not node_usable(node) or not node_admits(node, spec):
            continue
        try:
            sizes.append((int(value) * MIB, node["metadata"]["name"]))
        except ValueError:
            continue  # a malformed label says nothing about the memory
    if not sizes:
        return None
    smallest, name = min(sizes)
    source = f"node {name} label {GPU_MEMORY_LABEL}"
    return DeviceMemory(smallest, source, cuda=True, gpus_per_node=per_node)


def geometry(model: PairModel) -> ModelGeometry:
    return ModelGeometry(
        parameters=model.size.parameters,
        layers=model.size.layers,
        kv_heads=model.size.kv_heads,
        head_dim=model.size.head_dim,
        dtype=model.dtype,
        quantization=model.quantization,
    )


def gpus_per_node(spec: SpeculativePairSpec, nodes: Iterable[Mapping[str, Any]] = ()) -> int | None:
    """GPUs one node gives a pod: the spec's, else the smallest count label; None: unknown."""
    if spec.resources.gpus_per_node is not None:
        return spec.resources.gpus_per_node
    counts: list[int] = []
    for node in nodes:
        value = ((node.get("metadata") or {}).get("labels") or {}).get(GPU_COUNT_LABEL)
        if value is None or not node_usable(node) or not node_admits(node, spec):
            continue
        try:
            counts.append(int(value))
        except ValueError:
            continue  # a malformed label says nothing
    return min(counts) if counts else None


def parallel_request(
    spec: SpeculativePairSpec, device_bytes: int, *, cuda: bool, per_node: int | None
) -> ParallelRequest:
    """What vLLM's layout of ``spec`` is planned from (engine vllm)."""
    gpus = max(spec.resources.gpus, 1)
    return ParallelRequest(
        tensor_parallel_size=gpus,
        draft_tensor_parallel_size=gpus,  # vLLM's draft_model shards the draft like the target
        max_batch_size=spec.serving.max_batch_size,
        max_model_length=spec.serving.max_model_length,
        device_bytes=device_bytes,
        headroom_fraction=spec.resources.headroom_fraction,
        gpus_per_node=per_node,
        speculative_tokens=spec.speculation.max_depth,
        cuda=cuda,
    )


def plan_for_spec(
    spec: SpeculativePairSpec, device: DeviceMemory, *, per_node: int | None = None
) -> Plan:
    """The VRAM plan of ``spec`` on ``device`` (per GPU for engine vllm)."""
    if spec.engine == "vllm":
        known = spec.resources.gpus_per_node or per_node or device.gpus_per_node
        request = parallel_request(spec, device.bytes, cuda=device.cuda, per_node=known)
        return plan_parallel(geometry(spec.target), geometry(spec.draft), request)
    return plan(
        geometry(spec.target),
        geometry(spec.draft),
        max_batch_size=spec.serving.max_batch_size,
        max_model_length=spec.serving.max_model_length,
        device_bytes=device.bytes,
        headroom_fraction=spec.resources.headroom_fraction,
        cuda=device.cuda,
    )
