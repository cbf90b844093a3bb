"""A serving pair's placement does not follow the node inventory silently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from specpair_operator.api import parse_spec
from specpair_operator.controller import node_summary, owner_key
from specpair_operator.headroom import MIB, DeviceMemory
from specpair_operator.inventory import CONFIRM_ANNOTATION, decide
from specpair_operator.references import Reference, problem, references
from specpair_operator.status import placement

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load((ROOT / "crds/samples/gpu-pair.yaml").read_text())["spec"]
SPEC = parse_spec(BASE)  # no gpuMemory: the nodes say


def node_device(mib: int) -> DeviceMemory:
    return DeviceMemory(mib * MIB, f"node n{mib} label nvidia.com/gpu.memory", cuda=True)


def served_with(mib: int) -> dict[str, Any]:
    chosen = decide(SPEC, node_device(mib), None, serving=False, confirm=None)
    assert chosen.plan is not None and chosen.device is not None
    return placement(chosen.plan, chosen.device)


def test_a_pair_not_serving_follows_the_nodes() -> None:
    chosen = decide(SPEC, node_device(24576), served_with(81920), serving=False, confirm=None)
    assert chosen.plan is not None and chosen.plan.mode == "TargetOnly"
    assert chosen.pending is None


def test_a_serving_pair_holds_a_mode_change_until_confirmed() -> None:
    before = served_with(81920)
    assert before["mode"] == "Colocated"
    held = decide(SPEC, node_device(24576), before, serving=True, confirm=None)
    assert held.plan is not None and held.plan.mode == "Colocated"
    assert held.device is not None and held.device.bytes == 81920 * MIB
    assert held.pending is not None
    assert "TargetOnly" in held.pending and CONFIRM_ANNOTATION in held.pending
    confirmed = decide(SPEC, node_device(24576), before, serving=True, confirm="TargetOnly")
    assert confirmed.plan is not None and confirmed.plan.mode == "TargetOnly"
    auto = decide(SPEC, node_device(24576), before, serving=True, confirm="auto")
    assert auto.plan is not None and auto.plan.mode == "TargetOnly"


def test_losing_every_labelled_node_keeps_the_last_plan() -> None:
    target_only = served_with(24576)
    held = decide(SPEC, None, target_only, serving=True, confirm=None)
    # Unknown memory would load the draft: a change of pods, so it waits.
    assert held.plan is not None and held.plan.mode == "TargetOnly" and held.pending
    colocated = served_with(81920)
    kept = decide(SPEC, None, colocated, serving=True, confirm=None)
    assert kept.plan is not None and kept.plan.mode == "Colocated" and kept.pending is None


def test_a_spec_change_is_followed_at_once() -> None:
    before = served_with(81920)
    bigger = parse_spec({**BASE, "serving": {"maxBatchSize": 256, "maxModelLength": 32768}})
    chosen = decide(bigger, node_device(81920), before, serving=True, confirm=None)
    assert chosen.pending is None and chosen.plan is not None
    assert chosen.plan.mode != "Colocated"
    pinned = parse_spec({**BASE, "resources": {"gpus": 1, "gpuMemory": "24Gi"}})
    spec_device = DeviceMemory(24 * 1024**3, "spec.resources.gpuMemory", cuda=True)
    chosen = decide(pinned, spec_device, before, serving=True, confirm=None)
    assert chosen.pending is None


def test_references_and_what_is_wrong_with_them() -> None:
    spec = parse_spec(
        {
            **BASE,
            "serving": {"apiKeySecret": {"name": "api", "key": "token"}},
            "hfTokenSecret": {"name": "hf", "key": "HF_TOKEN"},
        }
    )
    refs = references(spec)
    assert [(r.kind, r.name, r.field) for r in refs] == [
        ("Secret", "api", "spec.serving.apiKeySecret"),
        ("Secret", "hf", "spec.hfTokenSecret"),
    ]
    ref = Reference("Secret", "api", "token", "spec.serving.apiKeySecret")
    assert problem(ref, None) == "Secret api (spec.serving.apiKeySecret) not found"
    assert problem(ref, {"data": {"other": "eA=="}}) == (
        "Secret api (spec.serving.apiKeySecret) has no key 'token'"
    )
    assert problem(ref, {"data": {"token": "eA=="}}) is None


def test_children_map_to_their_pair_and_heartbeats_do_not_count() -> None:
    pod = {
        "metadata": {
            "namespace": "ns",
            "name": "p-1",
            "labels": {"app.kubernetes.io/instance": "p"},
        }
    }
    assert owner_key("Pod", pod) == ("ns", "p")
    assert owner_key("Pod", {"metadata": {"namespace": "ns", "name": "x"}}) is None
    node: dict[str, Any] = {
        "metadata": {"name": "n", "labels": {"nvidia.com/gpu.memory": "81920"}},
        "status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "1"}]},
    }
    beat = {
        **node,
        "status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "2"}]},
    }
    assert node_summary(node) == node_summary(beat)
    down = {**node, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert node_summary(node) != node_summary(down)
