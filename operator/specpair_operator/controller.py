"""The operator's engine: watch events in, a work queue, reconcile workers out.

- kopf's watch streams (`handlers.py`) hand every event of a pair, its
  children (Deployments, ReplicaSets, Pods, ConfigMaps, Services, selected
  server-side by the ``app.kubernetes.io/managed-by`` label) and the GPU
  nodes to `Controller.observe`. The event updates the `store.Store` and
  queues the owning pair, so a hand edit of a child is seen at once.
- Workers take pair keys from the de-duplicating `workqueue.WorkQueue` and
  run `reconcile.reconcile` over the store: a pass over an unchanged pair
  sends no request.
- A resync re-queues every pair every ``resync_seconds`` from the store
  (level-based, and free: no list request). A pair whose last pass settled
  (wrote nothing, waits on nothing unwatched) and saw no event since is
  skipped, except at every tenth round.
- Failures: conflicts, throttling, 5xx and lost connections are retried with
  exponential backoff (1 s doubling to 60 s); a rejection (400/403/422) or a
  child name owned by someone else is reported (``Degraded``, a Warning Event)
  and retried only at the next resync or change.
- With a `leader.LeaderElector`, every replica watches (a warm store makes
  failover fast) but only the leader reconciles and scrapes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from specpair_operator import api, conditions, metrics
from specpair_operator.builders import REVISION_LABEL
from specpair_operator.events import post_event
from specpair_operator.headroom import GPU_MEMORY_LABEL, node_usable
from specpair_operator.kube import Kube, pair_path, path_for
from specpair_operator.leader import LeaderElector
from specpair_operator.reconcile import ChildConflict, reconcile
from specpair_operator.references import Checker
from specpair_operator.scraper import Scraper
from specpair_operator.store import (
    CONFIG_MAP,
    DEPLOYMENT,
    LEADER_WORKER_SET,
    NODE,
    PAIR,
    POD,
    REPLICA_SET,
    SERVICE,
    Key,
    Obj,
    Store,
    key_of,
)
from specpair_operator.workqueue import ShutDown, WorkQueue

log = logging.getLogger("specpair.operator")

MANAGED_SELECTOR = "app.kubernetes.io/managed-by=specpair-operator"
INSTANCE_LABEL = "app.kubernetes.io/instance"
TEMPORARY = {408, 409, 429, 500, 502, 503, 504}
FULL_RESYNC_EVERY = 10


class Watched:
    """What the operator watches: API path and server-side label selector per kind."""

    PATHS: Mapping[str, tuple[str, str, bool]] = {
        # kind: (api version, plural, namespaced)
        PAIR: (api.API_VERSION, api.PLURAL, True),
        DEPLOYMENT: ("apps/v1", "deployments", True),
        REPLICA_SET: ("apps/v1", "replicasets", True),
        POD: ("v1", "pods", True),
        CONFIG_MAP: ("v1", "configmaps", True),
        SERVICE: ("v1", "services", True),
        NODE: ("v1", "nodes", False),
        LEADER_WORKER_SET: ("leaderworkerset.x-k8s.io/v1", "leaderworkersets", True),
    }
    # Kinds whose CRD a cluster may lack: not served (404) means none exist.
    OPTIONAL: frozenset[str] = frozenset({LEADER_WORKER_SET})
    SELECTORS: Mapping[str, str] = {
        DEPLOYMENT: MANAGED_SELECTOR,
        REPLICA_SET: MANAGED_SELECTOR,
        POD: MANAGED_SELECTOR,
        CONFIG_MAP: MANAGED_SELECTOR,
        SERVICE: MANAGED_SELECTOR,
        NODE: GPU_MEMORY_LABEL,
        LEADER_WORKER_SET: MANAGED_SELECTOR,
    }


def owner_key(kind: str, obj: Mapping[str, Any]) -> Key | None:
    """The pair an object belongs to: itself, or the instance label of a child."""
    namespace, name = key_of(obj)
    if kind == PAIR:
        return namespace, name
    instance = ((obj.get("metadata") or {}).get("labels") or {}).get(INSTANCE_LABEL)
    return (namespace, str(instance)) if instance else None


def node_summary(node: Mapping[str, Any] | None) -> tuple[object, ...] | None:
    """What of a node the plans depend on; heartbeats alone change nothing here."""
    if node is None:
        return None
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    return (
        (meta.get("labels") or {}).get(GPU_MEMORY_LABEL),
        tuple(sorted((meta.get("labels") or {}).items())),
        node_usable(node),
        repr(spec.get("taints") or []),
    )


def is_temporary(error: BaseException) -> bool:
    if isinstance(error, ApiException):
        return error.status in TEMPORARY or error.status == 0
    return not isinstance(error, ChildConflict)


class Controller:
    def __init__(
        self,
        kube: Kube,
        *,
        namespaces: list[str],
        resync_seconds: float,
        scrape_seconds: float,
        workers: int = 4,
        leader: LeaderElector | None = None,
    ) -> None:
        self.kube, self.namespaces = kube, namespaces
        self.resync_seconds, self.scrape_seconds = resync_seconds, scrape_seconds
        self.store = Store()
        self.references = Checker()
        self.queue: WorkQueue[Key] = WorkQueue(base=1.0, cap=60.0)
        self.leader = leader
        self.stop_event = threading.Event()
        self.primed = threading.Event()
        self._workers = workers
        self._threads: list[threading.Thread] = []
        self._why: dict[Key, str] = {}
        self._why_lock = threading.Lock()
        # What a resync may skip: pairs whose last pass settled, with no event since.
        self._changes: dict[Key, int] = {}
        self._node_changes = 0
        self._settled: dict[Key, tuple[int, int]] = {}
        self._resyncs = 0
        if leader is not None:
            leader.on_started = lambda: self.enqueue_all("leader")

    # -- intake -------------------------------------------------------------------------

    def active(self) -> bool:
        return self.leader is None or self.leader.is_leader()

    def enqueue(self, key: Key, why: str) -> None:
        with self._why_lock:
            self._why.setdefault(key, why)
        self.queue.add(key)

    def enqueue_all(self, why: str) -> None:
        for key in self.store.keys(PAIR):
            self.enqueue(key, why)

    def mark(self, key: Key) -> tuple[int, int]:
        """How many events concern ``key`` (and the nodes) so far."""
        with self._why_lock:
            return self._changes.get(key, 0), self._node_changes

    def _changed(self, key: Key | None) -> None:
        with self._why_lock:
            if key is None:
                self._node_changes += 1
            else:
                self._changes[key] = self._changes.get(key, 0) + 1

    def observe(self, kind: str, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """One watch event: update the store; queue the pair it concerns if it changed."""
        namespace, name = key_of(obj)
        before = node_summary(self.store.peek(NODE, namespace, name)) if kind == NODE else None
        if event_type == "DELETED":
            self.store.remove(kind, namespace, name)
            changed = True
        else:
            changed = self.store.put(kind, obj)
        if not changed:
            return  # the copy of the operator's own write is already in the store
        if kind == NODE:
            after = None if event_type == "DELETED" else node_summary(obj)
            if after != before:
                self._changed(None)
                self.enqueue_all("node")
            return
        key = owner_key(kind, obj)
        if key is not None:
            self._changed(key)
        if kind == REPLICA_SET:
            return  # read by rollbacks only; its Deployment and pods carry the news
        if kind == POD and key is not None and not self._pod_matters(key, obj):
            return
        if key is not None and (kind != PAIR or event_type != "DELETED"):
            self.enqueue(key, "pair" if kind == PAIR else kind.lower())

    def _pod_matters(self, key: Key, pod: Mapping[str, Any]) -> bool:
        """A pod's own events matter while a new revision rolls out over a serving one.

        Then a pod that failed for good (terminated, or its ``/readyz`` failed)
        is rolled back at once. Otherwise its Deployment's status carries the news.
        """
        pair = self.store.peek(PAIR, *key)
        current = ((pair or {}).get("status") or {}).get("currentRevision")
        revision = ((pod.get("metadata") or {}).get("labels") or {}).get(REVISION_LABEL)
        return current is not None and revision != current

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._spawn(self._main, "specpair-controller")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        self.stop_event.set()
        self.queue.shutdown()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _main(self) -> None:
        leader = self.leader
        if leader is not None:
            self._spawn(lambda: leader.run(self.stop_event), "specpair-lease")
        self.prime()
        if self.stop_event.is_set():
            return
        for index in range(self._workers):
            self._spawn(self._work, f"specpair-worker-{index}")
        self._spawn(self._resync, "specpair-resync")
        self._spawn(self._scrape, "specpair-scrape")
        self.enqueue_all("start")

    def _scopes(self, namespaced: bool) -> list[str | None]:
        return [*self.namespaces] if namespaced and self.namespaces else [None]

    def prime(self) -> None:
        """One list per watched kind, so the first passes see every existing child."""
        started = time.monotonic()
        delay = 1.0
        for kind, (version, plural, namespaced) in Watched.PATHS.items():
            for namespace in self._scopes(namespaced):
                while not self.stop_event.is_set():
                    try:
                        found = self.kube.list(
                            path_for(version, plural, namespace), Watched.SELECTORS.get(kind)
                        )
                        break
                    except Exception as error:  # the API may be briefly unreachable
                        if kind in Watched.OPTIONAL and getattr(error, "status", None) in (
                            403,
                            404,
                        ):
                            # No LeaderWorkerSet CRD (or no grant for it): nothing to list.
                            log.info(f"not listing {plural}: {getattr(error, 'reason', error)}")
                            found = []
                            break
                        metrics.ERRORS.labels(kind=type(error).__name__).inc()
                        log.warning(f"listing {plural}: {error}; retrying in {delay:.0f} s")
                        self.stop_event.wait(delay)
                        delay = min(delay * 2, 30.0)
                else:
                    return
                for obj in found:
                    # List items carry neither; a PUT built from them needs both.
                    self.store.put(kind, {"apiVersion": version, "kind": kind, **obj})
        counts = ", ".join(f"{self.store.count(kind)} {kind}" for kind in Watched.PATHS)
        log.info(f"primed in {time.monotonic() - started:.1f} s: {counts}")
        self.primed.set()

    # -- work ---------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            # A standby takes nothing from the queue: the pairs that change meanwhile
            # wait there (once each), first in line when it becomes the leader.
            while not self.active():
                if self.stop_event.wait(0.5):
                    return
            try:
                key = self.queue.get(timeout=1.0)
            except ShutDown:
                return
            if key is None:
                continue
            with self._why_lock:
                why = self._why.pop(key, "retry")
            try:
                if self.active():
                    self._process(key, why)
                else:
                    self.enqueue(key, why)  # lost the lease meanwhile: keep it for later
            finally:
                self.queue.done(key)

    def _process(self, key: Key, why: str) -> None:
        body = self.store.get(PAIR, *key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.queue.forget(key)
            return
        started = time.monotonic()

        def emit(type_: str, reason: str, message: str) -> None:
            post_event(self.kube, body, type_, reason, message)

        mark = self.mark(key)
        try:
            result = reconcile(self.kube, self.store, body, emit, checker=self.references)
        except Exception as error:
            kind = str(error.status) if isinstance(error, ApiException) else type(error).__name__
            metrics.ERRORS.labels(kind=kind).inc()
            metrics.RECONCILES.labels(trigger=why, result="error").inc()
            if is_temporary(error):
                delay = self.queue.backoff(key)
                log.warning(f"{key[0]}/{key[1]}: {_describe(error)}; retrying in {delay:.0f} s")
                self.queue.add_after(key, delay)
            else:
                self.queue.forget(key)
                self._report_failure(body, error)
            return
        finally:
            metrics.LATENCY.observe(time.monotonic() - started)
        self.queue.forget(key)
        self.record_settled(key, mark, result.settled)
        metrics.RECONCILES.labels(trigger=why, result="ok").inc()
        if result.writes:
            log.info(f"{why} {key[0]}/{key[1]}: {', '.join(result.writes)}")

    def _report_failure(self, body: Obj, error: BaseException) -> None:
        """A failure retrying will not fix: Degraded and a Warning Event, once."""
        reason = "ChildConflict" if isinstance(error, ChildConflict) else "ApiRejected"
        message = _describe(error)
        meta = body["metadata"]
        log.error(f"{meta['namespace']}/{meta['name']}: {message}")
        previous = (body.get("status") or {}).get("conditions") or []
        old = conditions.find(previous, conditions.DEGRADED)
        if old is not None and (old.get("reason"), old.get("message")) == (reason, message):
            return
        generation = int(meta.get("generation", 1))
        # Ready=False and observedGeneration too: GitOps tools (kstatus) read a pair
        # without them as ready (charts/specpair-operator/health/README.md).
        updates = [
            conditions.ConditionUpdate(
                conditions.READY, "False", reason, "the current spec is not applied"
            ),
            conditions.ConditionUpdate(conditions.DEGRADED, "True", reason, message),
        ]
        merged = conditions.merge_conditions(
            previous, updates, generation=generation, now=datetime.now(UTC)
        )
        with contextlib.suppress(ApiException):
            updated = self.kube.merge_patch(
                pair_path(meta["namespace"], meta["name"]) + "/status",
                {"status": {"observedGeneration": generation, "conditions": merged}},
            )
            self.store.put(PAIR, updated)
        post_event(self.kube, body, "Warning", reason, message)

    def _resync(self) -> None:
        """Re-queue every pair; one whose last pass settled and saw no event since is skipped.

        Every ``FULL_RESYNC_EVERY``-th round queues them all anyway: the safety
        net of a level-based operator.
        """
        while not self.stop_event.wait(self.resync_seconds):
            if not self.active():
                continue
            self._resyncs += 1
            for key in self.resync_keys(full=self._resyncs % FULL_RESYNC_EVERY == 0):
                self.enqueue(key, "resync")

    def record_settled(self, key: Key, mark: tuple[int, int], settled: bool) -> None:
        with self._why_lock:
            if settled:
                self._settled[key] = mark
            else:
                self._settled.pop(key, None)

    def resync_keys(self, *, full: bool) -> list[Key]:
        """The pairs a resync round queues: all, or those not settled since their last event."""
        keys = []
        for key in self.store.keys(PAIR):
            with self._why_lock:
                settled = self._settled.get(key)
            if full or settled is None or settled != self.mark(key):
                keys.append(key)
        return keys

    def _scrape(self) -> None:
        """Acceptance of every serving pair; a failed scrape is logged, never fatal."""
        scraper = Scraper(self.kube, self.store)
        while not self.stop_event.wait(self.scrape_seconds):
            if not self.active():
                continue
            for key in self.store.keys(PAIR):
                body = self.store.get(PAIR, *key)
                if body is None or body["metadata"].get("deletionTimestamp"):
                    continue
                try:
                    if scraper.scrape(body) is not None:
                        # Conditions (AcceptanceDrift) follow from the new status at once.
                        self.enqueue(key, "scrape")
                except Exception as error:
                    metrics.ERRORS.labels(kind=type(error).__name__).inc()
                    log.warning(f"scrape {key[0]}/{key[1]}: {error}")


def _describe(error: BaseException) -> str:
    """One line: the API's own message where there is one."""
    if isinstance(error, ApiException):
        raw = error.body
        detail = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")
        message = ""
        with contextlib.suppress(ValueError, AttributeError):
            message = str(json.loads(detail).get("message", ""))
        return f"API {error.status} {error.reason}: {message or detail[:300]}".strip()
    return str(error) or type(error).__name__
