"""The operator against a real kube-apiserver v1.20 + controller-manager on loopback.

The operator runs as a real process (`python -m specpair_operator run`), as
in a pod, watching the test's namespace. There is no kubelet, so pods stay
Pending; the Deployment's status still comes from the real controllers.
"""

from __future__ import annotations

import contextlib
import signal
import time
import urllib.error
import uuid
from pathlib import Path
from typing import Any

import pytest
from tools.control_plane import ControlPlane

from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import (
    ROOT,
    Operator,
    api,
    condition,
    create_pair,
    create_ready_node,
    create_sample_secrets,
    gpu_node,
    install_crds,
    items,
    pair_manifest,
    pair_path,
    play_kubelet_ready,
    running_operator,
    scrape,
    settled,
)
from tests.support.operator_process import kubectl_patch as control_plane_patch
from tests.support.polling import get_or_none, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def crd_installed(control_plane: ControlPlane, kubectl: Kubectl) -> None:
    """`kubectl apply -f crds/`, as a user installs it; waits until Established."""
    install_crds(kubectl)


def test_crd_installs_and_rejects_schema_invalid_objects(
    control_plane: ControlPlane, crd_installed: None, kubectl: Kubectl, k8s_namespace: str
) -> None:
    crd = api(
        control_plane,
        "GET",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/speculativepairs.specpair.dev",
    )
    assert crd["spec"]["names"]["shortNames"] == ["spair"]
    bad = pair_manifest("bad", replicas=-1)
    bad["spec"]["draft"]["dtype"] = "int4"
    with pytest.raises(urllib.error.HTTPError) as raised:
        create_pair(control_plane, k8s_namespace, bad)
    assert raised.value.code == 422
    message = raised.value.read().decode()
    assert "spec.replicas" in message and "spec.draft.dtype" in message

    # kubectl explain reads the descriptions of the structural schema.
    # The apiserver publishes the CRD's OpenAPI a few seconds after it is Established.
    def explain() -> str | None:
        done = kubectl("explain", "speculativepair.spec.speculation.maxDepth", check=False)
        return done.stdout if done.returncode == 0 else None

    explained = wait_for(explain, "kubectl explain", timeout=60)
    assert "Max tokens drafted per step." in explained


def test_undersized_gpus_from_node_labels(
    control_plane: ControlPlane,
    crd_installed: None,
    kubeconfig: Path,
    kubectl: Kubectl,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    nodes = [
        gpu_node(f"{ns}-24g", 24576, f"{ns}-24"),
        gpu_node(f"{ns}-16g", 16384, f"{ns}-16"),
        gpu_node(f"{ns}-80g", 81920, f"{ns}-16-not"),
    ]
    # Node objects without a kubelet get not-ready taints; the pairs tolerate all.
    tolerate_all = [{"operator": "Exists"}]
    try:
        for node in nodes:
            create_ready_node(control_plane, node)
        with running_operator(kubeconfig, tmp_path, [ns]):
            create_pair(
                control_plane,
                ns,
                pair_manifest(
                    "small",
                    scheduling={"nodeSelector": {"pool": f"{ns}-24"}, "tolerations": tolerate_all},
                ),
            )
            create_pair(
                control_plane,
                ns,
                pair_manifest(
                    "tiny",
                    scheduling={"nodeSelector": {"pool": f"{ns}-16"}, "tolerations": tolerate_all},
                ),
            )
            small = wait_for(lambda: settled(control_plane, ns, "small"), "TargetOnly status")
            tiny = wait_for(lambda: settled(control_plane, ns, "tiny"), "DoesNotFit status")

            placement = small["status"]["placement"]
            assert placement["mode"] == "TargetOnly"
            assert placement["deviceBytes"] == 24576 * 1024**2
            assert placement["deviceSource"] == f"node {ns}-24g label nvidia.com/gpu.memory"
            headroom = condition(small, "HeadroomSufficient")
            assert headroom is not None and headroom["status"] == "False"
            assert headroom["message"].startswith("draft needs 1.91 GiB more")
            dep = wait_for(
                lambda: get_or_none(
                    control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/small"
                ),
                "the TargetOnly Deployment",
            )
            revision = dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"]
            cm = api(control_plane, "GET", f"/api/v1/namespaces/{ns}/configmaps/small-{revision}")
            assert "speculation:\n  enabled: false" in cm["data"]["runtime.yaml"]

            assert tiny["status"]["placement"]["mode"] == "DoesNotFit"
            degraded = condition(tiny, "Degraded")
            assert degraded is not None and degraded["status"] == "True"
            assert "21429231616" in degraded["message"]  # the numbers, in bytes
            assert str(16384 * 1024**2) in degraded["message"]
            time.sleep(1.5)  # a few resync passes
            assert (
                get_or_none(control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/tiny")
                is None
            )

            def reasons() -> set[str]:
                events = items(control_plane, f"/api/v1/namespaces/{ns}/events")
                return {e["reason"] for e in events if e["type"] == "Warning"}

            wait_for(lambda: {"TargetOnly", "DoesNotFit"} <= reasons(), "the Warning Events")
            columns = kubectl("get", "spair", "-n", ns).stdout
            assert "TargetOnly" in columns and "DoesNotFit" in columns
    finally:
        for node in nodes:
            with contextlib.suppress(urllib.error.HTTPError):
                api(control_plane, "DELETE", f"/api/v1/nodes/{node['metadata']['name']}")


def test_restart_mid_way_converges_without_duplicates(
    control_plane: ControlPlane,
    crd_installed: None,
    kubeconfig: Path,
    kubectl: Kubectl,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    body = pair_manifest("pair", resources={"gpus": 1, "gpuMemory": "80Gi"})
    deployments = f"/apis/apps/v1/namespaces/{ns}/deployments"
    with running_operator(kubeconfig, tmp_path, [ns]) as first:
        create_pair(control_plane, ns, body)
        wait_for(
            lambda: items(
                control_plane,
                f"/api/v1/namespaces/{ns}/configmaps?labelSelector="
                "app.kubernetes.io/instance%3Dpair",
            ),
            "the first child",
        )
        first.stop(signal.SIGKILL)  # no clean shutdown
    # While it is down: a new version (a new revision) and a lost Service.
    control_plane_patch(kubectl, ns, "pair", {"spec": {"version": "2024-08-b"}})
    kubectl("delete", "service", "-n", ns, "pair", "--ignore-not-found")

    with running_operator(kubeconfig, tmp_path, [ns]):
        pair = wait_for(lambda: settled(control_plane, ns, "pair"), "the converged status")
        dep = wait_for(
            lambda: (
                (d := get_or_none(control_plane, f"{deployments}/pair"))
                and d["metadata"]["labels"]["app.kubernetes.io/version"] == "2024-08-b"
                and d
            ),
            "the new revision",
        )
        wait_for(
            lambda: get_or_none(control_plane, f"/api/v1/namespaces/{ns}/services/pair"),
            "the Service again",
        )
    revision = dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"]
    assert [d["metadata"]["name"] for d in items(control_plane, deployments)] == ["pair"]
    assert [
        s["metadata"]["name"] for s in items(control_plane, f"/api/v1/namespaces/{ns}/services")
    ] == ["pair"]
    cms = {
        c["metadata"]["name"]
        for c in items(
            control_plane,
            f"/api/v1/namespaces/{ns}/configmaps?labelSelector=app.kubernetes.io/instance%3Dpair",
        )
    }
    assert f"pair-{revision}" in cms and len(cms) <= 2  # the new revision, maybe the old one
    assert pair["status"]["observedGeneration"] == pair["metadata"]["generation"]


def test_operator_works_under_its_cluster_role_and_nothing_more(
    rbac_control_plane: ControlPlane, control_plane_binaries: Any, tmp_path: Path
) -> None:
    plane = rbac_control_plane
    admin = Kubectl(plane.kubeconfig_path, control_plane_binaries.kubectl)
    install_crds(admin)
    plane.ensure_namespace("specpair-system")
    admin("apply", "-f", str(ROOT / "deploy" / "rbac"))
    operator_kubeconfig = plane.service_account_kubeconfig(
        "specpair-system", "specpair-operator", create=False
    )
    ns = f"rbac-{uuid.uuid4().hex[:8]}"
    plane.ensure_namespace(ns)

    # Least privilege: what the role must not allow.
    def can(*args: str) -> bool:
        done = admin("auth", "can-i", *args, "--kubeconfig", str(operator_kubeconfig), check=False)
        return done.stdout.strip() == "yes"

    assert can("create", "deployments.apps", "-n", ns)
    assert can("watch", "speculativepairs.specpair.dev", "--all-namespaces")
    # Secrets: get by name only (does a named Secret exist?), never list or watch.
    assert can("get", "secrets", "-n", ns)
    assert can("update", "leases.coordination.k8s.io", "-n", "specpair-system")
    assert not can("update", "leases.coordination.k8s.io", "-n", "kube-system")
    for denied in (
        ("list", "secrets"),
        ("watch", "secrets"),
        ("create", "pods"),
        ("delete", "deployments.apps"),
        ("delete", "services"),
        ("update", "speculativepairs.specpair.dev"),
        ("create", "roles.rbac.authorization.k8s.io"),
    ):
        assert not can(*denied, "-n", ns), f"the role allows {' '.join(denied)}"

    # The operator watches all namespaces and elects itself leader, as in a cluster.
    election = ["--leader-election", "--lease-namespace", "specpair-system"]
    operator = Operator(operator_kubeconfig, tmp_path / "operator-rbac.log", [], election)
    try:
        operator.start()
        create_pair(
            plane, ns, pair_manifest("rbac", resources={"gpus": 1, "gpuMemory": "24Gi"})
        )  # TargetOnly: posts an Event
        pair = wait_for(lambda: settled(plane, ns, "rbac"), "the status under RBAC")
        assert pair["status"]["placement"]["mode"] == "TargetOnly"
        for path in (
            f"/apis/apps/v1/namespaces/{ns}/deployments/rbac",
            f"/api/v1/namespaces/{ns}/services/rbac",
        ):
            wait_for(lambda p=path: get_or_none(plane, p), path)  # type: ignore[misc]
        wait_for(
            lambda: any(
                e["reason"] == "TargetOnly" for e in items(plane, f"/api/v1/namespaces/{ns}/events")
            ),
            "the TargetOnly Event",
        )
        # Scaling is an update of the Deployment, allowed by the role.
        Kubectl(plane.kubeconfig_path, control_plane_binaries.kubectl)(
            "patch", "spair", "-n", ns, "rbac", "--type=merge", "-p", '{"spec":{"replicas":1}}'
        )
        wait_for(
            lambda: (
                (d := get_or_none(plane, f"/apis/apps/v1/namespaces/{ns}/deployments/rbac"))
                and d["spec"]["replicas"] == 1
            ),
            "the scaled Deployment",
        )
    finally:
        operator.stop()
    log = operator.output()
    assert "Forbidden" not in log and " 403" not in log, log[-3000:]


def test_samples_reconcile(
    control_plane: ControlPlane,
    crd_installed: None,
    kubeconfig: Path,
    kubectl: Kubectl,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    create_sample_secrets(control_plane, ns)  # the GPU sample names two
    with running_operator(kubeconfig, tmp_path, [ns]):
        kubectl("apply", "-n", ns, "-f", str(ROOT / "crds" / "samples"))
        cpu = wait_for(lambda: settled(control_plane, ns, "demo-cpu"), "the CPU sample")
        gpu = wait_for(lambda: settled(control_plane, ns, "llama-8b-1b"), "the GPU sample")
        for name in ("demo-cpu", "llama-8b-1b"):
            wait_for(
                lambda n=name: get_or_none(  # type: ignore[misc]
                    control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/{n}"
                ),
                f"the Deployment of {name}",
            )
    # CPU mode plans against the pod's memory limit (2Gi).
    assert cpu["status"]["placement"]["mode"] == "Colocated"
    assert cpu["status"]["placement"]["deviceSource"] == "spec.resources.memory"
    # No GPU node in this cluster carries nvidia.com/gpu.memory: the plan is unknown,
    # said so, and the pair is still deployed as written.
    headroom = condition(gpu, "HeadroomSufficient")
    assert headroom is not None
    assert (headroom["status"], headroom["reason"]) == ("Unknown", "DeviceMemoryUnknown")


def test_rules_the_old_apiserver_skips_are_reported(
    control_plane: ControlPlane,
    crd_installed: None,
    kubeconfig: Path,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    # v1.20 drops the CEL rules, so this object is stored; the operator reports it.
    ns = k8s_namespace
    body = pair_manifest("same")
    body["spec"]["draft"]["source"] = body["spec"]["target"]["source"]
    with running_operator(kubeconfig, tmp_path, [ns]):
        create_pair(control_plane, ns, body)
        pair = wait_for(
            lambda: condition(get_or_none(control_plane, pair_path(ns, "same")), "Degraded"),
            "the Degraded condition",
        )
        assert (pair["status"], pair["reason"]) == ("True", "InvalidSpec")
        assert "spec: draft.source must differ from target.source" in pair["message"]
        time.sleep(1.5)  # resync passes create nothing either
        assert get_or_none(control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/same") is None


def test_failed_revision_rolls_back_to_the_last_good_one(
    control_plane: ControlPlane,
    crd_installed: None,
    kubeconfig: Path,
    kubectl: Kubectl,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    dep_path = f"/apis/apps/v1/namespaces/{ns}/deployments/roll"
    body = pair_manifest(
        "roll",
        replicas=1,
        resources={"gpus": 1, "gpuMemory": "80Gi"},
        rollout={"progressDeadlineSeconds": 10},
    )

    def template_revision() -> str:
        dep = api(control_plane, "GET", dep_path)
        return str(dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"])

    with running_operator(kubeconfig, tmp_path, [ns]):
        create_pair(control_plane, ns, body)
        wait_for(lambda: get_or_none(control_plane, dep_path), "the Deployment")
        good = template_revision()
        wait_for(
            lambda: play_kubelet_ready(kubectl, ns, f"specpair.dev/revision={good}"),
            "the first pod",
        )
        wait_for(
            lambda: (
                (get_or_none(control_plane, pair_path(ns, "roll")) or {})
                .get("status", {})
                .get("currentRevision")
                == good
            ),
            "the first revision to roll out",
        )

        # A new version whose pods never pass /readyz.
        control_plane_patch(kubectl, ns, "roll", {"spec": {"version": "2024-09-bad"}})
        bad = wait_for(lambda: (r := template_revision()) != good and r, "the new revision")
        degraded = wait_for(
            lambda: (
                (c := condition(get_or_none(control_plane, pair_path(ns, "roll")), "Degraded"))
                and c["reason"] == "RolloutFailed"
                and c
            ),
            "the rollback",
            timeout=90,
        )
        assert degraded["status"] == "True"
        assert template_revision() == good
        pair = api(control_plane, "GET", pair_path(ns, "roll"))
        assert pair["metadata"]["annotations"]["specpair.dev/failed-revision"] == bad
        assert pair["status"]["currentRevision"] == good
        assert "progressDeadlineSeconds" in degraded["message"]
        history = {r["revision"]: r for r in pair["status"]["revisions"]}
        assert history[good]["outcome"] == "Current" and history[good]["current"]
        assert history[bad]["outcome"] == "RolledBack" and not history[bad]["current"]
        assert history[bad]["version"] == "2024-09-bad"
        # maxUnavailable 0: the good pod served throughout. Ready means serving at the
        # spec's revision, so it is False, and the status says which version serves.
        ready = condition(pair, "Ready")
        assert ready is not None and (ready["status"], ready["reason"]) == ("False", "RolledBack")
        assert pair["status"]["servingVersion"] == "2024-07-a"
        assert pair["status"]["desiredVersion"] == "2024-09-bad"
        columns = kubectl("get", "spair", "-n", ns, "roll").stdout.split("\n")
        header, row = columns[0].split(), columns[1].split()
        assert dict(zip(header, row, strict=False))["SERVING"] == "2024-07-a"
        assert dict(zip(header, row, strict=False))["VERSION"] == "2024-09-bad"
        events = items(control_plane, f"/api/v1/namespaces/{ns}/events")
        assert any(e["reason"] == "RolledBack" for e in events)
        time.sleep(2)  # resync passes do not retry the failed revision
        assert template_revision() == good

        # A new spec is a new revision: the hold is over.
        control_plane_patch(kubectl, ns, "roll", {"spec": {"version": "2024-09-fixed"}})
        wait_for(lambda: template_revision() not in (good, bad), "the next revision")


# Last in the module: the garbage collector notices a new CRD's kind only at its
# next discovery resync (every 30 s), so by now it deletes the children at once.
def test_pair_lifecycle(
    control_plane: ControlPlane,
    crd_installed: None,
    kubeconfig: Path,
    kubectl: Kubectl,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    body = pair_manifest("llama", resources={"gpus": 1, "gpuMemory": "80Gi", "cpu": "8"})
    with running_operator(kubeconfig, tmp_path, [ns]) as operator:
        created = create_pair(control_plane, ns, body)
        uid = created["metadata"]["uid"]
        pair = wait_for(lambda: settled(control_plane, ns, "llama"), "the pair's status")
        status = pair["status"]
        dep = wait_for(
            lambda: get_or_none(control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/llama"),
            "the Deployment",
        )
        revision = dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"]

        # Children: owned, labelled, with probes, resources and securityContext.
        owner = {
            "apiVersion": "specpair.dev/v1alpha1",
            "kind": "SpeculativePair",
            "name": "llama",
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        dep = api(control_plane, "GET", f"/apis/apps/v1/namespaces/{ns}/deployments/llama")
        cm = api(control_plane, "GET", f"/api/v1/namespaces/{ns}/configmaps/llama-{revision}")
        svc = api(control_plane, "GET", f"/api/v1/namespaces/{ns}/services/llama")
        for child in (dep, cm, svc):
            assert child["metadata"]["ownerReferences"] == [owner]
            labels = child["metadata"]["labels"]
            assert labels["app.kubernetes.io/instance"] == "llama"
            assert labels["app.kubernetes.io/managed-by"] == "specpair-operator"
        ctr = dep["spec"]["template"]["spec"]["containers"][0]
        assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert ctr["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert ctr["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
        assert ctr["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert "speculation:\n  enabled: true" in cm["data"]["runtime.yaml"]
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]

        # Status: conditions and placement for this generation.
        assert status["placement"]["mode"] == "Colocated"
        assert status["placement"]["deviceBytes"] == 80 * 1024**3
        for cond in status["conditions"]:
            assert cond["observedGeneration"] == pair["metadata"]["generation"]
        assert condition(pair, "HeadroomSufficient")["status"] == "True"  # type: ignore[index]
        # No kubelet: pods never turn ready, so Ready stays False, and says why.
        ready = condition(pair, "Ready")
        assert ready is not None and ready["status"] == "False"
        columns = kubectl("get", "spair", "-n", ns, "llama").stdout
        assert "Colocated" in columns and "2024-07-a" in columns
        # The spec was never touched; kopf keeps its state in annotations.
        assert pair["spec"]["replicas"] == 2 and "kopf" not in status
        assert not pair["metadata"].get("finalizers"), "no finalizer: children go by GC"

        # A pass over an unchanged object writes nothing (resync runs every 1 s).
        def versions() -> dict[str, str]:
            paths = {
                "pair": pair_path(ns, "llama"),
                "dep": f"/apis/apps/v1/namespaces/{ns}/deployments/llama",
                "cm": f"/api/v1/namespaces/{ns}/configmaps/llama-{revision}",
                "svc": f"/api/v1/namespaces/{ns}/services/llama",
            }
            return {
                k: api(control_plane, "GET", p)["metadata"]["resourceVersion"]
                for k, p in paths.items()
            }

        wait_for(lambda: settled(control_plane, ns, "llama"), "a settled status")
        # Let the controllers finish their own writes (ReplicaSet, pods, status).
        wait_for(
            lambda: (
                (d := api(control_plane, "GET", f"/apis/apps/v1/namespaces/{ns}/deployments/llama"))
                and d["status"].get("observedGeneration") == d["metadata"]["generation"]
                and d["status"].get("replicas") == d["spec"]["replicas"]
            ),
            "the Deployment's controllers to settle",
        )
        wait_for(lambda: settled(control_plane, ns, "llama"), "a status that saw it")
        time.sleep(1.5)
        before = versions()
        time.sleep(3.5)
        assert versions() == before, operator.output()[-3000:]

        # The operator's own metrics.
        metrics = scrape(operator.metrics_port)
        # Triggers: the pair's own events, its children's, the start and the resync.
        assert 'specpair_operator_reconciles_total{result="ok",trigger="resync"}' in metrics
        assert "specpair_operator_reconcile_duration_seconds_count" in metrics
        assert 'specpair_operator_writes_total{kind="Deployment",verb="create"} 1.0' in metrics

        # Scaling changes replicas, not the revision.
        control_plane_patch(kubectl, ns, "llama", {"spec": {"replicas": 3}})
        dep = wait_for(
            lambda: (
                (
                    d := get_or_none(
                        control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/llama"
                    )
                )
                and d["spec"]["replicas"] == 3
                and d
            ),
            "the Deployment to scale",
        )
        assert dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"] == revision
        cms = items(
            control_plane,
            f"/api/v1/namespaces/{ns}/configmaps?labelSelector=app.kubernetes.io/instance%3Dllama",
        )
        assert [c["metadata"]["name"] for c in cms] == [f"llama-{revision}"]

        # A live knob changes the config in place, not the revision.
        control_plane_patch(kubectl, ns, "llama", {"spec": {"speculation": {"maxDepth": 7}}})
        wait_for(
            lambda: (
                "maxDepth: 7"
                in api(
                    control_plane, "GET", f"/api/v1/namespaces/{ns}/configmaps/llama-{revision}"
                )["data"]["runtime.yaml"]
            ),
            "the knob in the ConfigMap",
        )
        dep = api(control_plane, "GET", f"/apis/apps/v1/namespaces/{ns}/deployments/llama")
        assert dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"] == revision

    # Deleting the pair leaves the children to the garbage collector.
    kubectl("delete", "spair", "-n", ns, "llama", "--wait=true")
    for path in (
        f"/apis/apps/v1/namespaces/{ns}/deployments/llama",
        f"/api/v1/namespaces/{ns}/services/llama",
        f"/api/v1/namespaces/{ns}/configmaps/llama-{revision}",
    ):
        wait_for(
            lambda p=path: get_or_none(control_plane, p) is None,  # type: ignore[misc]
            f"{path} to be collected",
            60,
        )


def test_config_maps_of_revisions_that_left_the_history_are_collected(
    control_plane: ControlPlane,
    crd_installed: None,
    kubeconfig: Path,
    kubectl: Kubectl,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    """Seven versions in a row (no kubelet: none finishes): the oldest ConfigMaps go."""
    ns = k8s_namespace
    body = pair_manifest(
        "gc", version="2024-10-1", replicas=1, resources={"gpus": 1, "gpuMemory": "80Gi"}
    )
    cms = f"/api/v1/namespaces/{ns}/configmaps?labelSelector=app.kubernetes.io/instance%3Dgc"

    def history() -> list[dict[str, Any]]:
        status = (get_or_none(control_plane, pair_path(ns, "gc")) or {}).get("status") or {}
        return list(status.get("revisions") or [])

    def config_map_revisions() -> set[str]:
        found = items(control_plane, cms)
        return {c["metadata"]["labels"]["specpair.dev/revision"] for c in found}

    with running_operator(kubeconfig, tmp_path, [ns]):
        create_pair(control_plane, ns, body)
        for n in range(1, 8):
            version = f"2024-10-{n}"
            if n > 1:
                control_plane_patch(kubectl, ns, "gc", {"spec": {"version": version}})
            wait_for(
                lambda v=version: (h := history()) and h[-1]["version"] == v,  # type: ignore[misc]
                f"version {version} in the history",
            )
        entries = history()
        assert [e["version"] for e in entries] == [f"2024-10-{n}" for n in range(3, 8)]
        assert [e["outcome"] for e in entries] == ["Superseded"] * 4 + ["Progressing"]
        kept = {e["revision"] for e in entries}
        wait_for(lambda: config_map_revisions() == kept, "the older ConfigMaps to go")
