"""The waiting queue: priority first, FIFO within a priority, bounded.

Pure data structure (no threads); the scheduler guards it with its lock.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """The waiting queue holds its maximum; the caller answers 429."""


@dataclass(order=True)
class _Entry(Generic[T]):
    neg_priority: int
    seq: int
    key: str = field(compare=False)
    item: T = field(compare=False)
    removed: bool = field(default=False, compare=False)


class RequestQueue(Generic[T]):
    """Higher ``priority`` pops first; equal priorities pop in arrival order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._heap: list[_Entry[T]] = []
        self._by_key: dict[str, _Entry[T]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._by_key)

    def push(self, key: str, item: T, priority: int = 0) -> None:
        if len(self._by_key) >= self.capacity:
            raise QueueFull(f"the waiting queue is full ({self.capacity} requests)")
        if key in self._by_key:
            raise KeyError(f"request {key!r} is already queued")
        entry = _Entry(-priority, next(self._seq), key, item)
        self._by_key[key] = entry
        heapq.heappush(self._heap, entry)

    def pop(self) -> T:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if not entry.removed:
                del self._by_key[entry.key]
                return entry.item
        raise IndexError("pop from an empty RequestQueue")

    def remove(self, key: str) -> T | None:
        """Drop a queued item (lazy deletion); None when it is not queued."""
        entry = self._by_key.pop(key, None)
        if entry is None:
            return None
        entry.removed = True
        return entry.item

    def drain(self) -> list[T]:
        """Remove and return everything, in pop order."""
        items = []
        while self:
            items.append(self.pop())
        return items
