"""Status conditions in the metav1.Condition shape.

``lastTransitionTime`` changes only when a condition's ``status`` changes;
a new reason or message alone keeps the old time (API conventions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from specpair_operator.api import ConditionStatus

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
HEADROOM_SUFFICIENT = "HeadroomSufficient"
PLACEMENT_CHANGE_PENDING = "PlacementChangePending"
SPECULATION_EFFECTIVE = "SpeculationEffective"
CONDITION_TYPES = (
    READY,
    PROGRESSING,
    DEGRADED,
    HEADROOM_SUFFICIENT,
    SPECULATION_EFFECTIVE,
    PLACEMENT_CHANGE_PENDING,
)


@dataclass(frozen=True)
class ConditionUpdate:
    """What the reconcile decided for one condition."""

    type: str
    status: ConditionStatus
    reason: str
    message: str


def rfc3339(moment: datetime) -> str:
    """Second precision in UTC, as Kubernetes writes times."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find(conditions: Sequence[dict[str, object]], type_: str) -> dict[str, object] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def merge_conditions(
    existing: Sequence[dict[str, object]],
    updates: Sequence[ConditionUpdate],
    *,
    generation: int,
    now: datetime,
) -> list[dict[str, object]]:
    """The new condition list: updates applied in order, other types kept as they were."""
    result = [dict(c) for c in existing]
    for update in updates:
        old = find(result, update.type)
        changed = old is None or old.get("status") != update.status
        new: dict[str, object] = {
            "type": update.type,
            "status": update.status,
            "observedGeneration": generation,
            "lastTransitionTime": rfc3339(now)
            if changed or old is None
            else old.get("lastTransitionTime", rfc3339(now)),
            "reason": update.reason,
            "message": update.message,
        }
        if old is None:
            result.append(new)
        else:
            result[result.index(old)] = new
    return result


def transitioned(
    before: Sequence[dict[str, object]],
    after: Sequence[dict[str, object]],
    type_: str,
    *,
    reason: bool = False,
) -> bool:
    """Whether ``type_`` changed status (or, with ``reason``, its reason) or appeared."""
    old, new = find(before, type_), find(after, type_)
    if new is None:
        return False
    if old is None or old.get("status") != new.get("status"):
        return True
    return reason and old.get("reason") != new.get("reason")
