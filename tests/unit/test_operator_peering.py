"""The resync thread follows kopf's peering rule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from specpair_operator.peering import may_resync, peering_path

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def peer(priority: int, seen_ago_s: int, lifetime: int = 60) -> dict[str, object]:
    seen = NOW - timedelta(seconds=seen_ago_s)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


def test_alone_or_highest_may_resync() -> None:
    assert may_resync({}, "me", 0, NOW)
    assert may_resync({"me": peer(5, 0), "other": peer(1, 0)}, "me", 5, NOW)


def test_a_live_higher_or_equal_peer_pauses() -> None:
    assert not may_resync({"me": peer(5, 0), "other": peer(10, 5)}, "me", 5, NOW)
    assert not may_resync({"other": peer(5, 5)}, "me", 5, NOW)  # kopf pauses both on a tie


def test_dead_or_malformed_peers_do_not_count() -> None:
    assert may_resync({"other": peer(10, 61)}, "me", 0, NOW)  # lastseen + lifetime passed
    assert may_resync({"other": "garbage"}, "me", 0, NOW)
    assert may_resync({"other": {"priority": 10, "lastseen": "yesterday"}}, "me", 0, NOW)


def test_a_record_without_lastseen_is_live_as_in_kopf() -> None:
    assert not may_resync({"other": {"priority": 10}}, "me", 0, NOW)


def test_paths() -> None:
    assert peering_path("p", None) == "/apis/kopf.dev/v1/clusterkopfpeerings/p"
    assert peering_path("p", "ns") == "/apis/kopf.dev/v1/namespaces/ns/kopfpeerings/p"
