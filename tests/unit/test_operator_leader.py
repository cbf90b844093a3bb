"""Lease-based leader election: the pure rules."""

from __future__ import annotations

from datetime import UTC, datetime

from specpair_operator.leader import may_take, micro_time, released_spec, taken_spec

NOW = datetime(2026, 12, 1, 6, 0, 0, 123456, tzinfo=UTC)


def test_micro_time_is_rfc3339_with_microseconds() -> None:
    assert micro_time(NOW) == "2026-12-01T06:00:00.123456Z"


def test_acquiring_counts_a_transition_and_renewing_does_not() -> None:
    old = {"holderIdentity": "a", "acquireTime": "t0", "leaseTransitions": 3}
    taken = taken_spec(old, "b", 8, NOW)
    assert taken["holderIdentity"] == "b" and taken["leaseTransitions"] == 4
    assert taken["acquireTime"] == taken["renewTime"] == micro_time(NOW)
    renewed = taken_spec(taken, "b", 8, NOW)
    assert renewed["leaseTransitions"] == 4 and renewed["acquireTime"] == taken["acquireTime"]


def test_a_lease_is_taken_only_when_free_or_expired() -> None:
    assert may_take(None, "b", 0.0, 8)
    assert may_take("", "b", 0.0, 8)  # released
    assert may_take("b", "b", 0.0, 8)  # ours
    assert not may_take("a", "b", 7.9, 8)  # a live leader
    assert may_take("a", "b", 8.1, 8)  # no renewal seen for a whole lease


def test_release_frees_the_lease() -> None:
    released = released_spec(taken_spec({}, "a", 8, NOW), NOW)
    assert released["holderIdentity"] is None and released["leaseDurationSeconds"] == 1
