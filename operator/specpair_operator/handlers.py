"""Thin kopf handlers: every trigger runs the same level-based `reconcile.reconcile`.

Create, update and resume react at once. A resync thread re-runs the pass
over every pair every ``SPECPAIR_RESYNC_SECONDS`` to pick up Deployment
progress, node labels and drift. It is a plain thread, not a kopf timer: kopf
puts a finalizer on every object with a timer or daemon, and the operator
needs none (children go with the pair by garbage collection through their
ownerReferences). kopf keeps its progress in annotations (``specpair.dev/*``),
never in undeclared status fields; the status is written by the pass itself,
through ``/status``.

Settings come from the environment so that ``kopf run -m
specpair_operator.handlers`` and ``python -m specpair_operator run`` behave
the same: ``SPECPAIR_RESYNC_SECONDS`` (15), ``SPECPAIR_WATCH_NAMESPACES``
(comma separated; empty = all), ``SPECPAIR_METRICS_PORT`` (0 = off),
``SPECPAIR_METRICS_ADDRESS`` (127.0.0.1), ``SPECPAIR_SCRAPE_SECONDS`` (30: the
acceptance scraper, `scraper.py`, another plain thread for the same reason);
with peering, ``SPECPAIR_PEERING``,
``SPECPAIR_PRIORITY`` and ``SPECPAIR_IDENTITY`` (see `peering.py`).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from specpair_operator import api, metrics, peering
from specpair_operator.events import post_event
from specpair_operator.kube import Kube, load_api_client, pair_path, path_for
from specpair_operator.reconcile import ChildConflict, reconcile
from specpair_operator.scraper import Scraper

RESYNC_SECONDS = float(os.environ.get("SPECPAIR_RESYNC_SECONDS", "15"))
SCRAPE_SECONDS = float(os.environ.get("SPECPAIR_SCRAPE_SECONDS", "30"))
RETRYABLE = {404, 409, 429, 500, 502, 503, 504}


log = logging.getLogger("specpair.operator")


def watched_namespaces() -> list[str]:
    return [n for n in os.environ.get("SPECPAIR_WATCH_NAMESPACES", "").split(",") if n]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration"
    )
    # kopf's own "Handler succeeded" events would be a write per pass; ours are explicit.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    memo.kube = Kube(load_api_client())
    memo.locks = {}
    memo.locks_guard = threading.Lock()
    memo.stop = threading.Event()
    memo.resync = threading.Thread(
        target=_resync_loop,
        args=(memo, memo.stop, RESYNC_SECONDS, watched_namespaces()),
        name="specpair-resync",
        daemon=True,
    )
    memo.resync.start()
    memo.scrape = threading.Thread(
        target=_scrape_loop,
        args=(memo, memo.stop, SCRAPE_SECONDS, watched_namespaces()),
        name="specpair-scrape",
        daemon=True,
    )
    memo.scrape.start()
    port = int(os.environ.get("SPECPAIR_METRICS_PORT", "0"))
    if port:
        metrics.serve(port, os.environ.get("SPECPAIR_METRICS_ADDRESS", "127.0.0.1"))


@kopf.on.cleanup()
def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    memo.stop.set()
    memo.resync.join(timeout=10)
    memo.scrape.join(timeout=10)


def _lock(memo: kopf.Memo, uid: str) -> threading.Lock:
    with memo.locks_guard:
        lock: threading.Lock = memo.locks.setdefault(uid, threading.Lock())
        return lock


def _reconcile(trigger: str, body: dict[str, Any], memo: kopf.Memo) -> None:
    """One pass with metrics; raises what the pass raised."""
    started = time.monotonic()
    kube: Kube = memo.kube

    def emit(type_: str, reason: str, message: str) -> None:
        post_event(kube, body, type_, reason, message)

    try:
        with _lock(memo, body["metadata"]["uid"]):
            result = reconcile(kube, body, emit)
    except ApiException as error:
        metrics.ERRORS.labels(kind=str(error.status)).inc()
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        raise
    except ChildConflict:
        metrics.ERRORS.labels(kind="ChildConflict").inc()
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        raise
    finally:
        metrics.LATENCY.observe(time.monotonic() - started)
    metrics.RECONCILES.labels(trigger=trigger, result="ok").inc()
    if result.writes:
        meta = body["metadata"]
        log.info(f"{trigger} {meta['namespace']}/{meta['name']}: {', '.join(result.writes)}")


def _active(kube: Kube, namespace: str | None) -> bool:
    """Whether kopf's peering lets this replica act (always, when standalone)."""
    name = os.environ.get("SPECPAIR_PEERING")
    if not name:
        return True
    found = kube.get(peering.peering_path(name, namespace))
    if found is None:
        return False  # kopf cannot peer either; it will say so in its log
    return peering.may_resync(
        found.get("status") or {},
        os.environ.get("SPECPAIR_IDENTITY", ""),
        int(os.environ.get("SPECPAIR_PRIORITY", "0")),
        datetime.now(UTC),
    )


def _list_pairs(kube: Kube, namespaces: list[str]) -> list[dict[str, Any]]:
    """The pairs this replica resyncs now (none where a peer outranks it)."""
    pairs: list[dict[str, Any]] = []
    scopes: list[str | None] = [*namespaces] if namespaces else [None]
    for namespace in scopes:
        if _active(kube, namespace):
            pairs += kube.list(path_for(api.API_VERSION, api.PLURAL, namespace))
    return pairs


def _resync_loop(
    memo: kopf.Memo, stop: threading.Event, interval: float, namespaces: list[str]
) -> None:
    """Level-based resync of every pair; errors are logged and retried next round."""
    while not stop.wait(interval):
        try:
            pairs = _list_pairs(memo.kube, namespaces)
        except Exception as error:  # the API may be briefly unreachable
            metrics.ERRORS.labels(kind=type(error).__name__).inc()
            log.warning(f"resync: cannot list pairs: {error}")
            continue
        for body in pairs:
            if body["metadata"].get("deletionTimestamp"):
                continue
            try:
                _reconcile("resync", body, memo)
            except Exception as error:  # one bad pair must not stop the others
                meta = body["metadata"]
                log.warning(f"resync {meta['namespace']}/{meta['name']}: {error}")


def _scrape_loop(
    memo: kopf.Memo, stop: threading.Event, interval: float, namespaces: list[str]
) -> None:
    """Acceptance of every pair; a failed scrape is logged and retried next round."""
    scraper = Scraper(memo.kube)
    while not stop.wait(interval):
        try:
            pairs = _list_pairs(memo.kube, namespaces)
        except Exception as error:
            metrics.ERRORS.labels(kind=type(error).__name__).inc()
            log.warning(f"scrape: cannot list pairs: {error}")
            continue
        for body in pairs:
            meta = body["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            try:
                with _lock(memo, meta["uid"]):
                    written = scraper.scrape(body)
                if written is not None:
                    # Conditions (AcceptanceDrift) follow from the new status at once.
                    fresh = memo.kube.get(pair_path(meta["namespace"], meta["name"]))
                    if fresh is not None:
                        _reconcile("scrape", fresh, memo)
            except Exception as error:  # never fatal: the next round tries again
                metrics.ERRORS.labels(kind=type(error).__name__).inc()
                log.warning(f"scrape {meta['namespace']}/{meta['name']}: {error}")


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
def on_change(body: kopf.Body, memo: kopf.Memo, retry: int, reason: str, **_: Any) -> None:
    try:
        _reconcile(str(reason), copy.deepcopy(dict(body)), memo)
    except ApiException as error:
        if error.status in RETRYABLE:
            # Exponential backoff, capped; kopf retries the handler.
            raise kopf.TemporaryError(
                f"API {error.status} {error.reason}; retrying", delay=min(2.0**retry, 60.0)
            ) from error
        raise
    except ChildConflict as error:
        raise kopf.TemporaryError(str(error), delay=60) from error
