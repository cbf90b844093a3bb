"""Issue 11, items 6 and 7: the status tells the truth; the node inventory rolls nothing silently.

One operator process serves the module, in one namespace, against the real
v1.20 control plane. There is no kubelet: the tests mark pods Ready (and
keep test nodes' heartbeats fresh) as a kubelet would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from tools.control_plane import ControlPlane

from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import (
    NodeHeartbeats,
    Operator,
    api,
    condition,
    crd_namespace,
    create_sample_secrets,
    gpu_node,
    items,
    kubectl_patch,
    pair_manifest,
    pair_path,
    play_kubelet_ready,
    running_operator,
)
from tests.support.polling import PAIRS, get_or_none, wait_for

pytestmark = pytest.mark.integration

TOLERATE_ALL = [{"operator": "Exists"}]  # test nodes carry the node controller's taints


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[str]:
    with crd_namespace(control_plane, kubectl, "truth") as name:
        yield name


@pytest.fixture(scope="module")
def operator(
    control_plane: ControlPlane, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    with running_operator(
        control_plane.kubeconfig_path,
        tmp_path_factory.mktemp("truth"),
        [namespace],
        resync_seconds=2,
    ) as process:
        yield process


def pair(plane: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    found = get_or_none(plane, pair_path(ns, name))
    assert found is not None
    return found


def reason(plane: ControlPlane, ns: str, name: str, type_: str) -> tuple[str, str] | None:
    cond = condition(get_or_none(plane, pair_path(ns, name)), type_)
    return None if cond is None else (cond["status"], cond["reason"])


def template_revision(plane: ControlPlane, ns: str, name: str) -> str | None:
    dep = get_or_none(plane, f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")
    return (
        None
        if dep is None
        else dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"]
    )


def warnings(plane: ControlPlane, ns: str) -> set[str]:
    events = items(plane, f"/api/v1/namespaces/{ns}/events")
    return {e["reason"] for e in events if e["type"] == "Warning"}


def test_ready_means_serving_at_the_spec_revision_and_a_scale_up_is_progress(
    control_plane: ControlPlane, kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    ns, name = namespace, "scale"
    create_sample_secrets(control_plane, ns)
    body = pair_manifest(name, replicas=1, resources={"gpus": 1, "gpuMemory": "80Gi"})
    api(control_plane, "POST", PAIRS.format(ns=ns), body)
    revision = wait_for(lambda: template_revision(control_plane, ns, name), "the Deployment")
    selector = f"app.kubernetes.io/instance={name}"
    wait_for(lambda: play_kubelet_ready(kubectl, ns, selector), "the first pod")
    wait_for(lambda: reason(control_plane, ns, name, "Ready") == ("True", "Serving"), "Ready=True")
    status = pair(control_plane, ns, name)["status"]
    assert status["currentRevision"] == revision
    assert status["servingVersion"] == status["desiredVersion"] == body["spec"]["version"]

    kubectl_patch(kubectl, ns, name, {"spec": {"replicas": 2}})
    wait_for(
        lambda: reason(control_plane, ns, name, "Progressing") == ("True", "ScalingUp"),
        "Progressing=True, ScalingUp",
    )
    for _ in range(3):  # several passes while the second pod is not ready
        assert reason(control_plane, ns, name, "Ready") == ("True", "Serving")
        time.sleep(1)
    wait_for(lambda: play_kubelet_ready(kubectl, ns, selector) == 2, "both pods")
    wait_for(
        lambda: reason(control_plane, ns, name, "Progressing") == ("False", "RolloutComplete"),
        "the scale-up to complete",
    )
    assert reason(control_plane, ns, name, "Ready") == ("True", "Serving")


def test_unknown_device_memory_is_said_with_a_warning(
    control_plane: ControlPlane, namespace: str, operator: Operator
) -> None:
    ns, name = namespace, "unknown"
    create_sample_secrets(control_plane, ns)
    # No gpuMemory, and no Ready node that the selector admits carries the label.
    body = pair_manifest(name, scheduling={"nodeSelector": {"pool": f"{ns}-none"}})
    api(control_plane, "POST", PAIRS.format(ns=ns), body)
    wait_for(
        lambda: (
            reason(control_plane, ns, name, "HeadroomSufficient")
            == ("Unknown", "DeviceMemoryUnknown")
        ),
        "HeadroomSufficient=Unknown",
    )
    cond = condition(pair(control_plane, ns, name), "HeadroomSufficient")
    assert cond is not None and "speculation on" in cond["message"]
    wait_for(lambda: "DeviceMemoryUnknown" in warnings(control_plane, ns), "the Warning Event")


def test_a_missing_secret_is_named_and_nothing_rolls_out_until_it_exists(
    control_plane: ControlPlane, namespace: str, operator: Operator
) -> None:
    ns, name = namespace, "secretless"
    body = pair_manifest(name, resources={"gpus": 1, "gpuMemory": "80Gi"})
    body["spec"]["serving"]["apiKeySecret"] = {"name": "not-there", "key": "api-key"}
    body["spec"]["hfTokenSecret"] = {"name": "hf-token-absent", "key": "token"}
    api(control_plane, "POST", PAIRS.format(ns=ns), body)
    wait_for(
        lambda: reason(control_plane, ns, name, "Degraded") == ("True", "MissingReference"),
        "Degraded=True, MissingReference",
    )
    message = str((condition(pair(control_plane, ns, name), "Degraded") or {})["message"])
    assert "Secret not-there (spec.serving.apiKeySecret) not found" in message
    assert "Secret hf-token-absent (spec.hfTokenSecret) not found" in message
    assert template_revision(control_plane, ns, name) is None  # no pods that cannot start
    assert "MissingReference" in warnings(control_plane, ns)

    for secret, key in (("not-there", "api-key"), ("hf-token-absent", "token")):
        api(
            control_plane,
            "POST",
            f"/api/v1/namespaces/{ns}/secrets",
            {"metadata": {"name": secret}, "stringData": {key: "x"}},
        )
    # Secrets are not watched: the next resync finds them.
    wait_for(lambda: template_revision(control_plane, ns, name), "the Deployment")
    wait_for(
        lambda: reason(control_plane, ns, name, "Degraded") == ("False", "AsExpected"),
        "Degraded=False",
    )


def test_node_inventory_counts_ready_nodes_and_never_rolls_a_serving_pair_silently(
    control_plane: ControlPlane, kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    ns, name = namespace, "placed"
    pool = f"{ns}-pool"
    create_sample_secrets(control_plane, ns)
    with NodeHeartbeats(control_plane) as nodes:
        nodes.add(gpu_node(f"{ns}-80g", 81920, pool))
        nodes.add(gpu_node(f"{ns}-16g-notready", 16384, pool), ready=False)
        body = pair_manifest(
            name,
            replicas=1,
            scheduling={"nodeSelector": {"pool": pool}, "tolerations": TOLERATE_ALL},
        )
        api(control_plane, "POST", PAIRS.format(ns=ns), body)
        first = wait_for(lambda: template_revision(control_plane, ns, name), "the Deployment")
        placement = pair(control_plane, ns, name)["status"]["placement"]
        # The NotReady 16 GiB node takes no pods, so it does not shrink the plan.
        assert placement["mode"] == "Colocated"
        assert placement["deviceSource"] == f"node {ns}-80g label nvidia.com/gpu.memory"
        wait_for(
            lambda: play_kubelet_ready(kubectl, ns, f"app.kubernetes.io/instance={name}"),
            "the pod",
        )
        wait_for(
            lambda: pair(control_plane, ns, name)["status"].get("currentRevision") == first,
            "the pair to serve",
        )

        # A Ready 24 GiB node joins the pool: the plan would drop the draft.
        nodes.add(gpu_node(f"{ns}-24g", 24576, pool))
        wait_for(
            lambda: (
                reason(control_plane, ns, name, "PlacementChangePending")
                == ("True", "ConfirmationNeeded")
            ),
            "the held placement change",
        )
        held = pair(control_plane, ns, name)
        message = str((condition(held, "PlacementChangePending") or {})["message"])
        assert "TargetOnly" in message and "specpair.dev/confirm-placement" in message
        assert held["status"]["placement"]["mode"] == "Colocated"
        assert "ConfirmationNeeded" in warnings(control_plane, ns)
        time.sleep(3)  # resync passes roll nothing
        assert template_revision(control_plane, ns, name) == first

        # The node leaves again: nothing to confirm any more.
        nodes.delete(f"{ns}-24g")
        wait_for(
            lambda: (
                reason(control_plane, ns, name, "PlacementChangePending") == ("False", "AsPlanned")
            ),
            "the hold to clear",
        )
        assert template_revision(control_plane, ns, name) == first

        # Back, and confirmed: now the pair follows, with a new revision.
        nodes.add(gpu_node(f"{ns}-24g", 24576, pool))
        wait_for(
            lambda: (
                reason(control_plane, ns, name, "PlacementChangePending")
                == ("True", "ConfirmationNeeded")
            ),
            "the hold again",
        )
        kubectl("annotate", "spair", "-n", ns, name, "specpair.dev/confirm-placement=TargetOnly")
        wait_for(
            lambda: template_revision(control_plane, ns, name) not in (None, first),
            "the confirmed rollout",
        )
        after = pair(control_plane, ns, name)["status"]
        assert after["placement"]["mode"] == "TargetOnly"
        assert after["placement"]["deviceSource"] == f"node {ns}-24g label nvidia.com/gpu.memory"
