"""Kubernetes Events about a pair (core/v1, which every supported cluster serves).

Posted by the operator itself rather than through kopf, so that the resync
thread, which runs outside kopf's handler context, can post them too.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from specpair_operator.builders import MANAGED_BY
from specpair_operator.conditions import rfc3339
from specpair_operator.kube import Kube, path_for


def event_manifest(
    pair: dict[str, Any], type_: str, reason: str, message: str, now: datetime
) -> dict[str, Any]:
    meta = pair["metadata"]
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        # The server adds a random suffix, so repeated events never collide.
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": pair.get("apiVersion", "specpair.dev/v1alpha1"),
            "kind": pair.get("kind", "SpeculativePair"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
            "resourceVersion": meta.get("resourceVersion", ""),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": MANAGED_BY},
        "reportingComponent": MANAGED_BY,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def post_event(kube: Kube, pair: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """Best effort: a lost Event must not fail the reconcile that caused it."""
    body = event_manifest(pair, type_, reason, message, datetime.now(UTC))
    with contextlib.suppress(ApiException):
        kube.create(path_for("v1", "events", pair["metadata"]["namespace"]), body)
