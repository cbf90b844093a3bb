"""An in-memory copy of the objects the operator watches (an informer's store).

kopf's watch streams feed it (`handlers.py`); the reconcile reads children,
pods, ReplicaSets and GPU nodes from it instead of asking the API server on
every pass, so a pass over an unchanged pair costs no request at all. The
results of the operator's own writes go in at once, so that the next pass
does not act on a copy older than what it just wrote.

Thread-safe: the kopf event loop writes, the reconcile workers read.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects

PAIR = "SpeculativePair"
DEPLOYMENT = "Deployment"
REPLICA_SET = "ReplicaSet"
POD = "Pod"
CONFIG_MAP = "ConfigMap"
SERVICE = "Service"
NODE = "Node"
LEADER_WORKER_SET = "LeaderWorkerSet"  # engine vllm past one node; its CRD may be absent
KINDS = (PAIR, DEPLOYMENT, REPLICA_SET, POD, CONFIG_MAP, SERVICE, NODE, LEADER_WORKER_SET)


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _version(obj: Mapping[str, Any]) -> int | None:
    value = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None  # opaque: trust the newest arrival


def newer_or_same(candidate: Mapping[str, Any], stored: Mapping[str, Any] | None) -> bool:
    """Whether ``candidate`` may replace ``stored`` (a late watch event must not win)."""
    if stored is None:
        return True
    new, old = _version(candidate), _version(stored)
    return new is None or old is None or new >= old


def slim(obj: Mapping[str, Any]) -> Obj:
    """A copy without managedFields: large, and never read by the operator."""
    result = copy.deepcopy(dict(obj))
    meta = result.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return result


def matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class Store:
    """Objects by kind and (namespace, name)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, dict[Key, Obj]] = {kind: {} for kind in KINDS}

    def put(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """Store ``obj`` unless a newer copy is already there; True when it changed."""
        key = key_of(obj)
        with self._lock:
            stored = self._objects[kind].get(key)
            if not newer_or_same(obj, stored):
                return False
            if stored is not None and _version(stored) == _version(obj) is not None:
                return False
            # A new object, never changed in place: readers may hold the old one.
            self._objects[kind][key] = slim(obj)
            return True

    def remove(self, kind: str, namespace: str, name: str) -> None:
        with self._lock:
            self._objects[kind].pop((namespace, name), None)

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        """A private copy, free to change."""
        found = self.peek(kind, namespace, name)
        return copy.deepcopy(found) if found is not None else None

    def peek(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The stored object itself: read it, never change it (no copy, for hot paths)."""
        with self._lock:
            return self._objects[kind].get((namespace, name))

    def select(self, kind: str, namespace: str | None, selector: Mapping[str, str]) -> list[Obj]:
        """Stored objects of ``kind`` in ``namespace`` (None: all) whose labels match.

        Like `peek`, these are the stored objects: read them, never change them.
        """
        with self._lock:
            return [
                obj
                for (ns, _), obj in self._objects[kind].items()
                if (namespace is None or ns == namespace) and matches(obj, selector)
            ]

    def keys(self, kind: str) -> list[Key]:
        with self._lock:
            return list(self._objects[kind])

    def count(self, kind: str) -> int:
        with self._lock:
            return len(self._objects[kind])
