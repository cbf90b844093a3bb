"""The scale subresource of a SpeculativePair, on the real v1.20 control plane.

`kubectl scale spair`, `kubectl autoscale spair` and a HorizontalPodAutoscaler
(deploy/autoscaling/hpa-queue-depth.yaml, as autoscaling/v2beta2: v1.20 does
not serve v2) target the pair itself; the operator carries spec.replicas to
the Deployment and never undoes the autoscaler. The HPA controller in the
controller-manager is real; there is no metrics API here, so it scales only
to its minReplicas (which it does without metrics) and reports that it
cannot read the metric.
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
    ROOT,
    Operator,
    crd_namespace,
    pair_manifest,
    running_operator,
)
from tests.support.pair_namespace import PairNamespace
from tests.support.polling import wait_for

pytestmark = pytest.mark.integration

GPU_80 = {"gpus": 1, "gpuMemory": "80Gi"}
HPA = ROOT / "deploy" / "autoscaling" / "hpa-queue-depth.yaml"


@pytest.fixture(scope="module")
def space(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[PairNamespace]:
    with crd_namespace(control_plane, kubectl, "scale") as ns:
        yield PairNamespace(control_plane, kubectl, ns)


@pytest.fixture(scope="module")
def operator(space: PairNamespace, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    log_dir = tmp_path_factory.mktemp("scale")
    with running_operator(space.plane.kubeconfig_path, log_dir, [space.ns]) as process:
        yield process


def replicas_are(count: int) -> Any:
    return lambda d: d["spec"]["replicas"] == count


def status_replicas(count: int) -> Any:
    return lambda p: (p.get("status") or {}).get("replicas") == count


def scale_of(space: PairNamespace, name: str) -> dict[str, Any]:
    raw = space.kubectl("get", "--raw", space.path("pairs", name) + "/scale").stdout
    found: dict[str, Any] = json.loads(raw)
    return found


def test_kubectl_scale_reaches_the_deployment_through_the_scale_subresource(
    space: PairNamespace, operator: Operator
) -> None:
    name = "scaled"
    space.create(pair_manifest(name, replicas=1, resources=GPU_80))
    revision = wait_for(lambda: space.template_revision(name), "the Deployment")
    selector = "app.kubernetes.io/instance=scaled,app.kubernetes.io/name=specpair"
    space.wait("pairs", name, "status.replicas 1", status_replicas(1))
    scale = scale_of(space, name)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
    assert scale["status"] == {"replicas": 1, "selector": selector}

    space.kubectl("scale", "spair", "-n", space.ns, name, "--replicas=3")
    space.wait("deployments", name, "the Deployment scaled", replicas_are(3))
    space.wait("pairs", name, "status.replicas 3", status_replicas(3))
    assert scale_of(space, name)["status"]["replicas"] == 3
    # The selector picks exactly the pair's pods (what an HPA averages a metric over).
    pods = json.loads(
        space.kubectl("get", "pods", "-n", space.ns, "-l", selector, "-o", "json").stdout
    )
    assert len(pods["items"]) == 3
    assert space.template_revision(name) == revision  # scaling rolls nothing


def test_an_hpa_on_queue_depth_scales_the_pair_and_the_operator_follows(
    space: PairNamespace, operator: Operator
) -> None:
    name = "queued"
    space.create(pair_manifest(name, replicas=1, resources=GPU_80))
    space.wait("pairs", name, "status.replicas 1", status_replicas(1))
    hpa: dict[str, Any] = yaml.safe_load(HPA.read_text())
    assert hpa["apiVersion"] == "autoscaling/v2"
    hpa["apiVersion"] = "autoscaling/v2beta2"  # the same fields, as v1.20 serves them
    hpa["metadata"]["name"] = name
    hpa["spec"]["scaleTargetRef"]["name"] = name
    hpa["spec"]["minReplicas"] = 2  # above the pair's 1: the controller scales without metrics
    space.kubectl("apply", "-n", space.ns, "-f", "-", input=yaml.safe_dump(hpa))

    # The HPA controller wrote the pair's scale; the operator carried it to the Deployment.
    space.wait("pairs", name, "the HPA's replicas", lambda p: p["spec"]["replicas"] == 2, 90)
    space.wait("deployments", name, "the Deployment scaled", replicas_are(2))
    path = f"/apis/autoscaling/v2beta2/namespaces/{space.ns}/horizontalpodautoscalers/{name}"

    def conditions() -> dict[str, tuple[str, str]]:
        found = space.plane.api("GET", path).get("status") or {}
        assert isinstance(found, dict)
        return {c["type"]: (c["status"], c["reason"]) for c in found.get("conditions") or []}

    # It reads the pair's scale, and says why it cannot read the metric here.
    wait_for(
        lambda: conditions().get("ScalingActive") == ("False", "FailedGetPodsMetric"),
        "the HPA to try the metric",
        timeout=90,
    )
    assert conditions()["AbleToScale"][0] == "True"
    # The operator never undoes the autoscaler: several resync passes later, still 2.
    time.sleep(3)
    assert space.pair(name)["spec"]["replicas"] == 2
    assert space.read("deployments", name)["spec"]["replicas"] == 2
    assert "departs from the spec at spec.replicas" not in operator.output()


def test_kubectl_autoscale_targets_the_pair(space: PairNamespace, operator: Operator) -> None:
    name = "auto"
    space.create(pair_manifest(name, replicas=1, resources=GPU_80))
    # v1.20 serves no autoscaling/v2: kubectl falls back to v1, which needs a CPU target.
    space.kubectl("autoscale", "spair", name, "-n", space.ns, "--min=1", "--max=3", "--cpu=80%")
    hpa = space.plane.api(
        "GET", f"/apis/autoscaling/v1/namespaces/{space.ns}/horizontalpodautoscalers/{name}"
    )
    assert hpa["spec"]["scaleTargetRef"] == {  # type: ignore[index]
        "apiVersion": "specpair.dev/v1alpha1",
        "kind": "SpeculativePair",
        "name": name,
    }
