"""Issue 11, item 11: what GitOps tools read from a pair, on live objects of the real apiserver.

- The chart's Argo CD health check (Lua 5.1, `tests.support.argocd_health`)
  says Healthy, Progressing and Degraded for pairs the operator reconciled.
- ``kubectl wait --for=condition=Ready`` returns once a pair serves.
- Flux's kstatus conventions: ``status.observedGeneration`` follows
  ``metadata.generation``, every condition carries the generation it was
  computed from, and every pair has a ``Ready`` condition (kstatus reads a
  missing one as ready).

``SPECPAIR_RECORD_HEALTH_FIXTURES=1`` rewrites tests/unit/fixtures/argocd/
from these objects (what tests/unit/test_argocd_health.py reads).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tools.control_plane import ControlPlane

from tests.support.argocd_health import argocd_health
from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import (
    Operator,
    condition,
    install_crds,
    kubectl_patch,
    pair_path,
    play_kubelet_ready,
)
from tests.support.polling import PAIRS, get_or_none, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SAMPLE: dict[str, Any] = yaml.safe_load((ROOT / "crds" / "samples" / "gpu-pair.yaml").read_text())
FIXTURES = ROOT / "tests" / "unit" / "fixtures" / "argocd"


def pair(name: str, gpu_memory: str = "80Gi", **changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(SAMPLE)
    body["metadata"] = {"name": name}
    spec = body["spec"]
    spec["resources"]["gpuMemory"] = gpu_memory
    spec["replicas"] = 1
    del spec["hfTokenSecret"], spec["serving"]["apiKeySecret"]
    spec.update(changes)
    return body


@pytest.fixture
def operator(
    control_plane: ControlPlane, kubectl: Kubectl, k8s_namespace: str, tmp_path: Path
) -> Iterator[Operator]:
    install_crds(kubectl)
    running = Operator(control_plane.kubeconfig_path, tmp_path / "operator.log", [k8s_namespace])
    try:
        yield running.start()
    finally:
        running.stop()


def fetch(plane: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    found = get_or_none(plane, pair_path(ns, name))
    assert found is not None, name
    return found


def observed(plane: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    found = get_or_none(plane, pair_path(ns, name)) or {}
    status = found.get("status") or {}
    generation = found.get("metadata", {}).get("generation")
    return found if status.get("observedGeneration") == generation else None


def record(name: str, obj: dict[str, Any]) -> None:
    if os.environ.get("SPECPAIR_RECORD_HEALTH_FIXTURES"):
        kept = copy.deepcopy(obj)
        kept["metadata"].pop("managedFields", None)
        FIXTURES.mkdir(parents=True, exist_ok=True)
        (FIXTURES / f"{name}.json").write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


def assert_kstatus_conventions(obj: dict[str, Any]) -> None:
    generation = obj["metadata"]["generation"]
    status = obj["status"]
    assert status["observedGeneration"] == generation
    assert condition(obj, "Ready") is not None, "kstatus reads a missing Ready as ready"
    for cond in status["conditions"]:
        assert cond["observedGeneration"] == generation, cond
        assert cond["status"] in ("True", "False", "Unknown") and cond["reason"], cond


def test_health_as_argo_cd_kubectl_and_flux_read_it(
    control_plane: ControlPlane, kubectl: Kubectl, operator: Operator, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    bodies = [
        pair("healthy"),
        pair("target-only", gpu_memory="24Gi"),
        pair("progressing"),
        pair(
            "invalid",
            draft={**SAMPLE["spec"]["draft"], "source": SAMPLE["spec"]["target"]["source"]},
        ),
    ]
    for body in bodies:
        control_plane.api("POST", PAIRS.format(ns=ns), body)
    for name in ("healthy", "target-only"):
        wait_for(
            lambda n=name: play_kubelet_ready(kubectl, ns, f"app.kubernetes.io/instance={n}"),  # type: ignore[misc]
            f"the pod of {name}",
        )

    def ready(name: str) -> dict[str, Any] | None:
        found = get_or_none(control_plane, pair_path(ns, name))
        cond = condition(found, "Ready")
        return found if cond and cond["status"] == "True" else None

    expected = {
        "healthy": ("Healthy", "Serving"),
        "target-only": ("Healthy", "TargetOnly"),
        "progressing": ("Progressing", ""),
        "invalid": ("Degraded", "draft.source must differ"),
    }
    for name in ("healthy", "target-only"):
        wait_for(lambda n=name: ready(n), f"{name} Ready")  # type: ignore[misc]
    for name, (status, says) in expected.items():
        obj = wait_for(lambda n=name: observed(control_plane, ns, n), f"{name} observed")  # type: ignore[misc]
        health = argocd_health(obj)
        assert health["status"] == status and says in health["message"], (name, health)
        assert_kstatus_conventions(obj)
        record(name, obj)

    # kubectl wait: returns for the serving pair, times out for the one still rolling out.
    kubectl("wait", "--for=condition=Ready", "-n", ns, "spair/healthy", "--timeout=30s")
    waited = kubectl(
        "wait", "--for=condition=Ready", "-n", ns, "spair/progressing", "--timeout=2s", check=False
    )
    assert waited.returncode != 0

    # An edit: until the operator has seen it, Argo CD says Progressing; then it settles.
    before = fetch(control_plane, ns, "healthy")
    kubectl_patch(kubectl, ns, "healthy", {"spec": {"speculation": {"maxDepth": 4}}})
    edited = fetch(control_plane, ns, "healthy")
    assert edited["metadata"]["generation"] == before["metadata"]["generation"] + 1
    if edited["status"]["observedGeneration"] < edited["metadata"]["generation"]:
        assert argocd_health(edited)["status"] == "Progressing"
    settled = wait_for(lambda: observed(control_plane, ns, "healthy"), "the edit observed")
    assert_kstatus_conventions(settled)
    assert argocd_health(settled)["status"] == "Healthy"
