"""An in-memory copy of the objects the operator watches (an informer's store).

kopf's watch streams feed it (`handlers.py`); the reconcile reads children,
pods and GPU nodes from it instead of asking the API server on every pass,
so a pass over an unchanged pair costs no request at all. The
results of the operator's own writes go in at once, so that the next pass
does not act on a copy older than what it just wrote.

Thread-safe: the kopf event loop writes, the reconcile workers read.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects

PAIR = "SpeculativePair"
DEPLOYMENT = "Deployment"
POD = "Pod"
CONFIG_MAP = "ConfigMap"
SERVICE = "Service"
NODE = "Node"
LEADER_WORKER_SET = "LeaderWorkerSet"  # engine vllm past one node; its CRD may be absent
KINDS = (PAIR, DEPLOYMENT, POD, CONFIG_MAP, SERVICE, NODE, LEADER_WORKER_SET)
# The label that names the pair a child or pod belongs to (the store's index).
INSTANCE_LABEL = "app.kubernetes.io/instance"


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


def slim(kind: str, obj: Mapping[str, Any]) -> Obj:
    """A compact copy without what the operator never reads.

    managedFields go everywhere: large, and never read. A pod keeps only its
    containers' names and ports of its spec: its endpoint (``pods.endpoint``);
    the rest of a pod's spec is its Deployment's template again, thousands of
    times over. Keys and short strings are interned: a thousand pairs' children
    repeat the same keys and values, and JSON parsing gives each its own copy
    (interned, the stored objects take about half the memory).
    """
    result = {_intern(k): _compact(v) for k, v in obj.items() if k not in ("metadata", "spec")}
    meta = obj.get("metadata")
    if isinstance(meta, Mapping):
        result["metadata"] = {
            _intern(k): _compact(v) for k, v in meta.items() if k != "managedFields"
        }
    spec = obj.get("spec")
    if kind == POD and isinstance(spec, Mapping):
        containers = spec.get("containers") or []
        spec = {
            "containers": [
                {"name": c.get("name"), "ports": c.get("ports") or []} for c in containers
            ]
        }
    if spec is not None:
        result["spec"] = _compact(spec)
    return result


_INTERNED_LENGTH = 64  # names, labels, enum values; not a ConfigMap's file


def _intern(value: str) -> str:
    return sys.intern(value) if len(value) <= _INTERNED_LENGTH else value


def _compact(value: Any) -> Any:
    """A deep copy of JSON data with its keys and short strings interned."""
    if isinstance(value, Mapping):
        return {_intern(k): _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    if isinstance(value, str):
        return _intern(value)
    return value


def matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class Store:
    """Objects by kind and (namespace, name), indexed by the pair they belong to.

    Objects are never changed in place, neither by the store nor by its
    readers: a put replaces the stored object, so a reader may hold the old one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, dict[Key, Obj]] = {kind: {} for kind in KINDS}
        # (kind, namespace, instance label) -> names: a pair's children and pods
        # without a scan over every object of the kind.
        self._by_instance: dict[tuple[str, str, str], set[str]] = {}

    def put(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """Store ``obj`` unless a newer copy is already there; True when it changed."""
        key = key_of(obj)
        with self._lock:
            stored = self._objects[kind].get(key)
            if not newer_or_same(obj, stored):
                return False
            if stored is not None and _version(stored) == _version(obj) is not None:
                return False
            self._unindex(kind, key, stored)
            self._objects[kind][key] = slimmed = slim(kind, obj)
            instance = _instance(slimmed)
            if instance is not None:
                self._by_instance.setdefault((kind, key[0], instance), set()).add(key[1])
            return True

    def _unindex(self, kind: str, key: Key, stored: Obj | None) -> None:
        instance = None if stored is None else _instance(stored)
        if instance is None:
            return
        names = self._by_instance.get((kind, key[0], instance))
        if names is not None:
            names.discard(key[1])
            if not names:
                del self._by_instance[(kind, key[0], instance)]

    def remove(self, kind: str, namespace: str, name: str) -> None:
        with self._lock:
            stored = self._objects[kind].pop((namespace, name), None)
            self._unindex(kind, (namespace, name), stored)

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
        A selector on the instance label of one namespace reads the index.
        """
        instance = selector.get(INSTANCE_LABEL)
        with self._lock:
            objects = self._objects[kind]
            if namespace is not None and instance is not None:
                names = self._by_instance.get((kind, namespace, instance), ())
                candidates = [objects[(namespace, name)] for name in names]
                return [obj for obj in candidates if matches(obj, selector)]
            return [
                obj
                for (ns, _), obj in objects.items()
                if (namespace is None or ns == namespace) and matches(obj, selector)
            ]

    def keys(self, kind: str) -> list[Key]:
        with self._lock:
            return list(self._objects[kind])

    def count(self, kind: str) -> int:
        with self._lock:
            return len(self._objects[kind])


def _instance(obj: Mapping[str, Any]) -> str | None:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    value = labels.get(INSTANCE_LABEL)
    return None if value is None else str(value)
