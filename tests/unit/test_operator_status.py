"""Status from the plan and the observed Deployment."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from specpair_operator.headroom import DeviceMemory
from specpair_operator.status import Observation, build_status, status_patch
from specpair_runtime.planner import GIB, ModelGeometry, plan

NOW = datetime(2026, 1, 1, tzinfo=UTC)
TARGET = ModelGeometry(
    parameters=8_030_261_248, layers=32, kv_heads=8, head_dim=128, dtype="bfloat16"
)
DRAFT = ModelGeometry(
    parameters=1_235_814_400, layers=16, kv_heads=8, head_dim=64, dtype="bfloat16"
)


def a_plan(gib: int):  # type: ignore[no-untyped-def]
    return plan(TARGET, DRAFT, max_batch_size=8, max_model_length=4096, device_bytes=gib * GIB)


def deployment(
    replicas: int,
    updated: int,
    available: int,
    revision: str = "r1",
    progressing_reason: str = "NewReplicaSetAvailable",
) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "spec": {
            "replicas": replicas,
            "template": {"metadata": {"labels": {"specpair.dev/revision": revision}}},
        },
        "status": {
            "observedGeneration": 2,
            "replicas": replicas,
            "updatedReplicas": updated,
            "readyReplicas": available,
            "availableReplicas": available,
            "conditions": [
                {
                    "type": "Progressing",
                    "status": "True",
                    "reason": progressing_reason,
                    "message": "m",
                }
            ],
        },
    }


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


DEVICE80 = DeviceMemory(80 * GIB, "spec.resources.gpuMemory", cuda=True)


def test_ready_pair() -> None:
    obs = Observation(5, "r1", a_plan(80), DEVICE80, deployment(2, 2, 2))
    status = build_status(obs, {}, now=NOW)
    assert status["observedGeneration"] == 5
    assert conds(status) == {
        "Ready": ("True", "Serving"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
        "HeadroomSufficient": ("True", "Colocated"),
    }
    assert all(c["observedGeneration"] == 5 for c in status["conditions"])
    assert status["currentRevision"] == "r1"
    assert status["placement"]["mode"] == "Colocated"
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)


def test_scale_status_carries_replicas_and_the_pods_selector() -> None:
    """What the scale subresource reads: the Deployment's pods and the selector string."""
    selector = "app.kubernetes.io/instance=p,app.kubernetes.io/name=specpair"
    obs = Observation(5, "r1", a_plan(80), DEVICE80, deployment(3, 3, 1), selector=selector)
    status = build_status(obs, {}, now=NOW)
    assert (status["replicas"], status["readyReplicas"], status["selector"]) == (3, 1, selector)
    missing = Observation(5, "r1", a_plan(80), DEVICE80, None, selector=selector)
    assert build_status(missing, {}, now=NOW)["replicas"] == 0


def test_rolling_out_keeps_the_old_current_revision() -> None:
    previous = build_status(
        Observation(5, "r1", a_plan(80), DEVICE80, deployment(2, 2, 2), version="v1"), {}, now=NOW
    )
    obs = Observation(
        6, "r2", a_plan(80), DEVICE80, deployment(2, 1, 2, revision="r2"), version="v2"
    )
    status = build_status(obs, previous, now=NOW)
    assert conds(status)["Progressing"] == ("True", "RollingOut")
    assert status["currentRevision"] == "r1"
    # The old revision still serves, but not the spec's: Ready says so.
    assert conds(status)["Ready"] == ("False", "RollingOut")
    assert (status["servingVersion"], status["desiredVersion"]) == ("v1", "v2")


def test_scale_up_at_the_same_revision_stays_ready() -> None:
    dep = deployment(2, 2, 1)  # one of two pods available, both at r1
    status = build_status(
        Observation(7, "r1", a_plan(80), DEVICE80, dep, version="v1"), {}, now=NOW
    )
    assert conds(status)["Ready"] == ("True", "Serving")
    assert conds(status)["Progressing"] == ("True", "ScalingUp")
    assert status["currentRevision"] == "r1" and status["servingVersion"] == "v1"


def test_an_unset_knob_is_not_a_change() -> None:
    # The desired status holds null; the stored one (after a merge patch) omits the key.
    knobs = {"enabled": True, "maxDepth": 4, "disableAboveBatchSize": None}
    obs = Observation(1, "r1", None, None, deployment(1, 1, 1), knobs=knobs)  # memory unknown
    first = build_status(obs, {}, now=NOW)
    assert first["placement"] is None
    stored = {**first, "speculation": {"enabled": True, "maxDepth": 4}}
    stored = {k: v for k, v in stored.items() if v is not None}  # null keys are not stored
    assert status_patch(stored, build_status(obs, stored, now=NOW)) == {}
    assert status_patch(stored, {**first, "speculation": {**knobs, "maxDepth": 5}}) != {}


def test_missing_reference_is_degraded_and_named() -> None:
    message = "Secret api-key (spec.serving.apiKeySecret) not found"
    obs = Observation(
        1, "r1", a_plan(80), DEVICE80, None, missing_references=(message,), version="v1"
    )
    status = build_status(obs, {}, now=NOW)
    assert conds(status)["Degraded"] == ("True", "MissingReference")
    assert conds(status)["Ready"] == ("False", "MissingReference")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert message in str(degraded["message"])


def test_held_placement_change_is_a_condition() -> None:
    obs = Observation(
        2, "r1", a_plan(80), DEVICE80, deployment(1, 1, 1), placement_pending="confirm it"
    )
    status = build_status(obs, {}, now=NOW)
    assert conds(status)["PlacementChangePending"] == ("True", "ConfirmationNeeded")
    cleared = build_status(
        Observation(3, "r1", a_plan(80), DEVICE80, deployment(1, 1, 1)), status, now=NOW
    )
    assert conds(cleared)["PlacementChangePending"] == ("False", "AsPlanned")
    never = build_status(
        Observation(3, "r1", a_plan(80), DEVICE80, deployment(1, 1, 1)), {}, now=NOW
    )
    assert "PlacementChangePending" not in conds(never)


def test_target_only_and_does_not_fit() -> None:
    device24 = DeviceMemory(24 * GIB, "node a", cuda=True)
    target_only = build_status(Observation(1, "r", a_plan(24), device24, None), {}, now=NOW)
    assert conds(target_only)["HeadroomSufficient"] == ("False", "TargetOnly")
    device16 = DeviceMemory(16 * GIB, "node a", cuda=True)
    no_fit = build_status(Observation(1, "r", a_plan(16), device16, None), {}, now=NOW)
    assert conds(no_fit)["Degraded"] == ("True", "DoesNotFit")
    degraded = next(c for c in no_fit["conditions"] if c["type"] == "Degraded")
    assert "21429231616" in degraded["message"] and "17179869184" in degraded["message"]


def test_deadline_exceeded_is_degraded() -> None:
    dep = deployment(1, 1, 0, progressing_reason="ProgressDeadlineExceeded")
    status = build_status(Observation(1, "r1", a_plan(80), DEVICE80, dep), {}, now=NOW)
    assert conds(status)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    assert conds(status)["Ready"] == ("False", "NotAvailable")


def test_invalid_spec_keeps_placement_and_reports() -> None:
    previous = build_status(
        Observation(1, "r1", a_plan(80), DEVICE80, deployment(1, 1, 1)), {}, now=NOW
    )
    obs = Observation(2, "r1", None, None, deployment(1, 1, 1), spec_error="spec.x: bad")
    status = build_status(obs, previous, now=NOW)
    assert conds(status)["Degraded"] == ("True", "InvalidSpec")
    assert status["placement"] == previous["placement"]


def test_unchanged_status_needs_no_patch() -> None:
    obs = Observation(1, "r1", a_plan(80), DEVICE80, deployment(1, 1, 1))
    first = build_status(obs, {}, now=NOW)
    second = build_status(obs, first, now=datetime(2027, 1, 1, tzinfo=UTC))
    assert status_patch(first, second) == {}
    acceptance = {"rate": 0.7, "revision": "r1", "drift": False}
    assert status_patch({**first, "acceptance": acceptance}, second) == {}  # not ours to clear


def test_acceptance_drift_degrades_only_the_current_revision() -> None:
    obs = Observation(1, "r1", a_plan(80), DEVICE80, deployment(1, 1, 1), drift_tolerance=0.2)
    first = build_status(obs, {}, now=NOW)
    history = [{**first["revisions"][0], "baselineRate": 0.8}]
    drifting = {"rate": 0.5, "revision": "r1", "drift": True}
    status = build_status(obs, {**first, "revisions": history, "acceptance": drifting}, now=NOW)
    assert conds(status)["Degraded"] == ("True", "AcceptanceDrift")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "0.500" in str(degraded["message"]) and "0.800" in str(degraded["message"])
    assert status["revisions"][0]["baselineRate"] == 0.8  # the baseline survives a pass
    stale = {**drifting, "revision": "r0"}
    status = build_status(obs, {**first, "revisions": history, "acceptance": stale}, now=NOW)
    assert conds(status)["Degraded"] == ("False", "AsExpected")


def test_held_revision_is_degraded_rollout_failed() -> None:
    obs = Observation(
        3,
        "r2",
        a_plan(80),
        DEVICE80,
        deployment(1, 1, 1),
        held_revision="r2",
        failure_message="pod p /readyz failed: golden prompt 'hi' differs",
        version="v2",
    )
    status = build_status(obs, {"currentRevision": "r1"}, now=NOW)
    assert conds(status)["Degraded"] == ("True", "RolloutFailed")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "golden prompt 'hi' differs" in str(degraded["message"])
    history = {r["revision"]: r for r in status["revisions"]}
    assert history["r1"]["outcome"] == "Current" and history["r1"]["current"]
    assert history["r2"]["outcome"] == "RolledBack" and not history["r2"]["current"]
    assert history["r2"]["version"] == "v2"
    assert conds(status)["Progressing"] == ("False", "RolledBack")
    # Ready means serving at the spec's revision: the rolled-back one is not.
    assert conds(status)["Ready"] == ("False", "RolledBack")
    assert status["currentRevision"] == "r1"
    assert (status["servingVersion"], status["desiredVersion"]) == ("unknown", "v2")


def test_speculation_effective_follows_the_scraped_interval() -> None:
    knobs = {"enabled": True, "maxDepth": 4}
    obs = Observation(
        1, "r1", a_plan(80), DEVICE80, deployment(1, 1, 1), knobs=knobs, break_even=0.15
    )
    first = build_status(obs, {}, now=NOW)
    assert conds(first)["SpeculationEffective"] == ("Unknown", "NotMeasured")
    never = {"rate": 0.0, "draftedTokens": 404, "revision": "r1", "speculationOff": []}
    status = build_status(obs, {**first, "acceptance": never}, now=NOW)
    assert conds(status)["SpeculationEffective"] == ("False", "LowAcceptance")
    # Still serving: the draft not helping is neither Ready=False nor Degraded.
    assert conds(status)["Ready"] == ("True", "Serving")
    assert conds(status)["Degraded"] == ("False", "AsExpected")
    off = build_status(
        Observation(1, "r1", a_plan(80), DEVICE80, deployment(1, 1, 1), knobs={"enabled": False},
                    break_even=0.15),
        {**first, "acceptance": never},
        now=NOW,
    )  # fmt: skip
    assert conds(off)["SpeculationEffective"] == ("False", "SpeculationOff")
