"""The waiting queue: priority first, FIFO within a priority, bounded."""

from __future__ import annotations

import pytest

from specpair_runtime.server.queueing import QueueFull, RequestQueue


def test_higher_priority_pops_first_and_fifo_within_priority() -> None:
    queue: RequestQueue[str] = RequestQueue(capacity=10)
    for key, priority in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1), ("f", 0)]:
        queue.push(key, key, priority)
    assert [queue.pop() for _ in range(6)] == ["b", "d", "a", "c", "f", "e"]


def test_full_queue_raises_and_frees_after_pop() -> None:
    queue: RequestQueue[int] = RequestQueue(capacity=2)
    queue.push("1", 1)
    queue.push("2", 2)
    with pytest.raises(QueueFull, match="full"):
        queue.push("3", 3)
    assert queue.pop() == 1
    queue.push("3", 3)
    assert len(queue) == 2


def test_zero_capacity_rejects_everything() -> None:
    queue: RequestQueue[int] = RequestQueue(capacity=0)
    with pytest.raises(QueueFull):
        queue.push("1", 1)


def test_remove_skips_the_item_and_frees_its_place() -> None:
    queue: RequestQueue[str] = RequestQueue(capacity=3)
    for key in "abc":
        queue.push(key, key)
    assert queue.remove("b") == "b"
    assert queue.remove("b") is None
    assert queue.remove("zzz") is None
    queue.push("d", "d", priority=1)
    assert queue.drain() == ["d", "a", "c"]
    with pytest.raises(IndexError):
        queue.pop()


def test_duplicate_key_is_refused() -> None:
    queue: RequestQueue[str] = RequestQueue(capacity=3)
    queue.push("a", "a")
    with pytest.raises(KeyError):
        queue.push("a", "again")
