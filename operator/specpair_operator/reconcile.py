"""One level-based reconcile pass: observe, build, write only what differs.

Free of kopf so that it can be driven by any loop. Given the same cluster
state it writes nothing the second time: every child carries a hash of what
the operator wanted (`builders.HASH_ANNOTATION`), and the status is patched
only where it differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes.client.exceptions import ApiException

from specpair_operator import builders, conditions, headroom, pods
from specpair_operator.api import SpecError, SpeculativePairSpec, parse_spec
from specpair_operator.builders import HASH_ANNOTATION, REVISION_LABEL, Manifest, PairRef
from specpair_operator.history import find, kept_revisions
from specpair_operator.kube import Kube, Obj, object_path, pair_path, path_for, with_conflict_retry
from specpair_operator.metrics import WRITES
from specpair_operator.revision import compute_revision
from specpair_operator.rollback import (
    FAILED_REVISION_ANNOTATION,
    failed_check,
    good_template,
    rolled_back_deployment,
    rollout_failed,
    template_revision,
)
from specpair_operator.status import Observation, build_status, status_patch

EmitEvent = Callable[[str, str, str], None]  # (type, reason, message)
T = TypeVar("T")
log = logging.getLogger("specpair.operator")


class ChildConflict(RuntimeError):
    """A child name is taken by an object this pair does not own."""


@dataclass
class Result:
    """What a pass did (for logs, metrics and tests)."""

    writes: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


def _owned_by(obj: Obj, pair: PairRef) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == pair.uid for ref in refs)


def _replace_body(existing: Obj, desired: Manifest) -> Manifest:
    body: Manifest = {**desired, "metadata": dict(desired["metadata"])}
    body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
    if desired["kind"] == "Service":
        # clusterIP is allocated by the apiserver and immutable.
        spec = dict(body["spec"])
        for key in ("clusterIP", "clusterIPs"):
            if key in existing.get("spec", {}):
                spec[key] = existing["spec"][key]
        body["spec"] = spec
    return body


def apply_child(kube: Kube, pair: PairRef, desired: Manifest) -> str | None:
    """Create or replace one child; None when it is already as wanted."""
    path = object_path(desired)

    def attempt() -> str | None:
        existing = kube.get(path)
        if existing is None:
            try:
                kube.create(object_path(desired, collection=True), desired)
                return "create"
            except ApiException as error:
                if error.status != 409:
                    raise
                existing = kube.get(path)  # a concurrent pass created it
                if existing is None:
                    raise
        if not _owned_by(existing, pair):
            raise ChildConflict(
                f"{desired['kind']} {desired['metadata']['name']} exists and is not owned by "
                f"this SpeculativePair"
            )
        annotations = existing["metadata"].get("annotations") or {}
        if annotations.get(HASH_ANNOTATION) == desired["metadata"]["annotations"][HASH_ANNOTATION]:
            return None
        kube.replace(path, _replace_body(existing, desired))
        return "replace"

    verb = with_conflict_retry(attempt)
    if verb is not None:
        WRITES.labels(kind=desired["kind"], verb=verb).inc()
    return verb


def _nodes(kube: Kube, spec: SpeculativePairSpec) -> list[Obj]:
    if spec.resources.gpus == 0 or spec.resources.gpu_memory is not None:
        return []  # the spec already says how large the device is
    return kube.list("/api/v1/nodes", label_selector=headroom.GPU_MEMORY_LABEL)


def _emit_transitions(before: list[Any], after: list[Any], emit: EmitEvent) -> None:
    """Events only on a condition's status change, so an unchanged pass posts none."""
    for cond in after:
        kind = str(cond["type"])
        if not conditions.transitioned(before, after, kind):
            continue
        bad = (kind == conditions.DEGRADED and cond["status"] == "True") or (
            kind == conditions.HEADROOM_SUFFICIENT and cond["status"] == "False"
        )
        if bad or kind == conditions.HEADROOM_SUFFICIENT:
            emit("Warning" if bad else "Normal", str(cond["reason"]), str(cond["message"]))


def reconcile(kube: Kube, body: Obj, emit: EmitEvent, *, now: datetime | None = None) -> Result:
    """Bring the children and the status of one pair in line with its spec."""
    now = now or datetime.now(UTC)
    pair = PairRef.from_body(body)
    generation = int(body["metadata"].get("generation", 1))
    previous: dict[str, Any] = dict(body.get("status") or {})
    result = Result()
    dep_path = path_for("apps/v1", "deployments", pair.namespace, pair.name)

    try:
        spec = parse_spec(body.get("spec"))
    except SpecError as error:
        # Leave every child as it is: a bad edit must not take down a serving pair.
        obs = Observation(
            generation,
            previous.get("currentRevision"),
            None,
            None,
            kube.get(dep_path),
            spec_error=str(error),
        )
        _write_status(kube, pair, previous, build_status(obs, previous, now=now), emit, result)
        return result

    device = headroom.device_memory(spec, _nodes(kube, spec))
    plan = None if device is None else headroom.plan_for_spec(spec, device)
    speculate = plan is None or plan.mode == "Colocated"
    revision = compute_revision(spec, draft_loaded=speculate)
    annotations = body["metadata"].get("annotations") or {}
    # A revision that failed and was rolled back is not rolled out again.
    held = annotations.get(FAILED_REVISION_ANNOTATION) == revision
    if plan is None or plan.mode != "DoesNotFit":
        children = [
            builders.config_map(pair, spec, revision, speculate=speculate),
            builders.service(pair, spec),
        ]
        if not held:
            # The Deployment last: its pods mount the ConfigMap above.
            children.append(builders.deployment(pair, spec, revision))
        for child in children:
            verb = apply_child(kube, pair, child)
            if verb is not None:
                result.writes.append(f"{verb} {child['kind']}/{child['metadata']['name']}")
    dep = kube.get(dep_path)
    good = previous.get("currentRevision")
    failure = (find(previous.get("revisions") or [], revision) or {}).get("message")
    if dep is not None and good and good != revision and not held:
        rolling: Obj = dep
        nothing: tuple[bool, str | None] = (False, None)
        hard, why = _forbidden_is_none(
            lambda: _new_pods_failure(kube, pair, rolling, revision),
            nothing,
            "list pods (to read why new pods are not ready)",
        )
        if hard or rollout_failed(dep, revision):
            failure = why if hard and why else _deadline_message(spec, why)
            held = _roll_back(kube, pair, body, dep, good, revision, failure, emit, result)
            dep = kube.get(dep_path)
    obs = Observation(
        generation,
        revision,
        plan,
        device,
        dep,
        gpus=spec.resources.gpus,
        held_revision=revision if held else None,
        failure_message=failure if held else None,
        version=spec.version,
        drift_tolerance=spec.acceptance_drift.tolerance,
        knobs=builders.knobs_in_force(spec, speculate=speculate),
    )
    status = build_status(obs, previous, now=now)
    _write_status(kube, pair, previous, status, emit, result)
    _forbidden_is_none(
        lambda: _collect_config_maps(kube, pair, status, revision, result),
        None,
        "list and delete ConfigMaps (to collect old revisions)",
    )
    return result


def _forbidden_is_none(action: Callable[[], T], default: T, what: str) -> T:
    """Run an optional step; without RBAC for it (403) log and go on with ``default``."""
    try:
        return action()
    except ApiException as error:
        if error.status != 403:
            raise
        log.warning(f"not allowed to {what}; grant it in the operator's role: {error.reason}")
        return default


def _deadline_message(spec: SpeculativePairSpec, why: str | None) -> str:
    message = (
        "it did not become ready within rollout.progressDeadlineSeconds "
        f"({spec.rollout.progress_deadline_seconds} s)"
    )
    return message if why is None else f"{message}; {why}"


def _new_pods_failure(
    kube: Kube, pair: PairRef, dep: Obj, revision: str
) -> tuple[bool, str | None]:
    """Whether a pod of the new revision failed for good, and what it says."""
    if template_revision(dep) != revision:
        return False, None
    explanation = None
    for pod in pods.list_pods(kube, pair, revision):
        if pods.is_ready(pod):
            continue
        hard, why = failed_check(pod, pods.readiness_body(pod))
        if hard:
            return True, why
        explanation = explanation or why
    return False, explanation


def stale_config_maps(config_maps: list[Obj], keep: set[str], uid: str) -> list[str]:
    """Names of this pair's revision ConfigMaps whose revision is not kept (pure)."""
    stale = []
    for cm in config_maps:
        meta = cm["metadata"]
        owned = any(ref.get("uid") == uid for ref in meta.get("ownerReferences") or [])
        revision = (meta.get("labels") or {}).get(REVISION_LABEL)
        if owned and revision is not None and revision not in keep:
            stale.append(str(meta["name"]))
    return stale


def _collect_config_maps(
    kube: Kube, pair: PairRef, status: dict[str, Any], revision: str, result: Result
) -> None:
    """Delete the ConfigMaps of revisions neither current, wanted, nor in the history."""
    if "revisions" not in status:
        return  # a bad spec: nothing is known well enough to delete
    keep = kept_revisions(status["revisions"], revision, status.get("currentRevision"))
    selector = f"app.kubernetes.io/instance={pair.name},{REVISION_LABEL}"
    found = kube.list(path_for("v1", "configmaps", pair.namespace), selector)
    for name in stale_config_maps(found, keep, pair.uid):
        kube.delete(path_for("v1", "configmaps", pair.namespace, name))
        WRITES.labels(kind="ConfigMap", verb="delete").inc()
        result.writes.append(f"delete ConfigMap/{name}")


def _roll_back(
    kube: Kube,
    pair: PairRef,
    body: Obj,
    dep: Obj,
    good: str,
    failed: str,
    failure: str,
    emit: EmitEvent,
    result: Result,
) -> bool:
    """Put the last good revision back; False when its ReplicaSet is gone."""
    selector = f"app.kubernetes.io/instance={pair.name},{builders.REVISION_LABEL}={good}"
    replica_sets = kube.list(path_for("apps/v1", "replicasets", pair.namespace), selector)
    template = good_template(replica_sets, good)
    if template is None:
        return False
    # The Deployment first: if the annotation is then lost, the next pass retries
    # the failed revision and rolls back again, instead of holding a broken one.
    dep_path = path_for("apps/v1", "deployments", pair.namespace, pair.name)
    kube.replace(dep_path, rolled_back_deployment(dep, template, good))
    WRITES.labels(kind="Deployment", verb="rollback").inc()
    result.writes.append(f"rollback Deployment/{pair.name} to {good}")
    annotations = body["metadata"].get("annotations") or {}
    if annotations.get(FAILED_REVISION_ANNOTATION) != failed:
        patch = {"metadata": {"annotations": {FAILED_REVISION_ANNOTATION: failed}}}
        kube.merge_patch(pair_path(pair.namespace, pair.name), patch)
        result.writes.append("annotate failed revision")
    emit("Warning", "RolledBack", f"revision {failed} failed: {failure}; rolled back to {good}")
    return True


def _write_status(
    kube: Kube,
    pair: PairRef,
    previous: dict[str, Any],
    desired: dict[str, Any],
    emit: EmitEvent,
    result: Result,
) -> None:
    result.status = desired
    patch = status_patch(previous, desired)
    if not patch:
        return
    try:
        kube.merge_patch(pair_path(pair.namespace, pair.name) + "/status", {"status": patch})
    except ApiException as error:
        if error.status == 404:
            return  # the pair is gone; garbage collection takes the children
        raise
    WRITES.labels(kind="SpeculativePair", verb="patch-status").inc()
    result.writes.append("patch status")
    _emit_transitions(previous.get("conditions") or [], desired["conditions"], emit)
