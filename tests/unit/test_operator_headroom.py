"""Device memory from the spec or from the GPU nodes the pair's scheduling admits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from specpair_operator.api import parse_spec
from specpair_operator.headroom import MIB, device_memory, node_admits, parse_quantity

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load((ROOT / "crds/samples/gpu-pair.yaml").read_text())["spec"]


def node(
    name: str,
    mib: int | None,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    ready: str = "True",
    unschedulable: bool = False,
) -> dict[str, Any]:
    all_labels = {"nvidia.com/gpu.present": "true", **(labels or {})}
    if mib is not None:
        all_labels["nvidia.com/gpu.memory"] = str(mib)
    return {
        "metadata": {"name": name, "labels": all_labels},
        "spec": {"taints": taints or [], "unschedulable": unschedulable},
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    }


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80Gi", 80 * 1024**3),
        ("81920Mi", 80 * 1024**3),
        ("1G", 10**9),
        ("1.5Gi", 3 * 2**29),
        ("500m", 0),
        ("12", 12),
    ],
)
def test_parse_quantity(text: str, value: int) -> None:
    assert parse_quantity(text) == value


def test_parse_quantity_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="gpuMemory"):
        parse_quantity("80 GB", field="gpuMemory")


def test_spec_gpu_memory_wins() -> None:
    spec = parse_spec({**BASE, "resources": {"gpus": 1, "gpuMemory": "40Gi"}})
    found = device_memory(spec, [node("a", 81920)])
    assert found is not None and found.bytes == 40 * 1024**3
    assert found.source == "spec.resources.gpuMemory" and found.cuda


def test_smallest_admitted_node_counts() -> None:
    spec = parse_spec(BASE)
    nodes = [
        node("big", 81920),
        node("small", 24576),
        # Not admitted: lacks the nodeSelector label / has an untolerated taint.
        node("other-pool", 16384, labels={"nvidia.com/gpu.present": "false"}),
        node("tainted", 8192, taints=[{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]),
        node("no-label", None),
        # Take no new pods: NotReady, Unknown (no heartbeat), cordoned.
        node("not-ready", 4096, ready="False"),
        node("unknown", 4096, ready="Unknown"),
        node("cordoned", 4096, unschedulable=True),
    ]
    found = device_memory(spec, nodes)
    assert found is not None
    assert (found.bytes, found.source) == (24576 * MIB, "node small label nvidia.com/gpu.memory")


def test_a_node_without_a_ready_condition_does_not_count() -> None:
    bare = node("bare", 4096)
    bare["status"] = {}
    assert device_memory(parse_spec(BASE), [bare]) is None


def test_tolerated_taint_is_admitted() -> None:
    spec = parse_spec(BASE)  # tolerates nvidia.com/gpu:NoSchedule
    gpu = node("gpu", 40960, taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])
    assert node_admits(gpu, spec)


def test_required_node_affinity_is_respected() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    }
    spec = parse_spec({**BASE, "scheduling": {"affinity": affinity}})
    assert node_admits(node("a", 1, labels={"zone": "a"}), spec)
    assert not node_admits(node("b", 1, labels={"zone": "b"}), spec)


def test_no_information_gives_none() -> None:
    assert device_memory(parse_spec(BASE), []) is None
    cpu = parse_spec({**BASE, "resources": {"gpus": 0}})
    assert device_memory(cpu, [node("a", 81920)]) is None


def test_cpu_mode_plans_against_pod_memory() -> None:
    cpu = parse_spec({**BASE, "resources": {"gpus": 0, "memory": "12Gi"}})
    found = device_memory(cpu)
    assert found is not None and found.bytes == 12 * 1024**3 and not found.cuda
