"""`helm install` of the operator chart into a real kube-apiserver with RBAC on,
then the operator as a local process under the chart's ServiceAccount token,
reconciling the CPU sample pair: the chart's RBAC, checked without Docker.
tests/e2e/test_node_e2e.py installs the same chart on a real node, where the
operator runs as its pod."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tools.control_plane import Binaries, ControlPlane, free_port

from tests.support.helm_chart import CHART, ROOT
from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import wait_crd_established
from tests.support.polling import PAIRS, get_or_none, wait_for

pytestmark = pytest.mark.integration

SAMPLE = ROOT / "crds" / "samples" / "cpu-pair.yaml"


def loopback_args(args: list[str]) -> list[str]:
    """The chart's operator args, with its listeners moved to free loopback ports."""
    moved = {
        "--metrics-address": "127.0.0.1",
        "--metrics-port": str(free_port()),
        "--liveness": f"http://127.0.0.1:{free_port()}/healthz",
    }
    out = []
    for arg in args:
        flag = arg.split("=", 1)[0]
        out.append(f"{flag}={moved[flag]}" if flag in moved else arg)
    return out


class Release:
    """A `helm install`ed release; `helm uninstall` on exit."""

    def __init__(self, helm: Kubectl, name: str, namespace: str, *sets: str) -> None:
        self.helm, self.name, self.namespace, self.sets = helm, name, namespace, sets

    def __enter__(self) -> Release:
        self.helm(
            "install",
            self.name,
            str(CHART),
            "--namespace",
            self.namespace,
            "--create-namespace",
            # Helm 4 applies server-side by default. v1.20's apply schema predates
            # x-kubernetes-validations (1.25), so its typed patch rejects the CRD's
            # CEL rules; a client-side create is what the old server accepts
            # (it drops the rules, as the docs for that version say).
            "--server-side=false",
            *(arg for value in self.sets for arg in ("--set", value)),
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.helm("uninstall", self.name, "--namespace", self.namespace, check=False)

    @property
    def fullname(self) -> str:
        return f"{self.name}-specpair-operator"


@contextlib.contextmanager
def operator_process(
    args: list[str], kubeconfig: Path, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m specpair_operator <the chart's args>`; always stopped."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "specpair_operator", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def chart_args(plane: ControlPlane, release: Release) -> list[str]:
    deployment = plane.api(
        "GET", f"/apis/apps/v1/namespaces/{release.namespace}/deployments/{release.fullname}"
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]  # type: ignore[index]
    args = container["args"]
    assert isinstance(args, list)
    return loopback_args([str(a) for a in args])


def sample_pair(name: str) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    body["metadata"] = {"name": name}
    return body


def owned_config_maps(plane: ControlPlane, ns: str, owner: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = plane.api("GET", f"/api/v1/namespaces/{ns}/configmaps")["items"]  # type: ignore[assignment]
    return [
        cm
        for cm in items
        if any(ref.get("name") == owner for ref in cm["metadata"].get("ownerReferences", []))
    ]


def assert_reconciled(plane: ControlPlane, ns: str, name: str, log: Path) -> dict[str, Any]:
    """Children created and the status written for the pair's generation."""

    def settled() -> dict[str, Any] | None:
        pair = get_or_none(plane, PAIRS.format(ns=ns) + f"/{name}")
        status = (pair or {}).get("status") or {}
        if pair is None or status.get("observedGeneration") != pair["metadata"]["generation"]:
            return None
        return pair

    try:
        pair = wait_for(settled, f"the status of {ns}/{name}")
        for path in (
            f"/apis/apps/v1/namespaces/{ns}/deployments/{name}",
            f"/api/v1/namespaces/{ns}/services/{name}",
        ):
            wait_for(lambda p=path: get_or_none(plane, p), path)  # type: ignore[misc]
        config_maps = wait_for(lambda: owned_config_maps(plane, ns, name), "the pair's ConfigMap")
    except AssertionError as error:
        raise AssertionError(f"{error}\noperator log:\n{log.read_text()[-3000:]}") from None
    status = pair["status"]
    assert status["placement"]["mode"] == "Colocated", status
    assert {c["type"] for c in status["conditions"]} >= {"HeadroomSufficient", "Progressing"}
    assert config_maps[0]["metadata"]["name"].startswith(f"{name}-")
    return pair


@pytest.fixture(scope="module")
def admin(rbac_control_plane: ControlPlane, control_plane_binaries: Binaries) -> Kubectl:
    return Kubectl(rbac_control_plane.kubeconfig_path, control_plane_binaries.kubectl)


@pytest.fixture(scope="module")
def helm(rbac_control_plane: ControlPlane, control_plane_binaries: Binaries) -> Kubectl:
    return Kubectl(rbac_control_plane.kubeconfig_path, control_plane_binaries.helm, timeout_s=300)


def test_helm_install_gives_an_operator_that_reconciles_the_cpu_sample(
    rbac_control_plane: ControlPlane, admin: Kubectl, helm: Kubectl, tmp_path: Path
) -> None:
    plane = rbac_control_plane
    with Release(helm, "specpair", "specpair-system") as release:
        # Helm installed the CRD from the chart's crds/.
        wait_crd_established(admin)
        listed = helm("list", "--namespace", "specpair-system", "-o", "json").stdout
        assert '"status":"deployed"' in listed.replace(" ", "")

        kubeconfig = plane.service_account_kubeconfig(
            release.namespace, release.fullname, create=False
        )

        def can(*args: str) -> bool:
            done = admin("auth", "can-i", *args, "--kubeconfig", str(kubeconfig), check=False)
            return done.stdout.strip() == "yes"

        ns = f"helm-{uuid.uuid4().hex[:8]}"
        plane.ensure_namespace(ns)
        assert can("create", "deployments.apps", "-n", ns)
        assert can("watch", "speculativepairs.specpair.dev", "--all-namespaces")
        # Secrets: get by name only (does a Secret a pair names exist?), never list.
        for denied in (("list", "secrets"), ("create", "pods"), ("delete", "deployments.apps")):
            assert not can(*denied, "-n", ns), f"the chart's role allows {' '.join(denied)}"

        log = tmp_path / "operator.log"
        with operator_process(chart_args(plane, release), kubeconfig, log):
            admin("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(sample_pair("cpu")))
            assert_reconciled(plane, ns, "cpu", log)
        text = log.read_text(errors="replace")
        assert "Forbidden" not in text and " 403" not in text, text[-3000:]


def test_watched_namespaces_install_reconciles_only_there(
    rbac_control_plane: ControlPlane, admin: Kubectl, helm: Kubectl, tmp_path: Path
) -> None:
    plane = rbac_control_plane
    watched, other = (f"w-{uuid.uuid4().hex[:8]}", f"o-{uuid.uuid4().hex[:8]}")
    for ns in (watched, other):
        plane.ensure_namespace(ns)
    # The CRD may be there from the test above; Helm skips an existing CRD.
    with Release(helm, "scoped", "specpair-scoped", f"watchedNamespaces={{{watched}}}") as release:
        wait_crd_established(admin)
        kubeconfig = plane.service_account_kubeconfig(
            release.namespace, release.fullname, create=False
        )

        def can(*args: str) -> bool:
            done = admin("auth", "can-i", *args, "--kubeconfig", str(kubeconfig), check=False)
            return done.stdout.strip() == "yes"

        assert can("create", "deployments.apps", "-n", watched)
        assert not can("create", "deployments.apps", "-n", other)
        assert not can("list", "speculativepairs.specpair.dev", "--all-namespaces")

        args = chart_args(plane, release)
        assert f"--namespace={watched}" in args
        log = tmp_path / "operator-scoped.log"
        with operator_process(args, kubeconfig, log):
            for ns in (watched, other):
                admin("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(sample_pair("cpu")))
            assert_reconciled(plane, watched, "cpu", log)
            time.sleep(3)  # a few resync periods: the other namespace stays untouched
            assert get_or_none(plane, f"/apis/apps/v1/namespaces/{other}/deployments/cpu") is None
            pair = get_or_none(plane, PAIRS.format(ns=other) + "/cpu")
            assert pair is not None and "status" not in pair
        text = log.read_text(errors="replace")
        assert "Forbidden" not in text and " 403" not in text, text[-3000:]


PAIRS_RESOURCE = "speculativepairs.specpair.dev"


def test_namespace_users_get_pair_rights_through_view_edit_and_admin(
    rbac_control_plane: ControlPlane, admin: Kubectl, helm: Kubectl, tmp_path: Path
) -> None:
    """The chart's aggregated ClusterRoles: a user bound to edit in a namespace may
    create and scale pairs there, a view user only reads them (real requests too)."""
    plane = rbac_control_plane
    with Release(helm, "roles", "specpair-roles"):
        wait_crd_established(admin)
        ns, other = f"team-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
        plane.ensure_namespace(other)
        users: dict[str, Path] = {}
        for user, role in (("alice", "edit"), ("bob", "view"), ("carol", "admin")):
            users[user] = plane.service_account_kubeconfig(ns, user)
            admin("create", "rolebinding", f"{user}-{role}", f"--clusterrole={role}",
                  f"--serviceaccount={ns}:{user}", "-n", ns)  # fmt: skip

        def can(user: str, *args: str, namespace: str = ns) -> bool:
            argv = ["auth", "can-i", *args, "-n", namespace, "--kubeconfig", str(users[user])]
            return admin(*argv, check=False).stdout.strip() == "yes"

        # The clusterrole-aggregation controller copies the rules in, asynchronously.
        wait_for(lambda: can("alice", "create", PAIRS_RESOURCE), "edit to aggregate", 60)
        wait_for(lambda: can("bob", "list", PAIRS_RESOURCE), "view to aggregate", 60)
        for verb in ("get", "list", "watch", "create", "update", "patch", "delete"):
            assert can("alice", verb, PAIRS_RESOURCE), f"edit cannot {verb}"
            assert can("carol", verb, PAIRS_RESOURCE), f"admin cannot {verb}"
        assert can("alice", "update", PAIRS_RESOURCE, "--subresource=scale")
        for verb in ("get", "list", "watch"):
            assert can("bob", verb, PAIRS_RESOURCE), f"view cannot {verb}"
        for verb in ("create", "update", "patch", "delete", "deletecollection"):
            assert not can("bob", verb, PAIRS_RESOURCE), f"view can {verb}"
        assert not can("bob", "update", PAIRS_RESOURCE, "--subresource=scale")
        assert not can("alice", "create", PAIRS_RESOURCE, namespace=other)

        # Real requests as each user, not only the authorizer's answer.
        alice = Kubectl(users["alice"], admin.binary)
        bob = Kubectl(users["bob"], admin.binary)
        alice("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(sample_pair("cpu")))
        alice("scale", "spair", "cpu", "-n", ns, "--replicas=2")
        assert "cpu" in bob("get", "spair", "-n", ns).stdout
        replicas = bob("get", "spair", "cpu", "-n", ns, "-o", "jsonpath={.spec.replicas}")
        assert replicas.stdout == "2"
        for denied in (("scale", "spair", "cpu", "--replicas=1"), ("delete", "spair", "cpu")):
            refused = bob(*denied, "-n", ns, check=False)
            assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), denied
        alice("delete", "spair", "cpu", "-n", ns)


def test_missing_watched_namespaces_fail_the_install_and_leave_no_release(
    rbac_control_plane: ControlPlane, admin: Kubectl, helm: Kubectl
) -> None:
    plane = rbac_control_plane
    team_a, team_b = (f"team-{uuid.uuid4().hex[:8]}" for _ in range(2))
    plane.ensure_namespace(team_a)
    install = [
        "install", "missing", str(CHART), "--namespace", "specpair-missing", "--create-namespace",
        "--server-side=false", "--set", f"watchedNamespaces={{{team_a},{team_b}}}",
    ]  # fmt: skip
    failed = helm(*install, check=False)
    assert failed.returncode != 0
    assert f"watchedNamespaces: namespace(s) {team_b} do not exist" in failed.stderr
    listed = helm("list", "--all-namespaces", "-o", "json").stdout  # any status
    assert "missing" not in listed  # no release left behind to block the retry
    assert get_or_none(plane, "/api/v1/namespaces/specpair-missing") is None
    assert not admin("get", "roles", "-n", team_a, "-o", "name").stdout.strip()

    plane.ensure_namespace(team_b)
    try:
        helm(*install)  # the same command, once the namespaces exist
        for ns in (team_a, team_b):
            assert (
                "missing-specpair-operator" in admin("get", "roles", "-n", ns, "-o", "name").stdout
            )
    finally:
        helm("uninstall", "missing", "--namespace", "specpair-missing", check=False)
