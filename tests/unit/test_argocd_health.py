"""The Argo CD health check (charts/specpair-operator/health/argocd-health.lua) under Lua 5.1.

Argo CD runs health checks in gopher-lua, a Lua 5.1; `lupa.lua51` is the
reference Lua 5.1 from PyPI. The objects in tests/unit/fixtures/argocd/ are
SpeculativePairs exactly as the operator wrote them on the real v1.20
apiserver (`kubectl get spair -o json`, managedFields dropped);
tests/integration/test_gitops_health.py runs the same script on live objects
on every test run, and rewrites these files with
``SPECPAIR_RECORD_HEALTH_FIXTURES=1``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.argocd_health import argocd_health

FIXTURES = Path(__file__).parent / "fixtures" / "argocd"


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return loaded


@pytest.mark.parametrize(
    ("name", "status", "says"),
    [
        ("healthy", "Healthy", "Serving"),
        ("progressing", "Progressing", "RollingOut"),
        ("invalid", "Degraded", "InvalidSpec: spec: draft.source must differ"),
        ("target-only", "Healthy", "TargetOnly"),  # serving, without speculation: said so
    ],
)
def test_real_objects(name: str, status: str, says: str) -> None:
    health = argocd_health(fixture(name))
    assert health["status"] == status
    assert says in health["message"]


def test_a_spec_newer_than_the_status_is_progressing() -> None:
    # kubectl edit just raised the generation; the operator has not seen it yet.
    pair = fixture("healthy")
    pair["metadata"]["generation"] += 1
    health = argocd_health(pair)
    assert health["status"] == "Progressing"
    assert f"generation {pair['metadata']['generation']}" in health["message"]


def test_a_stale_degraded_condition_does_not_hide_a_fix() -> None:
    pair = fixture("invalid")
    pair["metadata"]["generation"] += 1  # the user fixed the spec
    assert argocd_health(pair)["status"] == "Progressing"


def test_a_refusal_before_the_first_full_status_is_degraded() -> None:
    # A child the apiserver refused on the first pass: only Degraded was written.
    pair = fixture("invalid")
    degraded = next(c for c in pair["status"]["conditions"] if c["type"] == "Degraded")
    degraded.update(reason="ApiRejected", message="API 403 Forbidden: exceeded quota")
    pair["status"] = {"conditions": [degraded]}
    health = argocd_health(pair)
    assert health["status"] == "Degraded" and "exceeded quota" in health["message"]


def test_a_pair_without_status_is_progressing() -> None:
    pair = fixture("healthy")
    del pair["status"]
    assert argocd_health(pair)["status"] == "Progressing"


def test_degraded_wins_over_ready() -> None:
    # After a rollback the old revision serves (Ready) while the new one failed.
    pair = copy.deepcopy(fixture("healthy"))
    for cond in pair["status"]["conditions"]:
        if cond["type"] == "Degraded":
            cond.update(status="True", reason="RolloutFailed", message="revision x failed")
    assert argocd_health(pair)["status"] == "Degraded"


@pytest.mark.parametrize(
    ("status", "reason", "said"),
    [
        ("False", "LowAcceptance", True),
        ("False", "RuntimeFellBack", True),
        ("False", "MostlyTargetOnly", True),
        ("False", "SpeculationOff", False),  # on purpose: HeadroomSufficient or the spec says so
        ("Unknown", "NotMeasured", False),
        ("True", "Effective", False),
    ],
)
def test_a_draft_that_does_not_help_is_healthy_and_said(
    status: str, reason: str, said: bool
) -> None:
    # Still serving the target's output: Healthy, with the reason in the message.
    pair = copy.deepcopy(fixture("healthy"))
    ready = next(c for c in pair["status"]["conditions"] if c["type"] == "Ready")
    pair["status"]["conditions"].append(
        {**ready, "type": "SpeculationEffective", "status": status, "reason": reason,
         "message": "acceptance 0.000 over 404 drafted tokens"}
    )  # fmt: skip
    health = argocd_health(pair)
    assert health["status"] == "Healthy"
    expected = f"the draft is not helping: {reason}: acceptance 0.000 over 404"
    assert (expected in health["message"]) is said, health["message"]


def test_it_runs_on_lua_5_1() -> None:
    # gopher-lua, Argo CD's interpreter, is Lua 5.1: the tests must run that language.
    assert argocd_health(fixture("healthy"), probe="_VERSION")["status"] == "Lua 5.1"
