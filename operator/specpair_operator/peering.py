"""Whether this replica may resync, by kopf's peering rule.

With ``run --peering NAME``, kopf pauses its handlers while another live
replica has a higher priority, or the same one. The resync thread is not a
kopf handler, so it reads the same peering object and applies the same rule;
otherwise a paused replica would keep writing. A peer is live until
``lastseen + lifetime``; the status is keyed by peer identity (kopf's format).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

PEERING_GROUP_VERSION = "kopf.dev/v1"


def peering_path(name: str, namespace: str | None) -> str:
    """ClusterKopfPeering for a cluster-wide operator, KopfPeering per namespace otherwise."""
    if namespace is None:
        return f"/apis/{PEERING_GROUP_VERSION}/clusterkopfpeerings/{name}"
    return f"/apis/{PEERING_GROUP_VERSION}/namespaces/{namespace}/kopfpeerings/{name}"


def _alive(record: Mapping[str, Any], now: datetime) -> bool:
    # As kopf's Peer: a record without lastseen counts as seen now.
    try:
        seen = record.get("lastseen")
        lastseen = now if seen is None else datetime.fromisoformat(str(seen))
        lifetime = timedelta(seconds=int(record.get("lifetime", 60)))
    except (TypeError, ValueError):
        return False
    return lastseen + lifetime > now


def may_resync(status: Mapping[str, Any], identity: str, priority: int, now: datetime) -> bool:
    """False while a live peer outranks or ties this one (kopf pauses then)."""
    for peer, record in status.items():
        if peer == identity or not isinstance(record, Mapping) or not _alive(record, now):
            continue
        if int(record.get("priority", 0)) >= priority:
            return False
    return True
