"""One level-based reconcile pass: observe, build, write only what differs.

Free of kopf so that it can be driven by any loop. Given the same cluster
state it writes nothing the second time: every child carries a hash of what
the operator wanted (`builders.HASH_ANNOTATION`), and the status is patched
only where it differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from specpair_operator import builders, conditions, headroom
from specpair_operator.api import SpecError, SpeculativePairSpec, parse_spec
from specpair_operator.builders import HASH_ANNOTATION, Manifest, PairRef
from specpair_operator.kube import Kube, Obj, object_path, pair_path, path_for, with_conflict_retry
from specpair_operator.metrics import WRITES
from specpair_operator.revision import compute_revision
from specpair_operator.rollback import (
    FAILED_REVISION_ANNOTATION,
    good_template,
    rolled_back_deployment,
    rollout_failed,
)
from specpair_operator.status import Observation, build_status, status_patch

EmitEvent = Callable[[str, str, str], None]  # (type, reason, message)


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
    if dep is not None and good and good != revision and rollout_failed(dep, revision):
        held = _roll_back(kube, pair, body, dep, good, revision, emit, result) or held
        dep = kube.get(dep_path)
    obs = Observation(
        generation,
        revision,
        plan,
        device,
        dep,
        gpus=spec.resources.gpus,
        held_revision=revision if held else None,
    )
    _write_status(kube, pair, previous, build_status(obs, previous, now=now), emit, result)
    return result


def _roll_back(
    kube: Kube,
    pair: PairRef,
    body: Obj,
    dep: Obj,
    good: str,
    failed: str,
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
    emit(
        "Warning",
        "RolledBack",
        f"revision {failed} did not become ready within rollout.progressDeadlineSeconds; "
        f"rolled back to revision {good}",
    )
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
