"""One level-based reconcile pass: observe, build, write only what differs.

Free of kopf so that it can be driven by any loop. It observes through the
`store.Store` the watches keep, so given the same cluster state it sends no
request at all: each child is compared field by field with what the
operator owns (`drift.py`), and written back only where it departs (a hand
edit is drift and is put back); the status is patched only where a value
differs.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes.client.exceptions import ApiException

from specpair_operator import builders, conditions, headroom, inventory, pods, render
from specpair_operator import references as refs
from specpair_operator.api import SpecError, SpeculativePairSpec, parse_pair
from specpair_operator.builders import REVISION_LABEL, Manifest, PairRef
from specpair_operator.drift import corrected, differences
from specpair_operator.engines import lws
from specpair_operator.engines.lws import deployment_view
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
from specpair_operator.status import Observation, build_status, serving_at, status_patch
from specpair_operator.store import (
    CONFIG_MAP,
    DEPLOYMENT,
    LEADER_WORKER_SET,
    NODE,
    PAIR,
    POD,
    REPLICA_SET,
    Store,
)
from specpair_runtime.planner import Plan

EmitEvent = Callable[[str, str, str], None]  # (type, reason, message)
# The documented opt-in for an HPA (or KEDA) that owns the Deployment's replicas.
EXTERNAL_REPLICAS_ANNOTATION = "specpair.dev/external-replicas"
T = TypeVar("T")
log = logging.getLogger("specpair.operator")


class ChildConflict(RuntimeError):
    """A child name is taken by an object this pair does not own."""


@dataclass
class Result:
    """What a pass did (for logs, metrics and tests)."""

    writes: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    # True when a pass over the same objects would do nothing, and nothing in it
    # waits on time or on what is not watched (pods' /readyz, Secrets).
    settled: bool = False


def _owned_by(obj: Obj, pair: PairRef) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == pair.uid for ref in refs)


def apply_child(kube: Kube, store: Store, pair: PairRef, desired: Manifest) -> str | None:
    """Create the child, or put its owned fields back; None when it is already in line.

    The live copy comes from the store (no request); only a write, or a
    conflict that proves the copy stale, goes to the API server.
    """
    kind, path = desired["kind"], object_path(desired)
    name = desired["metadata"]["name"]
    fresh = False

    def attempt() -> str | None:
        nonlocal fresh
        live = kube.get(path) if fresh else store.peek(kind, pair.namespace, name)
        fresh = True  # a retry after a conflict reads the server's copy
        if live is None:
            try:
                store.put(kind, kube.create(object_path(desired, collection=True), desired))
                return "create"
            except ApiException as error:
                if error.status != 409:
                    raise
                live = kube.get(path)  # created meanwhile, or a stale store
                if live is None:
                    raise
                store.put(kind, live)
        if not _owned_by(live, pair):
            raise ChildConflict(f"{kind} {name} exists and is not owned by this SpeculativePair")
        drifted = differences(desired, live)
        if not drifted:
            return None
        log.info(
            f"{kind} {pair.namespace}/{name} departs from the spec at {', '.join(drifted[:5])}"
        )
        store.put(kind, kube.replace(path, corrected(desired, live)))
        return "replace"

    verb = with_conflict_retry(attempt)
    if verb is not None:
        WRITES.labels(kind=kind, verb=verb).inc()
    return verb


def _nodes(store: Store, spec: SpeculativePairSpec) -> list[Obj]:
    res = spec.resources
    # engine vllm also reads how many GPUs a node has, unless the spec says.
    counted = spec.engine != "vllm" or res.gpus_per_node is not None
    if res.gpus == 0 or (res.gpu_memory is not None and counted):
        return []  # the spec already says how large the device is
    return store.select(NODE, None, {})


def _emit_transitions(before: list[Any], after: list[Any], emit: EmitEvent) -> None:
    """Events only on a condition's status change, so an unchanged pass posts none."""
    for cond in after:
        kind = str(cond["type"])
        if not conditions.transitioned(before, after, kind):
            continue
        status = cond["status"]
        bad = (
            (kind == conditions.DEGRADED and status == "True")
            or (kind == conditions.HEADROOM_SUFFICIENT and status != "True")
            or (kind == conditions.PLACEMENT_CHANGE_PENDING and status == "True")
        )
        if bad or kind == conditions.HEADROOM_SUFFICIENT:
            emit("Warning" if bad else "Normal", str(cond["reason"]), str(cond["message"]))


def external_replicas(body: Obj) -> bool:
    """Whether an autoscaler owns the Deployment's replicas (the documented opt-in)."""
    annotations = body["metadata"].get("annotations") or {}
    return str(annotations.get(EXTERNAL_REPLICAS_ANNOTATION, "")).lower() == "true"


def _without_replicas(desired: Manifest) -> Manifest:
    """The Deployment minus ``spec.replicas``: the autoscaler's field is not compared."""
    spec = {k: v for k, v in desired["spec"].items() if k != "replicas"}
    return {**desired, "spec": spec}


def reconcile(
    kube: Kube,
    store: Store,
    body: Obj,
    emit: EmitEvent,
    *,
    now: datetime | None = None,
    checker: refs.Checker | None = None,
) -> Result:
    """Bring the children and the status of one pair in line with its spec.

    Reads come from ``store``; the API server sees only writes, plus one GET
    per referenced Secret/ConfigMap before pods roll out (`references.Checker`).
    """
    now = now or datetime.now(UTC)
    checker = checker or refs.Checker()
    pair = PairRef.from_body(body)
    generation = int(body["metadata"].get("generation", 1))
    previous: dict[str, Any] = dict(body.get("status") or {})
    annotations = body["metadata"].get("annotations") or {}
    result = Result()

    def deployment() -> Obj | None:
        found = store.peek(DEPLOYMENT, pair.namespace, pair.name)
        if found is None:  # engine vllm past one node: read the LeaderWorkerSet as one
            group = store.peek(LEADER_WORKER_SET, pair.namespace, pair.name)
            found = None if group is None else deployment_view(group)
        return found

    try:
        spec = parse_pair(body)  # the name too: v1.20 skips the CEL rule on metadata.name
    except SpecError as error:
        # Leave every child as it is: a bad edit must not take down a serving pair.
        obs = Observation(
            generation,
            previous.get("currentRevision"),
            None,
            None,
            deployment(),
            spec_error=str(error),
        )
        _write_status(kube, store, pair, body, build_status(obs, previous, now=now), emit, result)
        result.settled = not result.writes
        return result

    good = previous.get("currentRevision")
    placed = inventory.decide(
        spec,
        headroom.device_memory(spec, _nodes(store, spec)),
        previous.get("placement"),
        serving=good is not None,
        confirm=annotations.get(inventory.CONFIRM_ANNOTATION),
    )
    device, plan = placed.device, placed.plan
    speculate = plan is None or plan.mode == "Colocated"
    revision = compute_revision(spec, draft_loaded=speculate)
    # A revision that failed and was rolled back is not rolled out again.
    held = annotations.get(FAILED_REVISION_ANNOTATION) == revision
    missing: list[str] = []
    if plan is None or plan.mode != "DoesNotFit":
        config_map, service, wanted = _children(
            pair, spec, generation, revision, speculate, plan, device
        )
        for child in (config_map, service):
            _apply(kube, store, pair, child, result)
        if not held:
            # The Deployment last: its pods mount the ConfigMap above.
            live = store.peek(wanted["kind"], pair.namespace, pair.name)
            if live is not None and external_replicas(body):
                wanted = _without_replicas(wanted)
            changes = live is None or bool(differences(wanted, live))
            serving = serving_at(deployment() or {}, revision)
            if changes or not serving or _was_missing(previous):
                force = changes or _was_missing(previous)
                missing = _forbidden_is_none(
                    lambda: checker.missing(
                        kube,
                        pair.namespace,
                        pair.uid,
                        generation,
                        refs.references(spec),
                        force=force,
                    ),
                    [],
                    "get the Secrets and ConfigMaps the pair names",
                )
            if not missing:
                _apply(kube, store, pair, wanted, result)
    dep = deployment()
    failure = (find(previous.get("revisions") or [], revision) or {}).get("message")
    if dep is not None and good and good != revision and not held:
        rolling: Obj = dep
        hard, why = _new_pods_failure(store, pair, rolling, revision)
        if hard or rollout_failed(dep, revision):
            failure = why if hard and why else _deadline_message(spec, why)
            held = _roll_back(kube, store, pair, body, dep, good, revision, failure, emit, result)
            dep = deployment()
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
        missing_references=tuple(missing),
        placement_pending=placed.pending,
    )
    status = build_status(obs, previous, now=now)
    _write_status(kube, store, pair, body, status, emit, result)
    _forbidden_is_none(
        lambda: _collect_config_maps(kube, store, pair, status, revision, result),
        None,
        "delete ConfigMaps (to collect old revisions)",
    )
    rolling_over_serving = dep is not None and bool(good) and good != revision and not held
    unchecked_references = bool(refs.references(spec)) and not serving_at(dep or {}, revision)
    result.settled = not (result.writes or missing or rolling_over_serving or unchecked_references)
    return result


_CHILDREN_CACHE_SIZE = 4096
_children_cache: OrderedDict[tuple[object, ...], tuple[Manifest, ...]] = OrderedDict()
_children_lock = threading.Lock()


def _children(
    pair: PairRef,
    spec: SpeculativePairSpec,
    generation: int,
    revision: str,
    speculate: bool,
    plan: Plan | None = None,
    device: headroom.DeviceMemory | None = None,
) -> tuple[Manifest, Manifest, Manifest]:
    """ConfigMap, Service and workload as wanted (built once per spec generation).

    A pass over an unchanged pair builds nothing: rendering ``runtime.yaml``
    was half of its time. The manifests are shared: never change them.
    """
    per_node = None if device is None else device.gpus_per_node
    # vLLM's pods also follow the plan's layout (memory share, nodes).
    shape = (None if plan is None else plan.parallel, per_node) if spec.engine == "vllm" else None
    key = (pair.uid, generation, revision, speculate, shape)
    with _children_lock:
        found = _children_cache.get(key)
        if found is not None:
            _children_cache.move_to_end(key)
    if found is None:
        found = render.children(
            pair, spec, revision, speculate=speculate, plan=plan, per_node=per_node
        )
        with _children_lock:
            _children_cache[key] = found
            while len(_children_cache) > _CHILDREN_CACHE_SIZE:
                _children_cache.popitem(last=False)
    config_map, service, workload = found
    return config_map, service, workload


def _was_missing(previous: dict[str, Any]) -> bool:
    degraded = conditions.find(previous.get("conditions") or [], conditions.DEGRADED)
    return degraded is not None and degraded.get("reason") == "MissingReference"


def _apply(kube: Kube, store: Store, pair: PairRef, child: Manifest, result: Result) -> None:
    verb = apply_child(kube, store, pair, child)
    if verb is not None:
        result.writes.append(f"{verb} {child['kind']}/{child['metadata']['name']}")


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


def _pods(store: Store, pair: PairRef, revision: str) -> list[Obj]:
    selector = {"app.kubernetes.io/instance": pair.name, REVISION_LABEL: revision}
    return store.select(POD, pair.namespace, selector)


def _new_pods_failure(
    store: Store, pair: PairRef, dep: Obj, revision: str
) -> tuple[bool, str | None]:
    """Whether a pod of the new revision failed for good, and what it says."""
    if template_revision(dep) != revision:
        return False, None
    explanation = None
    for pod in _pods(store, pair, revision):
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
    kube: Kube, store: Store, pair: PairRef, status: dict[str, Any], revision: str, result: Result
) -> None:
    """Delete the ConfigMaps of revisions neither current, wanted, nor in the history."""
    if "revisions" not in status:
        return  # a bad spec: nothing is known well enough to delete
    keep = kept_revisions(status["revisions"], revision, status.get("currentRevision"))
    found = store.select(CONFIG_MAP, pair.namespace, {"app.kubernetes.io/instance": pair.name})
    for name in stale_config_maps(found, keep, pair.uid):
        kube.delete(path_for("v1", "configmaps", pair.namespace, name))
        store.remove(CONFIG_MAP, pair.namespace, name)
        WRITES.labels(kind="ConfigMap", verb="delete").inc()
        result.writes.append(f"delete ConfigMap/{name}")


def _roll_back(
    kube: Kube,
    store: Store,
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
    if dep.get("kind") == lws.KIND:
        if not _roll_back_group(kube, store, pair, good):
            return False
    else:
        selector = {"app.kubernetes.io/instance": pair.name, builders.REVISION_LABEL: good}
        template = good_template(store.select(REPLICA_SET, pair.namespace, selector), good)
        if template is None:
            return False
        # The Deployment first: if the annotation is then lost, the next pass retries
        # the failed revision and rolls back again, instead of holding a broken one.
        dep_path = path_for("apps/v1", "deployments", pair.namespace, pair.name)
        store.put(DEPLOYMENT, kube.replace(dep_path, rolled_back_deployment(dep, template, good)))
        WRITES.labels(kind="Deployment", verb="rollback").inc()
    result.writes.append(f"rollback Deployment/{pair.name} to {good}")
    annotations = body["metadata"].get("annotations") or {}
    if annotations.get(FAILED_REVISION_ANNOTATION) != failed:
        patch = {"metadata": {"annotations": {FAILED_REVISION_ANNOTATION: failed}}}
        updated = kube.merge_patch(pair_path(pair.namespace, pair.name), patch)
        store.put(PAIR, updated)
        body["metadata"] = updated["metadata"]
        result.writes.append("annotate failed revision")
    emit("Warning", "RolledBack", f"revision {failed} failed: {failure}; rolled back to {good}")
    return True


def _roll_back_group(kube: Kube, store: Store, pair: PairRef, good: str) -> bool:
    """A LeaderWorkerSet's good group template back, from its revision's ConfigMap."""
    group = store.peek(LEADER_WORKER_SET, pair.namespace, pair.name)
    cm = store.peek(CONFIG_MAP, pair.namespace, builders.config_map_name(pair, good))
    template = lws.good_group_template(cm)
    if group is None or template is None:
        return False
    path = path_for(lws.API_VERSION, lws.PLURAL, pair.namespace, pair.name)
    store.put(LEADER_WORKER_SET, kube.replace(path, lws.rolled_back_group(group, template, good)))
    WRITES.labels(kind=lws.KIND, verb="rollback").inc()
    return True


def _write_status(
    kube: Kube,
    store: Store,
    pair: PairRef,
    body: Obj,
    desired: dict[str, Any],
    emit: EmitEvent,
    result: Result,
) -> None:
    previous: dict[str, Any] = dict(body.get("status") or {})
    result.status = desired
    patch = status_patch(previous, desired)
    if not patch:
        return
    try:
        updated = kube.merge_patch(
            pair_path(pair.namespace, pair.name) + "/status", {"status": patch}
        )
    except ApiException as error:
        if error.status == 404:
            return  # the pair is gone; garbage collection takes the children
        raise
    store.put(PAIR, updated)
    WRITES.labels(kind="SpeculativePair", verb="patch-status").inc()
    result.writes.append("patch status")
    _emit_transitions(previous.get("conditions") or [], desired["conditions"], emit)
