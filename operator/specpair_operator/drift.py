"""Drift of a child from what the operator wants, and the body that corrects it (pure).

The operator owns the fields its builders set. A child is in line when every
owned field holds the wanted value; fields the API server defaults
(``dnsPolicy``, ``terminationMessagePath`` …) or that others own (the
Service's ``clusterIP``, the Deployment controller's annotations, an HPA's
``replicas``) do not count. So a hand edit (``kubectl scale``, ``set image``,
an edited ``runtime.yaml``, a changed Service selector) is drift and is put
back, while a defaulted field is not drift and costs no write.

Comparison rules (`differences`):

- maps: every wanted key must hold its wanted value; other keys are ignored,
  except under `EXACT_MAPS` (a label selector with an extra key selects
  nothing), where extra keys are drift;
- lists: same length, item by item (an extra container or env var is drift);
- resource quantities compare by value (the server rewrites ``0.5`` as
  ``500m``).

The correction (`corrected`) is a full-object PUT body: the live object with
every owned top-level field of each section replaced by the wanted one, and
the owned labels and annotations merged in, so the server re-applies its
defaults and keeps what others own.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from specpair_operator.api import QUANTITY_SUFFIXES

Obj = dict[str, Any]

# Paths (dotted, lists as []) whose maps must not hold extra keys.
EXACT_MAPS = frozenset({"spec.selector"})
_QUANTITY_PARENTS = frozenset({"requests", "limits"})
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[KMGTPE]i|[mkMGTPE])?$")
# Sections of a child whose top-level keys the operator owns wholesale.
_SECTIONS = ("spec", "data")
# Template metadata maps that others add to (kubectl rollout restart's restartedAt).
_MERGED_TEMPLATE_MAPS = ("labels", "annotations")


def quantity_value(text: object) -> Decimal | None:
    """A Kubernetes quantity as a number, or None when it is not one."""
    match = _QUANTITY.match(str(text).strip())
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        value = Decimal(number)
        if suffix[:1] in ("e", "E"):
            return value * Decimal(10) ** int(suffix[1:])
        return value * QUANTITY_SUFFIXES[suffix]
    except (InvalidOperation, ValueError):
        return None


def _same_quantity(want: object, have: object) -> bool:
    left, right = quantity_value(want), quantity_value(have)
    return left is not None and left == right


def _walk(want: Any, have: Any, path: str, parent: str, found: list[str]) -> None:
    """Compare ``want`` with ``have`` at ``path``; ``parent`` names the enclosing map."""
    name = path.rsplit(".", 1)[-1]
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            found.append(path or "<root>")
            return
        if path in EXACT_MAPS and set(have) - set(want):
            found.append(path)
            return
        for key, value in want.items():
            _walk(value, have.get(key), f"{path}.{key}" if path else str(key), name, found)
        return
    if isinstance(want, Sequence) and not isinstance(want, str):
        if not isinstance(have, Sequence) or isinstance(have, str) or len(have) != len(want):
            found.append(path)
            return
        for index, (w, h) in enumerate(zip(want, have, strict=True)):
            _walk(w, h, f"{path}[{index}]", parent, found)
        return
    if want == have:
        return
    quantity = parent in _QUANTITY_PARENTS or path.endswith("sizeLimit")
    if quantity and _same_quantity(want, have):
        return
    found.append(path)


def differences(desired: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """The owned paths where ``live`` departs from ``desired`` (empty: in line)."""
    found: list[str] = []
    meta, live_meta = desired.get("metadata") or {}, live.get("metadata") or {}
    for key in ("labels", "annotations", "ownerReferences"):
        if key in meta:
            _walk(meta[key], live_meta.get(key), f"metadata.{key}", key, found)
    for section in _SECTIONS:
        if section in desired:
            _walk(desired[section], live.get(section), section, section, found)
    return found


def _merged_template(want: Mapping[str, Any], have: Mapping[str, Any] | None) -> Obj:
    result = copy.deepcopy(dict(want))
    have_meta = (have or {}).get("metadata") or {}
    meta = result.setdefault("metadata", {})
    for key in _MERGED_TEMPLATE_MAPS:
        if key in have_meta or key in meta:
            meta[key] = {**(have_meta.get(key) or {}), **(meta.get(key) or {})}
    return result


def corrected(desired: Mapping[str, Any], live: Mapping[str, Any]) -> Obj:
    """The PUT body that puts every owned field of ``live`` back to ``desired``."""
    body = copy.deepcopy(dict(live))
    body.pop("status", None)
    body["apiVersion"], body["kind"] = desired["apiVersion"], desired["kind"]
    meta = body.setdefault("metadata", {})
    want_meta = desired.get("metadata") or {}
    for key in ("labels", "annotations"):
        if key in want_meta:
            meta[key] = {**(meta.get(key) or {}), **want_meta[key]}
    if "ownerReferences" in want_meta:
        meta["ownerReferences"] = copy.deepcopy(want_meta["ownerReferences"])
    for section in _SECTIONS:
        if section not in desired:
            continue
        want = desired[section]
        have = body.get(section)
        merged = {**(have or {}), **copy.deepcopy(want)} if isinstance(have, dict) else want
        if section == "spec" and "template" in want:
            merged["template"] = _merged_template(want["template"], (have or {}).get("template"))
        if section == "data":
            merged = copy.deepcopy(want)  # a ConfigMap's data is ours alone
        body[section] = merged
    return body
