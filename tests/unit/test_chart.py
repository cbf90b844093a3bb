"""The operator's Helm chart: real `helm lint --strict` and `helm template`, the
rendered objects validated against Kubernetes' schemas (kubernetes-validate),
least-privilege RBAC equal to deploy/rbac/, restricted pod security, args the
operator's real CLI accepts, and a CRD byte-identical to crds/."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tools import sync_chart_crds
from tools.control_plane import Binaries

from specpair_operator.__main__ import _parser as operator_cli
from tests.support.helm_chart import CHART, CRD, ROOT, find, render, run_helm, set_args, values

# The oldest Kubernetes specpair supports (DESIGN.md) and the newest the validator knows.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
ALL_FEATURES = {
    "metrics.serviceMonitor.enabled": "true",
    "metrics.prometheusRule.enabled": "true",
    "grafanaDashboard.enabled": "true",
}
WATCHED = {"watchedNamespaces": "{team-a,team-b}"}
# Maps whose keys are user data (label names, Kubernetes fields), not chart values.
FREE_FORM = {"labels", "annotations", "alertLabels", "nodeSelector", "resources"}
PASSTHROUGH = FREE_FORM | {"podSecurityContext", "securityContext"}
LOWER_CAMEL = re.compile(r"^[a-z][a-zA-Z0-9]*$")


def validate_natively(obj: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = ".".join(str(p) for p in error.path)
            raise AssertionError(
                f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version} "
                f"at {where or '(root)'}: {error.message}"
            ) from None


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = find(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def rule_set(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples: equal sets grant the same."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("extra", [{}, ALL_FEATURES, {**ALL_FEATURES, **WATCHED}])
def test_helm_lint_strict(control_plane_binaries: Binaries, extra: dict[str, str]) -> None:
    out = run_helm(control_plane_binaries, "lint", "--strict", str(CHART), *set_args(extra))
    assert "1 chart(s) linted, 0 chart(s) failed" in out


@pytest.mark.parametrize("extra", [{}, WATCHED, {**ALL_FEATURES, **WATCHED}])
def test_rendered_objects_validate(control_plane_binaries: Binaries, extra: dict[str, str]) -> None:
    objects = render(control_plane_binaries, extra)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service"} <= kinds
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # Prometheus Operator kinds: checked in test_monitoring_objects
        validate_natively(obj)


def test_validation_catches_a_broken_object(control_plane_binaries: Binaries) -> None:
    """The check above can fail: a misspelt field is an error."""
    objects = render(control_plane_binaries)
    container = operator_container(objects)
    container["securityContext"]["readOnlyRootFileSystem"] = True  # wrong case
    with pytest.raises(AssertionError, match="readOnlyRootFileSystem"):
        validate_natively(find(objects, "Deployment")[0])


def test_chart_crd_is_byte_identical_to_crds() -> None:
    chart_crd = CHART / "crds" / CRD.name
    assert chart_crd.read_bytes() == CRD.read_bytes(), "run `make crds`"
    assert sync_chart_crds.out_of_sync() == []
    validate_natively(yaml.safe_load(CRD.read_text()))


def test_sync_script_repairs_a_stale_copy(tmp_path: Path) -> None:
    source, chart = tmp_path / "crds", tmp_path / "chart-crds"
    source.mkdir()
    chart.mkdir()
    (source / "a.yaml").write_text("kind: A\n")
    (chart / "a.yaml").write_text("kind: old\n")
    (chart / "gone.yaml").write_text("kind: Gone\n")
    assert sync_chart_crds.out_of_sync(source, chart) == ["a.yaml", "gone.yaml"]
    assert sync_chart_crds.sync(source, chart) == ["a.yaml", "gone.yaml"]
    assert sorted(p.name for p in chart.iterdir()) == ["a.yaml"]
    assert (chart / "a.yaml").read_bytes() == b"kind: A\n"


def _keys(tree: dict[str, Any], path: str = "") -> list[str]:
    found: list[str] = []
    for key, value in tree.items():
        here = f"{path}.{key}" if path else key
        found.append(here)
        if isinstance(value, dict) and key not in PASSTHROUGH:
            found += _keys(value, here)
    return found


def test_values_are_lower_camel_case() -> None:
    bad = [k for k in _keys(values()) if not LOWER_CAMEL.match(k.rsplit(".", 1)[-1])]
    assert not bad, f"values keys not in lowerCamelCase: {bad}"


def test_every_value_is_documented() -> None:
    """Each chart value has a comment above it in values.yaml and a row in README.md."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    undocumented: list[str] = []
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z_][\w-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        stack = [(i, k) for i, k in stack if i < indent]
        parents = [k for _, k in stack]
        stack.append((indent, key))
        if any(p in PASSTHROUGH for p in parents):
            continue
        previous = next((s for s in reversed(lines[:number]) if s.strip()), "")
        if not previous.strip().startswith("#"):
            undocumented.append(".".join([*parents, key]))
    assert not undocumented, f"values without a comment above them: {undocumented}"
    readme = (CHART / "README.md").read_text()
    missing = [k for k in _keys(values()) if f"`{k}`" not in readme]
    assert not missing, f"values missing from charts/specpair-operator/README.md: {missing}"


def test_operator_pod_security_is_restricted(control_plane_binaries: Binaries) -> None:
    objects = render(control_plane_binaries)
    (deployment,) = find(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security.get("privileged", False) is False
    assert not {"hostNetwork", "hostPID", "hostIPC"} & pod.keys()
    assert all("hostPath" not in v for v in pod.get("volumes", []))
    # A writable /tmp, since the root filesystem is read-only.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_operator_args_are_accepted_by_the_real_cli(control_plane_binaries: Binaries) -> None:
    container = operator_container(
        render(control_plane_binaries, {"resyncSeconds": "7", "scrapeSeconds": "3"})
    )
    args = operator_cli().parse_args(container["args"])
    assert args.command == "run"
    assert (args.metrics_port, args.metrics_address) == (8080, "0.0.0.0")
    assert args.namespace == [] and args.resync_seconds == 7.0 and args.scrape_seconds == 3.0
    assert args.liveness == "http://0.0.0.0:8081/healthz"
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and probe["port"] == "health"

    watched = operator_container(
        render(control_plane_binaries, {**WATCHED, "metrics.enabled": "false"})
    )
    args = operator_cli().parse_args(watched["args"])
    assert args.namespace == ["team-a", "team-b"] and args.metrics_port == 0
    env = {e["name"]: e.get("value") for e in watched["env"]}
    assert env["SPECPAIR_LOG_LEVEL"] == "info"
    # The Lease lives where the chart's leader-election Role allows it.
    assert args.leader_election and args.lease_namespace == "specpair-system"


def test_cluster_role_grants_what_deploy_rbac_grants(control_plane_binaries: Binaries) -> None:
    expected = rule_set(
        yaml.safe_load((ROOT / "deploy/rbac/cluster_role.yaml").read_text())["rules"]
    )
    objects = render(control_plane_binaries)
    (role,) = find(objects, "ClusterRole", "specpair-specpair-operator")
    assert rule_set(role["rules"]) == expected
    # The one namespaced Role: the leader-election Lease, in the release's namespace.
    (lease_role,) = find(objects, "Role")
    assert rule_set(lease_role["rules"]) == rule_set(
        next(yaml.safe_load_all((ROOT / "deploy/rbac/leader_election_role.yaml").read_text()))[
            "rules"
        ]
    )
    (binding,) = find(objects, "ClusterRoleBinding")
    (account,) = find(objects, "ServiceAccount")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    verbs = {verb for _, _, verb in expected}
    assert "*" not in verbs
    # The one delete: ConfigMaps of revisions that left status.revisions.
    assert {(g, r) for g, r, verb in expected if verb == "delete"} == {("", "configmaps")}


def test_watched_namespaces_get_a_role_each(control_plane_binaries: Binaries) -> None:
    expected = rule_set(
        yaml.safe_load((ROOT / "deploy/rbac/cluster_role.yaml").read_text())["rules"]
    )
    objects = render(control_plane_binaries, WATCHED)
    roles = [r for r in find(objects, "Role") if not r["metadata"]["name"].endswith("-election")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    bindings = find(objects, "RoleBinding")
    assert sorted(
        b["metadata"]["namespace"] for b in bindings if b["roleRef"]["name"].endswith("operator")
    ) == ["team-a", "team-b"]
    (cluster_role,) = find(objects, "ClusterRole", "specpair-specpair-operator-cluster")
    cluster = rule_set(cluster_role["rules"])
    # Only cluster-scoped reads stay cluster-wide; everything else is per namespace.
    # kopf lists and watches namespaces when it is given a namespace list.
    namespaces = {("", "namespaces", "list"), ("", "namespaces", "watch")}
    assert {(g, r) for g, r, _ in cluster} == {
        ("", "nodes"),
        ("", "namespaces"),
        ("apiextensions.k8s.io", "customresourcedefinitions"),
    }
    for role in roles:
        assert rule_set(role["rules"]) | cluster == expected | namespaces


def test_monitoring_objects(control_plane_binaries: Binaries) -> None:
    assert not find(render(control_plane_binaries), "ServiceMonitor")
    objects = render(
        control_plane_binaries,
        {**ALL_FEATURES, "metrics.prometheusRule.itlP99ThresholdSeconds": "0.125"},
    )
    monitors = {m["metadata"]["name"]: m for m in find(objects, "ServiceMonitor")}
    assert set(monitors) == {"specpair-specpair-operator", "specpair-specpair-operator-pairs"}
    pairs = monitors["specpair-specpair-operator-pairs"]["spec"]
    assert pairs["namespaceSelector"] == {"any": True}
    assert pairs["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "specpair-operator"
    assert pairs["endpoints"][0]["port"] == "http"
    (service,) = find(objects, "Service")
    operator_spec = monitors["specpair-specpair-operator"]["spec"]
    assert operator_spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert operator_spec["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]

    (rule,) = find(objects, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {
        "SpecpairAcceptanceDrift",
        "SpecpairHighFallbackRate",
        "SpecpairInterTokenLatencyHigh",
    }
    assert alerts["SpecpairInterTokenLatencyHigh"]["expr"].rstrip().endswith("> 0.125")
    for alert in alerts.values():
        assert alert["expr"].count("(") == alert["expr"].count(")"), alert["alert"]

    watched = render(control_plane_binaries, {**ALL_FEATURES, **WATCHED})
    (pairs_watched,) = find(watched, "ServiceMonitor", "specpair-specpair-operator-pairs")
    assert pairs_watched["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}

    (dashboard,) = find(objects, "ConfigMap")
    assert json.loads(dashboard["data"]["specpair.json"]) == json.loads(
        (CHART / "dashboards" / "specpair.json").read_text()
    )


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def test_user_roles_aggregate_into_view_edit_and_admin(control_plane_binaries: Binaries) -> None:
    """The users' roles on pairs, as deploy/rbac/user_roles.yaml; view can only read."""
    documents = yaml.safe_load_all((ROOT / "deploy/rbac/user_roles.yaml").read_text())
    expected = {d["metadata"]["name"].removeprefix("specpair-"): d for d in documents}
    objects = render(control_plane_binaries)
    for kind in ("view", "edit"):
        (role,) = find(objects, "ClusterRole", f"specpair-specpair-operator-{kind}")
        assert rule_set(role["rules"]) == rule_set(expected[kind]["rules"]), kind
        aggregated = {
            k.removeprefix(AGGREGATE) for k in role["metadata"]["labels"] if AGGREGATE in k
        }
        wanted = {
            k.removeprefix(AGGREGATE)
            for k in expected[kind]["metadata"]["labels"]
            if AGGREGATE in k
        }
        assert aggregated == wanted
    assert wanted == {"edit", "admin"}
    view = rule_set(expected["view"]["rules"])
    assert {verb for _, _, verb in view} == {"get", "list", "watch"}
    assert ("specpair.dev", "speculativepairs/scale", "update") in rule_set(
        expected["edit"]["rules"]
    )
    assert not find(render(control_plane_binaries, {"rbac.userRoles": "false"}), "ClusterRole",
                    "specpair-specpair-operator-view")  # fmt: skip
