"""Field-wise drift of a child from the operator's manifest, and its correction."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from specpair_operator import builders
from specpair_operator.api import parse_spec
from specpair_operator.builders import PairRef
from specpair_operator.drift import corrected, differences, quantity_value

ROOT = Path(__file__).resolve().parents[2]
SPEC = parse_spec(yaml.safe_load((ROOT / "crds/samples/gpu-pair.yaml").read_text())["spec"])
PAIR = PairRef("llama", "ns", "uid-1")


def served(desired: dict[str, Any]) -> dict[str, Any]:
    """``desired`` as the API server returns it: defaults, server fields, status."""
    live = copy.deepcopy(desired)
    live["metadata"].update({"resourceVersion": "7", "uid": "u", "generation": 1})
    live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    if live["kind"] == "Deployment":
        pod = live["spec"]["template"]["spec"]
        pod.update({"dnsPolicy": "ClusterFirst", "restartPolicy": "Always"})
        ctr = pod["containers"][0]
        ctr["terminationMessagePath"] = "/dev/termination-log"
        ctr["readinessProbe"]["successThreshold"] = 1
        ctr["resources"] = {"limits": {"nvidia.com/gpu": "1", "cpu": "500m"}}
        live["status"] = {"replicas": 2}
    if live["kind"] == "Service":
        live["spec"].update({"clusterIP": "10.0.0.7", "sessionAffinity": "None"})
    return live


def deployment() -> dict[str, Any]:
    dep = builders.deployment(PAIR, SPEC, "abc")
    dep["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": "1", "cpu": "0.5"}
    }
    return dep


def test_server_defaults_and_canonical_quantities_are_not_drift() -> None:
    desired = deployment()
    assert differences(desired, served(desired)) == []
    service = builders.service(PAIR, SPEC)
    assert differences(service, served(service)) == []


def test_hand_edits_are_drift() -> None:
    desired = deployment()
    live = served(desired)
    live["spec"]["replicas"] = 3  # kubectl scale
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:1"  # kubectl set image
    live["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "X", "value": "1"})
    assert differences(desired, live) == [
        "spec.replicas",
        "spec.template.spec.containers[0].image",
        "spec.template.spec.containers[0].env",
    ]
    cm = builders.config_map(PAIR, SPEC, "abc", speculate=True)
    edited = served(cm)
    edited["data"]["runtime.yaml"] += "\n# edited"
    assert differences(cm, edited) == ["data.runtime.yaml"]


def test_an_extra_selector_key_is_drift() -> None:
    service = builders.service(PAIR, SPEC)
    live = served(service)
    live["spec"]["selector"]["app"] = "other"
    assert differences(service, live) == ["spec.selector"]


def test_correction_restores_owned_fields_and_keeps_the_rest() -> None:
    desired = deployment()
    live = served(desired)
    live["spec"]["replicas"] = 3
    live["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "t"
    body = corrected(desired, live)
    assert body["spec"]["replicas"] == desired["spec"]["replicas"]
    assert "status" not in body and body["metadata"]["resourceVersion"] == "7"
    assert body["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "1"
    # A restart's annotation stays: dropping it would roll the pods again.
    assert body["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"]
    assert differences(desired, served_again(body)) == []
    service = builders.service(PAIR, SPEC)
    live_svc = served(service)
    live_svc["spec"]["selector"] = {"app": "other"}
    fixed = corrected(service, live_svc)
    assert fixed["spec"]["selector"] == service["spec"]["selector"]
    assert fixed["spec"]["clusterIP"] == "10.0.0.7"  # the server's, kept


def served_again(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "status": {}}


def test_replicas_left_out_are_not_compared_nor_written() -> None:
    desired = deployment()
    without = {**desired, "spec": {k: v for k, v in desired["spec"].items() if k != "replicas"}}
    live = served(desired)
    live["spec"]["replicas"] = 9  # the HPA's choice
    assert differences(without, live) == []
    assert corrected(without, live)["spec"]["replicas"] == 9


def test_quantities() -> None:
    assert quantity_value("0.5") == quantity_value("500m")
    assert quantity_value("1536Mi") == quantity_value("1.5Gi")
    assert quantity_value("1e3") == quantity_value("1k")
    assert quantity_value("80 GB") is None
