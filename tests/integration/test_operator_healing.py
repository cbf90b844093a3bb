"""Issue 11, item 1: hand edits of the children are put back; an autoscaler's replicas are not.

One operator process (resync every 30 s, so that what puts an edit back is
the watch event, not the resync) serves every test of the module, in one
namespace, against the real v1.20 control plane.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from tools.control_plane import ControlPlane

from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import (
    Operator,
    api,
    condition,
    crd_namespace,
    create_pair,
    pair_manifest,
    pair_path,
    running_operator,
    settled,
)
from tests.support.polling import get_or_none, wait_for

pytestmark = pytest.mark.integration

RESYNC_SECONDS = 30.0


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[str]:
    with crd_namespace(control_plane, kubectl, "heal") as name:
        yield name


@pytest.fixture(scope="module")
def operator(
    control_plane: ControlPlane, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    with running_operator(
        control_plane.kubeconfig_path,
        tmp_path_factory.mktemp("healing"),
        [namespace],
        resync_seconds=RESYNC_SECONDS,
    ) as process:
        yield process


def deployment(plane: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    return get_or_none(plane, f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")


def container(dep: dict[str, Any] | None) -> dict[str, Any]:
    assert dep is not None
    return dict(dep["spec"]["template"]["spec"]["containers"][0])


def runtime_yaml(plane: ControlPlane, ns: str, config_map: str) -> str:
    cm = api(plane, "GET", f"/api/v1/namespaces/{ns}/configmaps/{config_map}")
    return str(cm["data"]["runtime.yaml"])


def test_hand_edits_of_the_children_are_put_back(
    control_plane: ControlPlane, kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    ns, name = namespace, "heal"
    create_pair(control_plane, ns, pair_manifest(name, resources={"gpus": 1, "gpuMemory": "80Gi"}))
    pair = wait_for(lambda: settled(control_plane, ns, name), "the pair's status")
    dep = wait_for(lambda: deployment(control_plane, ns, name), "the Deployment")
    revision = dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"]
    config_map = f"{name}-{revision}"
    declared_yaml = runtime_yaml(control_plane, ns, config_map)
    image = container(dep)["image"]
    selector = api(control_plane, "GET", f"/api/v1/namespaces/{ns}/services/{name}")["spec"][
        "selector"
    ]

    # kubectl scale
    kubectl("scale", "deployment", "-n", ns, name, "--replicas=5")
    wait_for(
        lambda: (deployment(control_plane, ns, name) or {})["spec"]["replicas"] == 2,
        "the scale to be put back",
        timeout=20,
    )
    # kubectl set image
    kubectl("set", "image", "-n", ns, f"deployment/{name}", "runtime=registry.invalid/evil:1")
    wait_for(
        lambda: container(deployment(control_plane, ns, name))["image"] == image,
        "the image to be put back",
        timeout=20,
    )
    # An edit of runtime.yaml in the ConfigMap (the runtime would load it live).
    edited = yaml.safe_load(declared_yaml)
    edited["speculation"]["maxDepth"] = 12
    patch = {"data": {"runtime.yaml": yaml.safe_dump(edited)}}
    kubectl("patch", "configmap", "-n", ns, config_map, "--type=merge", "-p", json.dumps(patch))
    wait_for(
        lambda: runtime_yaml(control_plane, ns, config_map) == declared_yaml,
        "runtime.yaml to be put back",
        timeout=20,
    )
    # The Service selector: a changed value, then a wholly replaced selector.
    svc_patch = {"spec": {"selector": {"app.kubernetes.io/instance": "someone-else"}}}
    kubectl("patch", "service", "-n", ns, name, "--type=merge", "-p", json.dumps(svc_patch))
    replace = [{"op": "replace", "path": "/spec/selector", "value": {"app": "other"}}]
    kubectl("patch", "service", "-n", ns, name, "--type=json", "-p", json.dumps(replace))

    def service_selector() -> dict[str, str]:
        svc = api(control_plane, "GET", f"/api/v1/namespaces/{ns}/services/{name}")
        return dict(svc["spec"]["selector"])

    wait_for(lambda: service_selector() == selector, "the selector to be put back", timeout=20)

    # The status reports the declared knobs, and they are what the runtime reads.
    pair = api(control_plane, "GET", pair_path(ns, name))
    assert pair["status"]["speculation"]["maxDepth"] == pair["spec"]["speculation"]["maxDepth"]
    assert (
        yaml.safe_load(runtime_yaml(control_plane, ns, config_map))["speculation"]["maxDepth"]
        == (pair["spec"]["speculation"]["maxDepth"])
    )
    # Putting fields back rolls no new revision, and the operator logged what it fixed.
    after = deployment(control_plane, ns, name)
    assert after is not None
    assert after["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"] == revision
    log = operator.output()
    for path in ("spec.replicas", "image", "data.runtime.yaml", "spec.selector"):
        assert path in log, log[-3000:]


def test_an_autoscaler_owns_replicas_when_the_pair_opts_in(
    control_plane: ControlPlane, kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    ns, name = namespace, "scaled"
    body = pair_manifest(name, resources={"gpus": 1, "gpuMemory": "80Gi"})
    body["metadata"]["annotations"] = {"specpair.dev/external-replicas": "true"}
    create_pair(control_plane, ns, body)
    dep = wait_for(lambda: deployment(control_plane, ns, name), "the Deployment")
    assert dep["spec"]["replicas"] == 2  # spec.replicas is the initial count
    image = container(dep)["image"]

    kubectl("scale", "deployment", "-n", ns, name, "--replicas=4")  # what an HPA does
    kubectl("set", "image", "-n", ns, f"deployment/{name}", "runtime=registry.invalid/evil:1")
    wait_for(
        lambda: container(deployment(control_plane, ns, name))["image"] == image,
        "the image to be put back",
        timeout=20,
    )
    time.sleep(2)  # more events and passes: the replicas stay the autoscaler's
    current = deployment(control_plane, ns, name)
    assert current is not None and current["spec"]["replicas"] == 4
    pair = wait_for(lambda: settled(control_plane, ns, name), "the status")
    assert condition(pair, "Degraded") is not None


def test_a_deleted_child_comes_back_before_any_resync(
    control_plane: ControlPlane, kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    ns, name = namespace, "deleted"
    create_pair(control_plane, ns, pair_manifest(name, resources={"gpus": 1, "gpuMemory": "80Gi"}))
    service = f"/api/v1/namespaces/{ns}/services/{name}"
    wait_for(lambda: get_or_none(control_plane, service), "the Service")
    kubectl("delete", "service", "-n", ns, name)
    # Within 20 s, before the 30 s resync: the watch event brought it back.
    wait_for(lambda: get_or_none(control_plane, service), "the Service to come back", timeout=20)
    assert "Traceback" not in operator.output(), operator.output()[-3000:]
