"""Issue 11, item 12: the cluster commands of the docs, as they behave on the v1.20 apiserver.

charts/specpair-operator/README.md has a table of which commands hold on
which Kubernetes versions, and says what ``helm uninstall`` leaves behind.
These tests run those commands (kubectl 1.35, Helm 4) against the real
v1.20 control plane: the failures the table names for < 1.25, the commands
it gives instead, and the uninstall leftovers and their cleanup.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from tools.control_plane import ControlPlane

from tests.support.helm_chart import CHART
from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import (
    Operator,
    install_crds,
    pair_path,
    wait_crd_established,
)
from tests.support.polling import get_or_none, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CRD_NAME = "crd/speculativepairs.specpair.dev"


def test_crd_commands_for_apiservers_older_than_1_25(kubectl: Kubectl) -> None:
    install_crds(kubectl)  # the session's CRD; the commands below leave it as it is
    crds = str(CHART / "crds")
    plain = kubectl("apply", "-f", crds, check=False)
    assert plain.returncode != 0 and 'unknown field "x-kubernetes-validations"' in plain.stderr
    server_side = kubectl("apply", "--server-side", "-f", crds, check=False)
    assert server_side.returncode != 0 and "x-kubernetes-validations" in server_side.stderr
    unchecked = kubectl("apply", "--server-side", "--validate=false", "-f", crds, check=False)
    assert unchecked.returncode != 0 and "field not declared in schema" in unchecked.stderr
    # What the table gives for 1.20 to 1.24:
    kubectl("replace", "--validate=false", "-f", crds)
    kubectl("apply", "--validate=false", "-f", str(ROOT / "crds"))
    wait_crd_established(kubectl)


def cpu_pair(name: str) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((ROOT / "crds/samples/cpu-pair.yaml").read_text())
    body["metadata"] = {"name": name}
    return body


def children(plane: ControlPlane, ns: str, name: str) -> list[str]:
    """Kinds (as plurals) of the objects ``name`` owns, directly or through its ReplicaSets."""
    found = []
    for path in (
        f"/apis/apps/v1/namespaces/{ns}/deployments",
        f"/apis/apps/v1/namespaces/{ns}/replicasets",
        f"/api/v1/namespaces/{ns}/services",
        f"/api/v1/namespaces/{ns}/configmaps",
    ):
        for item in (get_or_none(plane, path) or {}).get("items") or []:
            refs = item["metadata"].get("ownerReferences") or []
            if any(r["name"] == name for r in refs):
                found.append(path.rsplit("/", 1)[1])
    return found


def test_helm_install_and_uninstall_as_the_chart_readme_says(
    control_plane: ControlPlane,
    helm: Kubectl,
    kubectl: Kubectl,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    install_crds(kubectl)
    ns = k8s_namespace
    release_ns = f"rel-{uuid.uuid4().hex[:8]}"
    # Helm 4 applies server-side by default: v1.20 refuses the CRD's CEL field.
    failed = helm("install", "spair", str(CHART), "-n", release_ns, "--create-namespace",
                  check=False)  # fmt: skip
    assert failed.returncode != 0 and "field not declared in schema" in failed.stderr
    helm("install", "spair", str(CHART), "-n", release_ns, "--create-namespace",
         "--server-side=false")  # fmt: skip
    # There is no kubelet for the chart's pod: the same operator runs as a local process.
    operator = Operator(control_plane.kubeconfig_path, tmp_path / "operator.log", [ns]).start()
    try:
        kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(cpu_pair("demo")))
        wait_for(
            lambda: get_or_none(control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/demo"),
            "the pair's Deployment",
        )
        wait_for(lambda: len(set(children(control_plane, ns, "demo"))) >= 4, "the children")
    finally:
        operator.stop()
    status_before = (get_or_none(control_plane, pair_path(ns, "demo")) or {}).get("status")

    helm("uninstall", "spair", "-n", release_ns)
    assert helm("list", "-n", release_ns, "-q").stdout.strip() == ""
    # What the chart's README says stays: the CRD, the pair (its status frozen), the children.
    kubectl("get", CRD_NAME)
    pair = get_or_none(control_plane, pair_path(ns, "demo"))
    assert pair is not None and pair["status"] == status_before
    assert {"deployments", "replicasets", "services", "configmaps"} <= set(
        children(control_plane, ns, "demo")
    )

    # The cleanup (scoped to this namespace: the session's CRD stays for other tests).
    kubectl("delete", "speculativepairs", "--all", "-n", ns)
    wait_for(lambda: not children(control_plane, ns, "demo"), "garbage collection", timeout=90)
    kubectl("delete", "namespace", release_ns, "--wait=false")
