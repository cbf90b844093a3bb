"""The revision history in status.revisions (operator/specpair_operator/history.py)."""

from __future__ import annotations

from typing import Any

from specpair_operator.history import (
    bound,
    kept_revisions,
    update_history,
    with_baseline,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def rows(history: list[dict[str, Any]]) -> list[tuple[str, str, str, bool]]:
    return [(h["revision"], h["version"], h["outcome"], h["current"]) for h in history]


def test_a_rollout_goes_from_progressing_to_current_and_supersedes_the_old() -> None:
    h = update_history([], desired="r1", version="v1", current=None, failed=None,
                       failure_message=None, now=T0)  # fmt: skip
    assert rows(h) == [("r1", "v1", "Progressing", False)]
    h = update_history(h, desired="r1", version="v1", current="r1", failed=None,
                       failure_message=None, now=T1)  # fmt: skip
    assert rows(h) == [("r1", "v1", "Current", True)] and h[0]["time"] == T1
    h = update_history(h, desired="r2", version="v2", current="r1", failed=None,
                       failure_message=None, now=T1)  # fmt: skip
    assert rows(h) == [("r1", "v1", "Current", True), ("r2", "v2", "Progressing", False)]
    h = update_history(h, desired="r2", version="v2", current="r2", failed=None,
                       failure_message=None, now=T1)  # fmt: skip
    assert rows(h) == [("r1", "v1", "Superseded", False), ("r2", "v2", "Current", True)]


def test_a_failed_revision_is_rolled_back_with_its_message() -> None:
    h = [{"revision": "r1", "version": "v1", "outcome": "Current", "current": True, "time": T0}]
    h = update_history(h, desired="r2", version="v2", current="r1", failed="r2",
                       failure_message="pod p /readyz failed: vocab differs", now=T1)  # fmt: skip
    assert rows(h) == [("r1", "v1", "Current", True), ("r2", "v2", "RolledBack", False)]
    assert h[1]["message"] == "pod p /readyz failed: vocab differs"
    # The next pass without a fresh message keeps the recorded one.
    again = update_history(h, desired="r2", version="v2", current="r1", failed="r2",
                           failure_message=None, now=T1)  # fmt: skip
    assert again == h


def test_an_abandoned_rollout_is_superseded_by_the_next_spec() -> None:
    h = [
        {"revision": "r1", "version": "v1", "outcome": "Current", "current": True, "time": T0},
        {"revision": "r2", "version": "v2", "outcome": "Progressing", "current": False, "time": T0},
    ]
    h = update_history(h, desired="r3", version="v3", current="r1", failed=None,
                       failure_message=None, now=T1)  # fmt: skip
    assert rows(h) == [
        ("r1", "v1", "Current", True),
        ("r2", "v2", "Superseded", False),
        ("r3", "v3", "Progressing", False),
    ]


def test_the_bound_keeps_the_newest_and_always_the_current() -> None:
    h: list[dict[str, Any]] = [
        {"revision": f"r{i}", "outcome": "Superseded", "current": False} for i in range(6)
    ]
    h[0] = {"revision": "r0", "outcome": "Current", "current": True}
    kept = bound(h, 3)
    assert [e["revision"] for e in kept] == ["r0", "r4", "r5"]
    assert kept_revisions(kept, "r9", None) == {"r0", "r4", "r5", "r9"}


def test_the_baseline_is_recorded_once() -> None:
    h = [{"revision": "r1", "version": "v1", "outcome": "Current", "current": True, "time": T0}]
    first = with_baseline(h, "r1", 0.81234)
    assert first is not None and first[0]["baselineRate"] == 0.8123
    assert with_baseline(first, "r1", 0.2) is None
    assert with_baseline(h, "unknown", 0.5) is None
    # A later pass keeps it.
    after = update_history(first, desired="r1", version="v1", current="r1", failed=None,
                           failure_message=None, now=T1)  # fmt: skip
    assert after[0]["baselineRate"] == 0.8123
