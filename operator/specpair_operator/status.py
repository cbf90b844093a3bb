"""The pair's status, computed from the plan and the observed Deployment (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from specpair_operator.conditions import (
    CONDITION_TYPES,
    DEGRADED,
    HEADROOM_SUFFICIENT,
    PLACEMENT_CHANGE_PENDING,
    PROGRESSING,
    READY,
    ConditionUpdate,
    merge_conditions,
    rfc3339,
)
from specpair_operator.conditions import find as find_condition
from specpair_operator.headroom import DeviceMemory
from specpair_operator.history import find, update_history
from specpair_runtime.planner import Plan, gib


@dataclass(frozen=True)
class Observation:
    """Everything one reconcile pass learnt, as input to `build_status`."""

    generation: int
    revision: str | None
    plan: Plan | None
    device: DeviceMemory | None
    deployment: Mapping[str, Any] | None
    spec_error: str | None = None
    gpus: int = 1
    held_revision: str | None = None  # failed, rolled back, not retried
    failure_message: str | None = None  # the failing check, when known
    version: str = ""
    drift_tolerance: float = 0.25
    knobs: Mapping[str, Any] | None = None  # the speculation section the pods get
    missing_references: tuple[str, ...] = ()  # Secrets/ConfigMaps the pods need, absent
    placement_pending: str | None = None  # a held placement change (inventory.py)


def placement(plan: Plan, device: DeviceMemory) -> dict[str, Any]:
    return {
        "mode": plan.mode,
        "requiredBytes": plan.required_bytes,
        "deviceBytes": plan.device_bytes,
        "headroomBytes": plan.headroom_bytes,
        "reason": plan.reason,
        "target": {
            "weightsBytes": plan.target.weights_bytes,
            "kvCacheBytes": plan.target.kv_cache_bytes,
        },
        "draft": {
            "weightsBytes": plan.draft.weights_bytes,
            "kvCacheBytes": plan.draft.kv_cache_bytes,
        },
        "overheadBytes": plan.overhead_bytes,
        "deviceSource": device.source,
        **_parallel(plan),
    }


def _parallel(plan: Plan) -> dict[str, Any]:
    """Engine vllm's layout: the byte counts above are then per GPU."""
    layout = plan.parallel
    if layout is None:
        return {}
    return {
        "tensorParallelSize": layout.tensor_parallel_size,
        "nodes": layout.nodes,
        "gpuMemoryUtilization": layout.gpu_memory_utilization,
    }


def _deployment_condition(dep: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for cond in (dep.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def rollout_complete(dep: Mapping[str, Any], revision: str | None) -> bool:
    """The Deployment runs ``revision`` on all its replicas, all available."""
    meta, spec, status = dep.get("metadata") or {}, dep.get("spec") or {}, dep.get("status") or {}
    template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    wanted = spec.get("replicas", 1)
    return (
        template_labels.get("specpair.dev/revision") == revision
        and status.get("observedGeneration", 0) >= meta.get("generation", 0)
        and status.get("updatedReplicas", 0) == wanted
        and status.get("availableReplicas", 0) == wanted
        and status.get("replicas", 0) == wanted
    )


def serving_at(dep: Mapping[str, Any], revision: str | None) -> bool:
    """Every pod of the Deployment runs ``revision``, and at least one is available.

    This is what ``Ready`` means: the pair serves at the revision of its spec.
    A scale-up at that revision keeps it (``Progressing`` carries the rest); a
    rollout to a new revision is not it until the old pods are gone, which with
    ``maxUnavailable: 0`` happens only once the new ones are available.
    """
    meta, spec, status = dep.get("metadata") or {}, dep.get("spec") or {}, dep.get("status") or {}
    template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    return (
        revision is not None
        and template_labels.get("specpair.dev/revision") == revision
        and status.get("observedGeneration", 0) >= meta.get("generation", 0)
        and status.get("updatedReplicas", 0) == status.get("replicas", 0)
        and status.get("availableReplicas", 0) >= 1
    )


def _headroom(obs: Observation) -> ConditionUpdate:
    if obs.plan is None:
        where = (
            "spec.resources.memory"
            if obs.gpus == 0
            else (
                "spec.resources.gpuMemory, or label the Ready, schedulable GPU nodes the pair "
                "may use (nodeSelector, affinity, tolerations) with nvidia.com/gpu.memory"
            )
        )
        return ConditionUpdate(
            HEADROOM_SUFFICIENT,
            "Unknown",
            "DeviceMemoryUnknown",
            f"device memory unknown: set {where}; until then the pair is deployed with "
            "speculation on, unchecked against the device (the runtime pauses speculation "
            "under memory pressure)",
        )
    if obs.plan.mode == "Colocated":
        return ConditionUpdate(HEADROOM_SUFFICIENT, "True", "Colocated", obs.plan.reason)
    return ConditionUpdate(HEADROOM_SUFFICIENT, "False", obs.plan.mode, obs.plan.reason)


def _version_of(revisions: Sequence[Mapping[str, Any]], revision: str | None) -> str | None:
    entry = find(revisions, revision)
    return None if entry is None else entry.get("version")


def _ready(obs: Observation, current: str | None, serving_version: str | None) -> ConditionUpdate:
    """Ready: serving at the spec's revision (see `serving_at`)."""
    dep = obs.deployment or {}
    status = dep.get("status") or {}
    wanted = (dep.get("spec") or {}).get("replicas", 1)
    available = status.get("availableReplicas", 0)
    if wanted == 0:
        return ConditionUpdate(READY, "False", "ScaledToZero", "spec.replicas is 0")
    if serving_at(dep, obs.revision):
        return ConditionUpdate(
            READY,
            "True",
            "Serving",
            f"version {obs.version} (revision {obs.revision}) serves on {available}/{wanted} "
            "replicas",
        )
    serving = (
        f"version {serving_version} (revision {current}) still serves"
        if current is not None and current != obs.revision and available > 0
        else "nothing serves"
    )
    if obs.held_revision is not None:
        return ConditionUpdate(
            READY,
            "False",
            "RolledBack",
            f"version {obs.version} (revision {obs.held_revision}) failed and was rolled back; "
            f"{serving}",
        )
    reason = "RollingOut" if current is not None and current != obs.revision else "NotAvailable"
    return ConditionUpdate(
        READY,
        "False",
        reason,
        f"version {obs.version} (revision {obs.revision}) is not serving yet; {serving} "
        f"({available}/{wanted} replicas available)",
    )


def _progressing(obs: Observation) -> ConditionUpdate:
    dep = obs.deployment or {}
    status = dep.get("status") or {}
    wanted = (dep.get("spec") or {}).get("replicas", 1)
    available = status.get("availableReplicas", 0)
    replicas = status.get("replicas", 0)
    if rollout_complete(dep, obs.revision):
        return ConditionUpdate(
            PROGRESSING, "False", "RolloutComplete", f"revision {obs.revision} is rolled out"
        )
    if serving_at(dep, obs.revision):
        reason = "ScalingDown" if replicas > wanted else "ScalingUp"
        return ConditionUpdate(
            PROGRESSING,
            "True",
            reason,
            f"revision {obs.revision}: {available}/{wanted} replicas available",
        )
    updated = status.get("updatedReplicas", 0)
    return ConditionUpdate(
        PROGRESSING,
        "True",
        "RollingOut",
        f"revision {obs.revision}: {updated}/{wanted} replicas updated, {available} available",
    )


def _workload(
    obs: Observation, previous: Mapping[str, Any], current: str | None, serving_version: str | None
) -> list[ConditionUpdate]:
    """Ready, Progressing and Degraded from the Deployment."""
    dep = obs.deployment
    if obs.spec_error is not None:
        # Ready too: GitOps tools (kstatus) read a pair without a Ready condition as ready.
        where = f"; version {serving_version} still serves" if serving_version else ""
        return [
            ConditionUpdate(READY, "False", "InvalidSpec", f"the spec is invalid{where}"),
            ConditionUpdate(DEGRADED, "True", "InvalidSpec", obs.spec_error),
            ConditionUpdate(PROGRESSING, "False", "InvalidSpec", "fix the spec to continue"),
        ]
    if obs.plan is not None and obs.plan.mode == "DoesNotFit":
        message = (
            f"{obs.plan.reason}; required {obs.plan.required_bytes} bytes "
            f"({gib(obs.plan.required_bytes)}), device {obs.plan.device_bytes} bytes "
            f"({gib(obs.plan.device_bytes)}); no Deployment is created"
        )
        ups = [
            ConditionUpdate(DEGRADED, "True", "DoesNotFit", message),
            ConditionUpdate(PROGRESSING, "False", "DoesNotFit", "the target does not fit the GPU"),
        ]
        if dep is None:
            ups.append(ConditionUpdate(READY, "False", "DoesNotFit", "no Deployment"))
        else:
            ups.append(_ready(obs, current, serving_version))
        return ups
    if dep is None:
        if obs.missing_references:
            message = "; ".join(obs.missing_references) + (
                "; the pods cannot start without it, so no pods are created until it exists"
            )
            return [
                ConditionUpdate(READY, "False", "MissingReference", message),
                ConditionUpdate(PROGRESSING, "False", "MissingReference", message),
                ConditionUpdate(DEGRADED, "True", "MissingReference", message),
            ]
        return [
            ConditionUpdate(
                READY, "False", "DeploymentMissing", "the Deployment is not created yet"
            ),
            ConditionUpdate(PROGRESSING, "True", "Creating", "creating the Deployment"),
            ConditionUpdate(DEGRADED, "False", "AsExpected", "no problems observed"),
        ]
    ready = _ready(obs, current, serving_version)
    if obs.missing_references:
        message = "; ".join(obs.missing_references) + (
            "; the pods cannot start without it, so no pods are rolled out until it exists"
        )
        return [
            ready,
            ConditionUpdate(PROGRESSING, "False", "MissingReference", message),
            ConditionUpdate(DEGRADED, "True", "MissingReference", message),
        ]
    if obs.held_revision is not None:
        why = obs.failure_message or (
            "it did not become ready within rollout.progressDeadlineSeconds"
        )
        message = (
            f"revision {obs.held_revision} failed and was rolled back to the last good "
            f"revision: {why}; change the spec to try a new revision"
        )
        return [
            ready,
            ConditionUpdate(PROGRESSING, "False", "RolledBack", message),
            ConditionUpdate(DEGRADED, "True", "RolloutFailed", message),
        ]
    progressing_dep = _deployment_condition(dep, "Progressing")
    if progressing_dep is not None and progressing_dep.get("reason") == "ProgressDeadlineExceeded":
        message = f"revision {obs.revision}: {progressing_dep.get('message', '')}".strip()
        return [
            ready,
            ConditionUpdate(PROGRESSING, "False", "ProgressDeadlineExceeded", message),
            ConditionUpdate(DEGRADED, "True", "ProgressDeadlineExceeded", message),
        ]
    return [ready, _progressing(obs), _drift(obs, previous)]


def _drift(obs: Observation, previous: Mapping[str, Any]) -> ConditionUpdate:
    """Degraded from the scraped acceptance, when nothing worse is going on."""
    acceptance = previous.get("acceptance") or {}
    current = previous.get("currentRevision")
    entry = find(previous.get("revisions") or [], current)
    baseline = (entry or {}).get("baselineRate")
    if acceptance.get("drift") and acceptance.get("revision") == current and baseline is not None:
        threshold = baseline * (1.0 - obs.drift_tolerance)
        return ConditionUpdate(
            DEGRADED,
            "True",
            "AcceptanceDrift",
            f"acceptance rate {acceptance.get('rate', 0.0):.3f} of revision {current} is below "
            f"its baseline {baseline:.3f} x (1 - {obs.drift_tolerance:g}) = {threshold:.3f}",
        )
    return ConditionUpdate(DEGRADED, "False", "AsExpected", "no problems observed")


def _placement_pending(obs: Observation, previous: Mapping[str, Any]) -> list[ConditionUpdate]:
    if obs.placement_pending is not None:
        return [
            ConditionUpdate(
                PLACEMENT_CHANGE_PENDING, "True", "ConfirmationNeeded", obs.placement_pending
            )
        ]
    if find_condition(previous.get("conditions") or [], PLACEMENT_CHANGE_PENDING) is None:
        return []  # never held: no condition at all
    return [
        ConditionUpdate(
            PLACEMENT_CHANGE_PENDING, "False", "AsPlanned", "the placement in force is the plan"
        )
    ]


def build_status(obs: Observation, previous: Mapping[str, Any], *, now: datetime) -> dict[str, Any]:
    """The full status the operator wants; fields it does not own (acceptance) are kept."""
    dep = obs.deployment
    dep_status = (dep or {}).get("status") or {}
    current = previous.get("currentRevision")
    if obs.spec_error is None and dep is not None and serving_at(dep, obs.revision):
        current = obs.revision
    revisions: list[dict[str, Any]] = list(previous.get("revisions") or [])
    if obs.spec_error is None and obs.revision is not None:
        revisions = update_history(
            revisions,
            desired=obs.revision,
            version=obs.version,
            current=current,
            failed=obs.held_revision,
            failure_message=obs.failure_message,
            now=rfc3339(now),
        )
    serving_version = _version_of(revisions, current)
    workload = _workload(obs, previous, current, serving_version)
    updates = (
        [_headroom(obs), *workload, *_placement_pending(obs, previous)]
        if obs.spec_error is None
        else workload
    )
    old_conditions: Sequence[dict[str, Any]] = previous.get("conditions") or []
    conditions = merge_conditions(old_conditions, updates, generation=obs.generation, now=now)
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    conditions.sort(key=lambda c: order.get(str(c["type"]), len(order)))
    result: dict[str, Any] = {
        "observedGeneration": obs.generation,
        "conditions": conditions,
        "currentRevision": current,
        "servingVersion": serving_version,
        "desiredVersion": obs.version or previous.get("desiredVersion"),
        "placement": None
        if obs.plan is None or obs.device is None
        else placement(obs.plan, obs.device),
        "replicas": dep_status.get("replicas", 0) if dep is not None else 0,
        "readyReplicas": dep_status.get("readyReplicas", 0) if dep is not None else 0,
    }
    if obs.spec_error is not None:
        # Keep what was last known instead of inventing a placement for a bad spec.
        result["placement"] = previous.get("placement")
    elif obs.revision is not None:
        result["speculation"] = None if obs.knobs is None else dict(obs.knobs)
        result["revisions"] = revisions
    return result


def normalised(value: Any) -> Any:
    """``value`` as the API server stores it: a merge patch drops null map entries."""
    if isinstance(value, Mapping):
        return {k: normalised(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [normalised(v) for v in value]
    return value


def status_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch from ``current`` to ``desired`` (only owned keys); empty: no write.

    Values compare as stored: an unset knob is ``null`` in the desired status
    and absent from the stored one, which is the same thing, not a change.
    """
    return {k: v for k, v in desired.items() if normalised(current.get(k)) != normalised(v)}
