"""Secrets and ConfigMaps a pair's pods read, and whether they exist.

A pod whose Secret or ConfigMap (or the key in it) is missing never starts:
``CreateContainerConfigError`` for an env var, a volume that never mounts.
The operator checks them before it rolls pods out and names what is missing
in a condition instead. It reads each by name (RBAC ``get``; no list or
watch of Secrets) and only looks at the key names.

`Checker` keeps the cost down: a pair whose references were all there is
checked again only when its Deployment is about to change, when its spec
changes, or after ``RECHECK_SECONDS``; a pair with a missing one is checked
on every pass until it appears.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specpair_operator.api import SpeculativePairSpec
from specpair_operator.kube import Kube, path_for

RECHECK_SECONDS = 300.0


@dataclass(frozen=True)
class Reference:
    kind: str  # Secret or ConfigMap
    name: str
    key: str
    field: str  # where the spec names it


def references(spec: SpeculativePairSpec) -> list[Reference]:
    found: list[Reference] = []
    if spec.serving.api_key_secret is not None:
        ref = spec.serving.api_key_secret
        found.append(Reference("Secret", ref.name, ref.key, "spec.serving.apiKeySecret"))
    if spec.hf_token_secret is not None:
        ref = spec.hf_token_secret
        found.append(Reference("Secret", ref.name, ref.key, "spec.hfTokenSecret"))
    golden = spec.golden_prompts
    if golden is not None and golden.config_map_ref is not None:
        cm = golden.config_map_ref
        found.append(Reference("ConfigMap", cm.name, cm.key, "spec.goldenPrompts.configMapRef"))
    return found


def problem(ref: Reference, obj: dict[str, object] | None) -> str | None:
    """What is wrong with ``ref`` given the object found (None: not found), if anything."""
    if obj is None:
        return f"{ref.kind} {ref.name} ({ref.field}) not found"
    keys: set[str] = set()
    for section in ("data", "binaryData", "stringData"):
        value = obj.get(section)
        if isinstance(value, dict):
            keys |= set(value)
    if ref.key not in keys:
        return f"{ref.kind} {ref.name} ({ref.field}) has no key {ref.key!r}"
    return None


def missing(kube: Kube, namespace: str, refs: list[Reference]) -> list[str]:
    """One message per missing object or key (one GET per reference)."""
    plural = {"Secret": "secrets", "ConfigMap": "configmaps"}
    problems = []
    for ref in refs:
        found = kube.get(path_for("v1", plural[ref.kind], namespace, ref.name))
        message = problem(ref, found)
        if message is not None:
            problems.append(message)
    return problems


@dataclass
class Checker:
    """`missing` with a memory of the last good check per pair (uid, generation)."""

    recheck_seconds: float = RECHECK_SECONDS
    clock: Callable[[], float] = time.monotonic
    _good: dict[str, tuple[int, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def missing(
        self,
        kube: Kube,
        namespace: str,
        uid: str,
        generation: int,
        refs: list[Reference],
        *,
        force: bool,
    ) -> list[str]:
        if not refs:
            return []
        with self._lock:
            last = self._good.get(uid)
        recent = (
            last is not None
            and last[0] == generation
            and self.clock() - last[1] < self.recheck_seconds
        )
        if recent and not force:
            return []
        problems = missing(kube, namespace, refs)
        with self._lock:
            if problems:
                self._good.pop(uid, None)
            else:
                self._good[uid] = (generation, self.clock())
        return problems
