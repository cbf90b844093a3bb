"""One level-based reconcile pass: observe, build, write only what differs.

Free of kopf so that it can be driven by any loop. It observes through the
`store.Store` the watches keep, so given the same cluster state it sends no
request at all: each child is compared field by field with what the
operator owns (`drift.py`), and written back only where it departs (a hand
edit is drift and is put back); the status is patched only where a value
differs.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes.client.exceptions import ApiException

from specpair_operator import builders, conditions, effectiveness, headroom, inventory, pods, render
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
    """Events only on a condition's status change, so an unchanged pass posts none.

    A Warning when a condition turns bad (also when it first appears so); a
    Normal one only when it recovers from an earlier state: a new pair that is
    fine posts nothing (a write per pair at creation, for no news).
    SpeculationEffective also on a change of reason: the runtime falling back
    is news even when the draft was already known not to help.
    """
    for cond in after:
        kind, status, reason = str(cond["type"]), cond["status"], str(cond["reason"])
        speculation = kind == conditions.SPECULATION_EFFECTIVE
        if not conditions.transitioned(before, after, kind, reason=speculation):
            continue
        bad = (
            (kind == conditions.DEGRADED and status == "True")
            or (kind == conditions.HEADROOM_SUFFICIENT and status != "True")
            or (kind == conditions.PLACEMENT_CHANGE_PENDING and status == "True")
            or (speculation and reason in effectiveness.NOT_HELPING)
        )
        recovered = conditions.find(before, kind) is not None and (
            kind == conditions.HEADROOM_SUFFICIENT or (speculation and status == "True")
        )
        if bad or recovered:
            emit("Warning" if bad else "Normal", reason, str(cond["message"]))


def external_replicas(body: Obj) -> bool:
    """Whether an autoscaler owns the Deployment's replicas (the documented opt-in)."""
    annotations = body["metadata"].get("annotations") or {}
    return str(annotations.get(EXTERNAL_REPLICAS_ANNOTATION, "")).lower() == "true"


def _without_replicas(desired: Manifest) -> Manifest:
    """The Deployment minus ``spec.replicas``: the autoscaler's field is not compared."""
    spec = {k: v for k, v in desired["spec"].items() if k != "replicas"}
    return {**desired, "spec": spec}


@dataclass
class _Pass:
    """One pass over one pair: its inputs, read once, and what it did."""

    kube: Kube
    store: Store
    body: Obj
    emit: EmitEvent
    now: datetime
    checker: refs.Checker
    pair: PairRef
    generation: int
    previous: dict[str, Any]
    annotations: dict[str, Any]
    result: Result = field(default_factory=Result)

    @classmethod
    def of(
        cls,
        kube: Kube,
        store: Store,
        body: Obj,
        emit: EmitEvent,
        now: datetime,
        checker: refs.Checker,
    ) -> _Pass:
        meta = body["metadata"]
        return cls(
            kube,
            store,
            body,
            emit,
            now,
            checker,
            PairRef.from_body(body),
            int(meta.get("generation", 1)),
            dict(body.get("status") or {}),
            dict(meta.get("annotations") or {}),
        )

    def deployment(self) -> Obj | None:
        """The workload as a Deployment: engine vllm past one node reads its LeaderWorkerSet."""
        found = self.store.peek(DEPLOYMENT, self.pair.namespace, self.pair.name)
        if found is None:
            group = self.store.peek(LEADER_WORKER_SET, self.pair.namespace, self.pair.name)
            found = None if group is None else deployment_view(group)
        return found

    def write_status(self, status: dict[str, Any]) -> None:
        _write_status(self.kube, self.store, self.pair, self.body, status, self.emit, self.result)


@dataclass(frozen=True)
class _Target:
    """Where the spec leads: the placement, the revision, and whether it is held."""

    placed: inventory.Placement
    speculate: bool
    revision: str
    held: bool  # failed and rolled back: not rolled out again

    @property
    def fits(self) -> bool:
        return self.placed.plan is None or self.placed.plan.mode != "DoesNotFit"


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
    run = _Pass.of(kube, store, body, emit, now or datetime.now(UTC), checker or refs.Checker())
    try:
        spec = parse_pair(body)  # the name too: v1.20 skips the CEL rule on metadata.name
    except SpecError as error:
        return _report_invalid_spec(run, str(error))
    target = _target(run, spec)
    missing = _apply_children(run, spec, target) if target.fits else []
    dep, held, failure = _check_rollout(run, spec, target)
    status = build_status(
        _observation(run, spec, target, dep, held, failure, missing), run.previous, now=run.now
    )
    run.write_status(status)
    _forbidden_is_none(
        lambda: _collect_config_maps(kube, store, run.pair, status, target.revision, run.result),
        None,
        "delete ConfigMaps (to collect old revisions)",
    )
    run.result.settled = _settled(run, spec, target.revision, dep, held, missing)
    return run.result


def _report_invalid_spec(run: _Pass, error: str) -> Result:
    """Only the status: a bad edit must not take down a serving pair, so no child changes."""
    obs = Observation(
        run.generation,
        run.previous.get("currentRevision"),
        None,
        None,
        run.deployment(),
        spec_error=error,
        selector=builders.selector_string(run.pair),
    )
    run.write_status(build_status(obs, run.previous, now=run.now))
    run.result.settled = not run.result.writes
    return run.result


def _target(run: _Pass, spec: SpeculativePairSpec) -> _Target:
    """The placement (from the spec, the nodes and what serves), the revision, the hold."""
    placed = inventory.decide(
        spec,
        headroom.device_memory(spec, _nodes(run.store, spec)),
        run.previous.get("placement"),
        serving=run.previous.get("currentRevision") is not None,
        confirm=run.annotations.get(inventory.CONFIRM_ANNOTATION),
    )
    plan = placed.plan
    speculate = plan is None or plan.mode == "Colocated"
    revision = compute_revision(spec, draft_loaded=speculate)
    held = run.annotations.get(FAILED_REVISION_ANNOTATION) == revision
    return _Target(placed, speculate, revision, held)


def _apply_children(run: _Pass, spec: SpeculativePairSpec, target: _Target) -> list[str]:
    """ConfigMap and Service, then the Deployment unless a reference it needs is missing.

    Returns the missing references (empty when the Deployment was applied or held).
    """
    placed = target.placed
    config_map, service, wanted = _children(
        run.pair,
        spec,
        run.generation,
        target.revision,
        target.speculate,
        placed.plan,
        placed.device,
    )
    for child in (config_map, service):
        _apply(run.kube, run.store, run.pair, child, run.result)
    if target.held:
        return []
    # The workload last: its pods mount the ConfigMap above.
    live = run.store.peek(wanted["kind"], run.pair.namespace, run.pair.name)
    if live is not None and external_replicas(run.body):
        wanted = _without_replicas(wanted)
    missing = _missing_references(run, spec, target.revision, live, wanted)
    if not missing:
        _apply(run.kube, run.store, run.pair, wanted, run.result)
    return missing


def _missing_references(
    run: _Pass, spec: SpeculativePairSpec, revision: str, live: Obj | None, wanted: Manifest
) -> list[str]:
    """The Secrets and ConfigMaps the pods need and do not find, checked before pods roll."""
    changes = live is None or bool(differences(wanted, live))
    was_missing = _was_missing(run.previous)
    if not (changes or not serving_at(run.deployment() or {}, revision) or was_missing):
        return []
    return _forbidden_is_none(
        lambda: run.checker.missing(
            run.kube,
            run.pair.namespace,
            run.pair.uid,
            run.generation,
            refs.references(spec),
            force=changes or was_missing,
        ),
        [],
        "get the Secrets and ConfigMaps the pair names",
    )


def _check_rollout(
    run: _Pass, spec: SpeculativePairSpec, target: _Target
) -> tuple[Obj | None, bool, str | None]:
    """A new revision over a serving one: roll it back when it failed for good.

    Returns the Deployment as it now is, whether the revision is held, and the
    failure message of the revision (from this pass, or from its history).
    """
    dep = run.deployment()
    good = run.previous.get("currentRevision")
    revision, held = target.revision, target.held
    failure = (find(run.previous.get("revisions") or [], revision) or {}).get("message")
    if dep is None or not good or good == revision or held:
        return dep, held, failure
    hard, why = _new_pods_failure(run.store, run.pair, dep, revision)
    if not (hard or rollout_failed(dep, revision)):
        return dep, held, failure
    failure = why if hard and why else _deadline_message(spec, why)
    held = _roll_back(
        run.kube, run.store, run.pair, run.body, dep, good, revision, failure, run.emit, run.result
    )
    return run.deployment(), held, failure


def _observation(
    run: _Pass,
    spec: SpeculativePairSpec,
    target: _Target,
    dep: Obj | None,
    held: bool,
    failure: str | None,
    missing: list[str],
) -> Observation:
    return Observation(
        run.generation,
        target.revision,
        target.placed.plan,
        target.placed.device,
        dep,
        gpus=spec.resources.gpus,
        held_revision=target.revision if held else None,
        failure_message=failure if held else None,
        version=spec.version,
        drift_tolerance=spec.acceptance_drift.tolerance,
        knobs=builders.knobs_in_force(spec, speculate=target.speculate),
        missing_references=tuple(missing),
        placement_pending=target.placed.pending,
        selector=builders.selector_string(run.pair),
        min_drafted_tokens=spec.acceptance_drift.min_drafted_tokens,
        break_even=effectiveness.break_even_rate(spec),
    )


def _settled(
    run: _Pass,
    spec: SpeculativePairSpec,
    revision: str,
    dep: Obj | None,
    held: bool,
    missing: list[str],
) -> bool:
    """Whether a pass over the same objects would do nothing, waiting on nothing unwatched."""
    good = run.previous.get("currentRevision")
    rolling_over_serving = dep is not None and bool(good) and good != revision and not held
    unchecked_references = bool(refs.references(spec)) and not serving_at(dep or {}, revision)
    return not (run.result.writes or missing or rolling_over_serving or unchecked_references)


_CHILDREN_CACHE_SIZE = 4096
_children_cache: OrderedDict[tuple[object, ...], str] = OrderedDict()
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
    was half of its time. The cache keeps them as JSON, a fifth of the memory
    of the dicts (about 20 MiB at a thousand pairs); parsing it back costs
    a small fraction of building them.
    """
    per_node = None if device is None else device.gpus_per_node
    # vLLM's pods also follow the plan's layout (memory share, nodes).
    shape = (None if plan is None else plan.parallel, per_node) if spec.engine == "vllm" else None
    key = (pair.uid, generation, revision, speculate, shape)
    with _children_lock:
        found = _children_cache.get(key)
        if found is not None:
            _children_cache.move_to_end(key)
    if found is not None:
        config_map, service, workload = json.loads(found)
        return config_map, service, workload
    built = render.children(pair, spec, revision, speculate=speculate, plan=plan, per_node=per_node)
    with _children_lock:
        _children_cache[key] = json.dumps(built, separators=(",", ":"))
        while len(_children_cache) > _CHILDREN_CACHE_SIZE:
            _children_cache.popitem(last=False)
    config_map, service, workload = built
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
    """Put the last good revision back; False when its template is gone."""
    if dep.get("kind") == lws.KIND:
        if not _roll_back_group(kube, store, pair, good):
            return False
    elif not _roll_back_deployment(kube, store, pair, dep, good):
        return False
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


def _roll_back_deployment(kube: Kube, store: Store, pair: PairRef, dep: Obj, good: str) -> bool:
    """The good revision's pod template back, from its ReplicaSet.

    The ReplicaSets are listed here, by label, rather than watched: only a
    rollback reads them, and watching every pair's would cost memory and an
    event per change for nothing.
    """
    selector = f"app.kubernetes.io/instance={pair.name},{builders.REVISION_LABEL}={good}"
    found = kube.list(path_for("apps/v1", "replicasets", pair.namespace), selector)
    template = good_template(found, good)
    if template is None:
        return False
    # The Deployment first: if the annotation is then lost, the next pass retries
    # the failed revision and rolls back again, instead of holding a broken one.
    dep_path = path_for("apps/v1", "deployments", pair.namespace, pair.name)
    store.put(DEPLOYMENT, kube.replace(dep_path, rolled_back_deployment(dep, template, good)))
    WRITES.labels(kind="Deployment", verb="rollback").inc()
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
