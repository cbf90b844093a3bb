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
from collections.abc import Callable, Iterator
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
    create_ready_node,
    create_sample_secrets,
    gpu_node,
    install_crds,
    pair_manifest,
    play_kubelet_ready,
    running_operator,
    scrape,
)
from tests.support.pair_namespace import PairNamespace
from tests.support.polling import wait_for

pytestmark = pytest.mark.integration

GPU_80 = {"gpus": 1, "gpuMemory": "80Gi"}
# Node objects without a kubelet get not-ready taints; the pairs tolerate all.
TOLERATE_ALL = [{"operator": "Exists"}]


@pytest.fixture(scope="module")
def crd_installed(control_plane: ControlPlane, kubectl: Kubectl) -> None:
    """`kubectl apply -f crds/`, as a user installs it; waits until Established."""
    install_crds(kubectl)


@pytest.fixture
def space(
    control_plane: ControlPlane, crd_installed: None, kubectl: Kubectl, k8s_namespace: str
) -> PairNamespace:
    """The test's namespace, with the CRD installed."""
    return PairNamespace(control_plane, kubectl, k8s_namespace)


StartOperator = Callable[[], contextlib.AbstractContextManager[Operator]]


@pytest.fixture
def start_operator(kubeconfig: Path, space: PairNamespace, tmp_path: Path) -> StartOperator:
    """`with start_operator() as operator:` runs the operator on the test's namespace."""
    return lambda: running_operator(kubeconfig, tmp_path, [space.ns])


@pytest.fixture
def operator(start_operator: StartOperator) -> Iterator[Operator]:
    """The operator, running for the whole test."""
    with start_operator() as running:
        yield running


def revision_of(dep: dict[str, Any]) -> str:
    return str(dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"])


def test_crd_installs_and_rejects_schema_invalid_objects(space: PairNamespace) -> None:
    crd = api(
        space.plane,
        "GET",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/speculativepairs.specpair.dev",
    )
    assert crd["spec"]["names"]["shortNames"] == ["spair"]
    bad = pair_manifest("bad", replicas=-1)
    bad["spec"]["draft"]["dtype"] = "int4"
    with pytest.raises(urllib.error.HTTPError) as raised:
        space.create(bad)
    assert raised.value.code == 422
    message = raised.value.read().decode()
    assert "spec.replicas" in message and "spec.draft.dtype" in message

    # kubectl explain reads the descriptions of the structural schema.
    # The apiserver publishes the CRD's OpenAPI a few seconds after it is Established.
    def explain() -> str | None:
        done = space.kubectl("explain", "speculativepair.spec.speculation.maxDepth", check=False)
        return done.stdout if done.returncode == 0 else None

    explained = wait_for(explain, "kubectl explain", timeout=60)
    assert "Max tokens drafted per step." in explained


def test_undersized_gpus_from_node_labels(space: PairNamespace, operator: Operator) -> None:
    ns = space.ns
    nodes = [
        gpu_node(f"{ns}-24g", 24576, f"{ns}-24"),
        gpu_node(f"{ns}-16g", 16384, f"{ns}-16"),
        gpu_node(f"{ns}-80g", 81920, f"{ns}-16-not"),
    ]
    try:
        for node in nodes:
            create_ready_node(space.plane, node)
        for name, pool in (("small", f"{ns}-24"), ("tiny", f"{ns}-16")):
            scheduling = {"nodeSelector": {"pool": pool}, "tolerations": TOLERATE_ALL}
            space.create(pair_manifest(name, scheduling=scheduling))
        small = space.settled("small", "TargetOnly status")
        tiny = space.settled("tiny", "DoesNotFit status")

        placement = small["status"]["placement"]
        assert placement["mode"] == "TargetOnly"
        assert placement["deviceBytes"] == 24576 * 1024**2
        assert placement["deviceSource"] == f"node {ns}-24g label nvidia.com/gpu.memory"
        headroom = condition(small, "HeadroomSufficient")
        assert headroom is not None and headroom["status"] == "False"
        assert headroom["message"].startswith("draft needs 1.91 GiB more")
        dep = space.wait("deployments", "small", "the TargetOnly Deployment")
        cm = space.read("configmaps", f"small-{revision_of(dep)}")
        assert "speculation:\n  enabled: false" in cm["data"]["runtime.yaml"]

        assert tiny["status"]["placement"]["mode"] == "DoesNotFit"
        degraded = condition(tiny, "Degraded")
        assert degraded is not None and degraded["status"] == "True"
        assert "21429231616" in degraded["message"]  # the numbers, in bytes
        assert str(16384 * 1024**2) in degraded["message"]
        time.sleep(1.5)  # a few resync passes
        assert space.get("deployments", "tiny") is None

        wait_for(
            lambda: {"TargetOnly", "DoesNotFit"} <= space.event_reasons(), "the Warning Events"
        )
        columns = space.get_spair()
        assert "TargetOnly" in columns and "DoesNotFit" in columns
    finally:
        for node in nodes:
            with contextlib.suppress(urllib.error.HTTPError):
                api(space.plane, "DELETE", f"/api/v1/nodes/{node['metadata']['name']}")


def test_restart_mid_way_converges_without_duplicates(
    space: PairNamespace, start_operator: StartOperator
) -> None:
    with start_operator() as first:
        space.create(pair_manifest("pair", resources=GPU_80))
        wait_for(lambda: space.list("configmaps", "pair"), "the first child")
        first.stop(signal.SIGKILL)  # no clean shutdown
    # While it is down: a new version (a new revision) and a lost Service.
    space.patch("pair", {"spec": {"version": "2024-08-b"}})
    space.kubectl("delete", "service", "-n", space.ns, "pair", "--ignore-not-found")

    with start_operator():
        pair = space.settled("pair", "the converged status")
        dep = space.wait(
            "deployments",
            "pair",
            "the new revision",
            lambda d: d["metadata"]["labels"]["app.kubernetes.io/version"] == "2024-08-b",
        )
        space.wait("services", "pair", "the Service again")
    revision = revision_of(dep)
    assert [d["metadata"]["name"] for d in space.list("deployments")] == ["pair"]
    assert [s["metadata"]["name"] for s in space.list("services")] == ["pair"]
    cms = space.config_map_names("pair")
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
        space = PairNamespace(plane, admin, ns)
        space.create(pair_manifest("rbac", resources={"gpus": 1, "gpuMemory": "24Gi"}))
        pair = space.settled("rbac", "the status under RBAC")  # TargetOnly: posts an Event
        assert pair["status"]["placement"]["mode"] == "TargetOnly"
        space.wait("deployments", "rbac", "the Deployment")
        space.wait("services", "rbac", "the Service")
        wait_for(lambda: "TargetOnly" in space.event_reasons(None), "the TargetOnly Event")
        # Scaling is an update of the Deployment, allowed by the role.
        space.patch("rbac", {"spec": {"replicas": 1}})
        space.wait(
            "deployments", "rbac", "the scaled Deployment", lambda d: d["spec"]["replicas"] == 1
        )
    finally:
        operator.stop()
    log = operator.output()
    assert "Forbidden" not in log and " 403" not in log, log[-3000:]


def test_samples_reconcile(space: PairNamespace, operator: Operator) -> None:
    create_sample_secrets(space.plane, space.ns)  # the GPU sample names two
    space.kubectl("apply", "-n", space.ns, "-f", str(ROOT / "crds" / "samples"))
    cpu = space.settled("demo-cpu", "the CPU sample")
    gpu = space.settled("llama-8b-1b", "the GPU sample")
    for name in ("demo-cpu", "llama-8b-1b"):
        space.wait("deployments", name, f"the Deployment of {name}")
    # CPU mode plans against the pod's memory limit (2Gi).
    assert cpu["status"]["placement"]["mode"] == "Colocated"
    assert cpu["status"]["placement"]["deviceSource"] == "spec.resources.memory"
    # No GPU node in this cluster carries nvidia.com/gpu.memory: the plan is unknown,
    # said so, and the pair is still deployed as written.
    headroom = condition(gpu, "HeadroomSufficient")
    assert headroom is not None
    assert (headroom["status"], headroom["reason"]) == ("Unknown", "DeviceMemoryUnknown")


def test_rules_the_old_apiserver_skips_are_reported(
    space: PairNamespace, operator: Operator
) -> None:
    # v1.20 drops the CEL rules, so this object is stored; the operator reports it.
    body = pair_manifest("same")
    body["spec"]["draft"]["source"] = body["spec"]["target"]["source"]
    space.create(body)
    pair = wait_for(
        lambda: condition(space.get("pairs", "same"), "Degraded"), "the Degraded condition"
    )
    assert (pair["status"], pair["reason"]) == ("True", "InvalidSpec")
    assert "spec: draft.source must differ from target.source" in pair["message"]
    time.sleep(1.5)  # resync passes create nothing either
    assert space.get("deployments", "same") is None


def test_failed_revision_rolls_back_to_the_last_good_one(
    space: PairNamespace, operator: Operator
) -> None:
    body = pair_manifest(
        "roll", replicas=1, resources=GPU_80, rollout={"progressDeadlineSeconds": 10}
    )

    def template_revision() -> str:
        return revision_of(space.read("deployments", "roll"))

    space.create(body)
    space.wait("deployments", "roll", "the Deployment")
    good = template_revision()
    wait_for(
        lambda: play_kubelet_ready(space.kubectl, space.ns, f"specpair.dev/revision={good}"),
        "the first pod",
    )
    space.wait(
        "pairs",
        "roll",
        "the first revision to roll out",
        lambda p: (p.get("status") or {}).get("currentRevision") == good,
    )

    # A new version whose pods never pass /readyz.
    space.patch("roll", {"spec": {"version": "2024-09-bad"}})
    bad = wait_for(lambda: (r := template_revision()) != good and r, "the new revision")
    degraded = wait_for(
        lambda: (
            (c := condition(space.get("pairs", "roll"), "Degraded"))
            and c["reason"] == "RolloutFailed"
            and c
        ),
        "the rollback",
        timeout=90,
    )
    assert degraded["status"] == "True"
    assert template_revision() == good
    pair = space.pair("roll")
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
    row = space.columns("roll")
    assert row["SERVING"] == "2024-07-a"
    assert row["VERSION"] == "2024-09-bad"
    assert "RolledBack" in space.event_reasons(None)
    time.sleep(2)  # resync passes do not retry the failed revision
    assert template_revision() == good

    # A new spec is a new revision: the hold is over.
    space.patch("roll", {"spec": {"version": "2024-09-fixed"}})
    wait_for(lambda: template_revision() not in (good, bad), "the next revision")


# Last in the module: the garbage collector notices a new CRD's kind only at its
# next discovery resync (every 30 s), so by now it deletes the children at once.
def test_pair_lifecycle(space: PairNamespace, operator: Operator) -> None:
    body = pair_manifest("llama", resources={**GPU_80, "cpu": "8"})
    created = space.create(body)
    uid = created["metadata"]["uid"]
    pair = space.settled("llama")
    status = pair["status"]
    revision = revision_of(space.wait("deployments", "llama", "the Deployment"))

    # Children: owned, labelled, with probes, resources and securityContext.
    owner = {
        "apiVersion": "specpair.dev/v1alpha1",
        "kind": "SpeculativePair",
        "name": "llama",
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    dep = space.read("deployments", "llama")
    cm = space.read("configmaps", f"llama-{revision}")
    svc = space.read("services", "llama")
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
    columns = space.get_spair("llama")
    assert "Colocated" in columns and "2024-07-a" in columns
    # The spec was never touched; kopf keeps its state in annotations.
    assert pair["spec"]["replicas"] == 2 and "kopf" not in status
    assert not pair["metadata"].get("finalizers"), "no finalizer: children go by GC"

    # A pass over an unchanged object writes nothing (resync runs every 1 s).
    def versions() -> dict[str, str]:
        objects = {
            "pair": ("pairs", "llama"),
            "dep": ("deployments", "llama"),
            "cm": ("configmaps", f"llama-{revision}"),
            "svc": ("services", "llama"),
        }
        return {
            k: space.read(*where)["metadata"]["resourceVersion"] for k, where in objects.items()
        }

    space.settled("llama", "a settled status")
    # Let the controllers finish their own writes (ReplicaSet, pods, status).
    space.wait(
        "deployments",
        "llama",
        "the Deployment's controllers to settle",
        lambda d: (
            d["status"].get("observedGeneration") == d["metadata"]["generation"]
            and d["status"].get("replicas") == d["spec"]["replicas"]
        ),
    )
    space.settled("llama", "a status that saw it")
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
    space.patch("llama", {"spec": {"replicas": 3}})
    dep = space.wait(
        "deployments", "llama", "the Deployment to scale", lambda d: d["spec"]["replicas"] == 3
    )
    assert revision_of(dep) == revision
    assert [c["metadata"]["name"] for c in space.list("configmaps", "llama")] == [
        f"llama-{revision}"
    ]

    # A live knob changes the config in place, not the revision.
    space.patch("llama", {"spec": {"speculation": {"maxDepth": 7}}})
    space.wait(
        "configmaps",
        f"llama-{revision}",
        "the knob in the ConfigMap",
        lambda c: "maxDepth: 7" in c["data"]["runtime.yaml"],
    )
    assert revision_of(space.read("deployments", "llama")) == revision

    # Deleting the pair leaves the children to the garbage collector.
    space.kubectl("delete", "spair", "-n", space.ns, "llama", "--wait=true")
    for kind, name in (
        ("deployments", "llama"),
        ("services", "llama"),
        ("configmaps", f"llama-{revision}"),
    ):
        wait_for(
            lambda k=kind, n=name: space.get(k, n) is None,  # type: ignore[misc]
            f"{kind}/{name} to be collected",
            60,
        )


def test_config_maps_of_revisions_that_left_the_history_are_collected(
    space: PairNamespace, operator: Operator
) -> None:
    """Seven versions in a row (no kubelet: none finishes): the oldest ConfigMaps go."""
    body = pair_manifest("gc", version="2024-10-1", replicas=1, resources=GPU_80)

    def history() -> list[dict[str, Any]]:
        status = (space.get("pairs", "gc") or {}).get("status") or {}
        return list(status.get("revisions") or [])

    def config_map_revisions() -> set[str]:
        found = space.list("configmaps", "gc")
        return {c["metadata"]["labels"]["specpair.dev/revision"] for c in found}

    space.create(body)
    for n in range(1, 8):
        version = f"2024-10-{n}"
        if n > 1:
            space.patch("gc", {"spec": {"version": version}})
        wait_for(
            lambda v=version: (h := history()) and h[-1]["version"] == v,  # type: ignore[misc]
            f"version {version} in the history",
        )
    entries = history()
    assert [e["version"] for e in entries] == [f"2024-10-{n}" for n in range(3, 8)]
    assert [e["outcome"] for e in entries] == ["Superseded"] * 4 + ["Progressing"]
    kept = {e["revision"] for e in entries}
    wait_for(lambda: config_map_revisions() == kept, "the older ConfigMaps to go")


def test_lists_come_in_pages(space: PairNamespace) -> None:
    """The operator's start-up lists (and kopf's) are paged: one page in memory at a time."""
    from kubernetes import config

    from specpair_operator.kube import Kube

    for index in range(5):
        body = {"metadata": {"name": f"page-{index}", "labels": {"paged": "yes"}}}
        api(space.plane, "POST", space.path("configmaps"), body)
    client = config.new_client_from_config(config_file=str(space.plane.kubeconfig_path))  # type: ignore[no-untyped-call]
    kube = Kube(client)
    pages = list(kube.pages(space.path("configmaps"), "paged=yes", limit=2))
    assert [len(page) for page in pages] == [2, 2, 1]
    names = [cm["metadata"]["name"] for page in pages for cm in page]
    assert sorted(names) == [f"page-{index}" for index in range(5)]
