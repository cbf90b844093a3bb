"""The real control plane (etcd, kube-apiserver v1.20, controller-manager) works.

These checks guard the harness that every operator integration test relies
on: the server version, the Python client, the controllers, kubectl, RBAC,
and that stopping really stops.
"""

from __future__ import annotations

import os
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from tools.control_plane import ControlPlane

from tests.support.k8s_fixtures import Kubectl, KubectlError

pytestmark = pytest.mark.integration


def _api_client(kubeconfig: Path) -> client.ApiClient:
    api: client.ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig)
    )
    return api


def _eventually(check: Callable[[], Any], timeout_s: float = 90.0, what: str = "") -> Any:
    """Poll until `check()` returns something truthy; return it."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; last: {last!r}")


def test_apiserver_is_v1_20(kubeconfig: Path) -> None:
    with _api_client(kubeconfig) as api:
        info = client.VersionApi(api).get_code()
    assert info.major == "1"
    assert info.minor == "20"
    assert info.git_version == "v1.20.2"


def test_python_client_creates_a_namespace(kubeconfig: Path) -> None:
    name = "cp-python-client"
    with _api_client(kubeconfig) as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        try:
            got: Any = core.read_namespace(name)
            assert got.metadata.name == name
            assert got.status.phase == "Active"
        finally:
            core.delete_namespace(name)


def test_deployment_creates_replicaset_and_pods(kubeconfig: Path, k8s_namespace: str) -> None:
    labels = {"app": "cp-test"}
    deployment = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="web"),
        spec=client.V1DeploymentSpec(
            replicas=2,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(
                    containers=[client.V1Container(name="web", image="registry.invalid/web:1")]
                ),
            ),
        ),
    )
    with _api_client(kubeconfig) as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        created: Any = apps.create_namespaced_deployment(k8s_namespace, deployment)

        def owned_replicasets() -> list[Any]:
            sets: list[Any] = apps.list_namespaced_replica_set(k8s_namespace).items
            return [
                rs
                for rs in sets
                if any(o.uid == created.metadata.uid for o in rs.metadata.owner_references or [])
            ]

        replicasets = _eventually(owned_replicasets, what="the Deployment's ReplicaSet")
        assert len(replicasets) == 1
        rs_uid = replicasets[0].metadata.uid

        def owned_pods() -> list[Any]:
            pods: list[Any] = core.list_namespaced_pod(k8s_namespace).items
            mine = [
                p for p in pods if any(o.uid == rs_uid for o in p.metadata.owner_references or [])
            ]
            return mine if len(mine) == 2 else []

        pods = _eventually(owned_pods, what="two Pods owned by the ReplicaSet")
    # No scheduler or kubelet runs here: the pods exist but stay unscheduled.
    assert all(p.status.phase == "Pending" for p in pods)
    assert all(p.spec.node_name is None for p in pods)


MANIFEST = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: applied
data:
  greeting: hello
---
apiVersion: v1
kind: Service
metadata:
  name: applied
spec:
  selector: {app: applied}
  ports:
  - port: 8000
    targetPort: 8000
"""


def test_kubectl_apply_and_get(kubectl: Kubectl, k8s_namespace: str, tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(MANIFEST)
    first = kubectl("apply", "-n", k8s_namespace, "-f", str(manifest))
    assert "configmap/applied created" in first.stdout
    assert "service/applied created" in first.stdout
    again = kubectl("apply", "-n", k8s_namespace, "-f", str(manifest))
    assert "configmap/applied unchanged" in again.stdout
    value = kubectl(
        "get", "configmap", "applied", "-n", k8s_namespace, "-o", "jsonpath={.data.greeting}"
    )
    assert value.stdout == "hello"
    cluster_ip = kubectl(
        "get", "service", "applied", "-n", k8s_namespace, "-o", "jsonpath={.spec.clusterIP}"
    )
    assert cluster_ip.stdout.startswith("10.96.")


def test_rbac_denies_an_unprivileged_service_account(rbac_control_plane: ControlPlane) -> None:
    plane = rbac_control_plane
    namespace = "rbac-check"
    token = plane.service_account_token(namespace, "nobody")
    with pytest.raises(urllib.error.HTTPError) as denied:
        plane.api("GET", f"/api/v1/namespaces/{namespace}/configmaps", token=token)
    assert denied.value.code == 403

    sa_kubeconfig = plane.kubeconfig_for_token(token, user="nobody")
    kubectl = Kubectl(plane.kubeconfig_path)
    with pytest.raises(KubectlError, match=r"(?i)forbidden"):
        kubectl("get", "configmaps", "-n", namespace, kubeconfig=sa_kubeconfig)

    # A Role grant lets the same token in, so the 403 above came from RBAC.
    kubectl(
        "create", "role", "read-configmaps", "-n", namespace, "--verb=list", "--resource=configmaps"
    )
    kubectl(
        "create",
        "rolebinding",
        "nobody-reads",
        "-n",
        namespace,
        "--role=read-configmaps",
        f"--serviceaccount={namespace}:nobody",
    )

    def allowed() -> bool:
        try:
            plane.api("GET", f"/api/v1/namespaces/{namespace}/configmaps", token=token)
        except urllib.error.HTTPError as err:
            assert err.code == 403
            return False
        return True

    _eventually(allowed, timeout_s=30, what="the RoleBinding to take effect")
    # Still nothing beyond the grant.
    with pytest.raises(urllib.error.HTTPError) as other:
        plane.api("GET", f"/api/v1/namespaces/{namespace}/secrets", token=token)
    assert other.value.code == 403


def test_stop_ends_every_process_and_removes_the_temp_dir(
    start_control_plane: Callable[..., ControlPlane],
) -> None:
    plane = start_control_plane()
    pids = plane.pids()
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager"}
    workdir = plane.dir
    plane.stop()
    for name, pid in pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped by stop(), so the pid is gone
        assert not plane.running(), name
    assert not workdir.exists()
    plane.stop()  # a second stop is harmless
