"""Fields the apiserver pruned from a stored pair, found in the last ``kubectl apply`` (pure).

An apiserver drops the fields a CRD's schema does not declare ("pruning").
It says so only to a client that validates: ``kubectl apply
--validate=false``, which an apiserver older than 1.25 needs for this CRD,
stores a pair with a misspelt field (``tragetTypo``) as if the field had
never been there. A client-side ``kubectl apply`` records what it sent in
the ``kubectl.kubernetes.io/last-applied-configuration`` annotation; a field
in there that the schema does not declare, and that the stored object does
not hold, was pruned. Objects written otherwise (``kubectl create``,
server-side apply, an API client) leave no such record, so their pruned
fields cannot be named (docs/operator.md).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from specpair_operator import crd

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"

Schema = Mapping[str, Any]


@functools.cache
def _schema() -> Schema:
    return crd.openapi_schema()


def _child_schema(schema: Schema, key: str) -> Schema | None:
    """The schema of ``key`` inside an object, or None when the schema does not declare it."""
    properties = schema.get("properties")
    if properties is not None and key in properties:
        return dict(properties[key])
    extra = schema.get("additionalProperties")
    return dict(extra) if isinstance(extra, Mapping) else None


def _keeps_all(schema: Schema) -> bool:
    """A free-form object: the apiserver keeps whatever it holds."""
    return bool(schema.get("x-kubernetes-preserve-unknown-fields")) or (
        "properties" not in schema and "additionalProperties" not in schema
    )


def undeclared(sent: Any, stored: Any, schema: Schema, path: str) -> list[str]:
    """Paths in ``sent`` that ``schema`` does not declare and ``stored`` does not hold."""
    if isinstance(sent, list) and schema.get("type") == "array":
        items = dict(schema.get("items") or {})
        kept = stored if isinstance(stored, list) else []
        return [
            found
            for i, item in enumerate(sent)
            for found in undeclared(item, kept[i] if i < len(kept) else None, items, f"{path}[{i}]")
        ]
    if not isinstance(sent, Mapping) or _keeps_all(schema):
        return []
    kept_map = stored if isinstance(stored, Mapping) else {}
    found: list[str] = []
    for key, value in sent.items():
        where = f"{path}.{key}" if path else str(key)
        child = _child_schema(schema, str(key))
        if child is None:
            if key not in kept_map:
                found.append(where)
            continue
        found += undeclared(value, kept_map.get(key), child, where)
    return found


def pruned_fields(body: Mapping[str, Any], schema: Schema | None = None) -> list[str]:
    """The fields of the pair's last ``kubectl apply`` that the apiserver dropped."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(LAST_APPLIED)
    if not raw:
        return []
    try:
        sent = json.loads(raw)
    except ValueError:
        return []
    if not isinstance(sent, Mapping):
        return []
    sent = {k: v for k, v in sent.items() if k != "metadata"}  # the apiserver's own fields
    return undeclared(sent, body, schema or _schema(), "")


def warning(fields: list[str]) -> str:
    """The Warning Event's message for ``fields``."""
    return (
        f"the apiserver dropped {', '.join(fields)} from the last `kubectl apply`: the "
        "SpeculativePair schema does not declare it (a misspelt field?), so it has no effect. "
        "Fix the manifest; a validating apply (kubectl apply without --validate=false, on "
        "Kubernetes 1.25 and newer) refuses such fields"
    )
