"""The bounded revision history in ``status.revisions`` (pure).

Newest last. Each entry carries the revision, its ``version``, an outcome
(``Progressing``, ``Current``, ``Superseded``, ``RolledBack``), whether the
Deployment now runs it, the rollback message, and the acceptance baseline
recorded for it. The current revision is never dropped by the bound; the
ConfigMaps of revisions that leave the history are garbage-collected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

HISTORY_LIMIT = 5

Entry = dict[str, Any]


def find(history: Sequence[Mapping[str, Any]], revision: str | None) -> Entry | None:
    for entry in history:
        if entry.get("revision") == revision:
            return dict(entry)
    return None


def _set(history: list[Entry], entry: Entry) -> None:
    for index, old in enumerate(history):
        if old.get("revision") == entry["revision"]:
            history[index] = entry
            return
    history.append(entry)


def update_history(
    previous: Sequence[Mapping[str, Any]],
    *,
    desired: str,
    version: str,
    current: str | None,
    failed: str | None,
    failure_message: str | None,
    now: str,
    limit: int = HISTORY_LIMIT,
) -> list[Entry]:
    """The history after one pass.

    ``desired`` is the revision of the spec, ``current`` the one the
    Deployment fully runs, ``failed`` the one rolled back and held.
    """
    history = [dict(e) for e in previous]

    def change(revision: str, version_: str, outcome: str, is_current: bool) -> None:
        old = find(history, revision) or {}
        entry: Entry = {
            **old,
            "revision": revision,
            "version": old.get("version", version_),
            "outcome": outcome,
            "current": is_current,
        }
        if old.get("outcome") != outcome or "time" not in old:
            entry["time"] = now
        _set(history, entry)

    for entry in list(history):
        revision = entry["revision"]
        if revision in (current, failed):
            continue
        if entry.get("outcome") in ("Current", "Progressing") and revision != desired:
            # Replaced, either after serving or before it ever finished rolling out.
            change(revision, entry["version"], "Superseded", False)
        elif entry.get("current"):
            change(revision, entry["version"], str(entry["outcome"]), False)
    if current is not None:
        change(current, version if current == desired else "unknown", "Current", True)
    if failed is not None and failed != current:
        change(failed, version, "RolledBack", False)
        entry = find(history, failed) or {}
        if failure_message:
            entry["message"] = failure_message
        _set(history, entry)
    elif desired != current:
        wanted = find(history, desired)
        if wanted is None or wanted.get("outcome") == "Superseded":
            change(desired, version, "Progressing", False)
    return bound(history, limit)


def bound(history: list[Entry], limit: int) -> list[Entry]:
    """The newest ``limit`` entries, always keeping the current one."""
    if len(history) <= limit:
        return history
    current = [e for e in history if e.get("current")]
    others = [e for e in history if not e.get("current")]
    keep = others[-(limit - len(current)) :] if limit > len(current) else []
    kept = {e["revision"] for e in current + keep}
    return [e for e in history if e["revision"] in kept]


def with_baseline(
    history: Sequence[Mapping[str, Any]], revision: str, rate: float
) -> list[Entry] | None:
    """The history with ``revision``'s baseline set; None when it has one already."""
    entry = find(history, revision)
    if entry is None or entry.get("baselineRate") is not None:
        return None
    entry["baselineRate"] = round(rate, 4)
    result = [dict(e) for e in history]
    _set(result, entry)
    return result


def kept_revisions(history: Sequence[Mapping[str, Any]], *extra: str | None) -> set[str]:
    """Revisions whose ConfigMaps must stay."""
    return {str(e["revision"]) for e in history} | {r for r in extra if r}
