"""A de-duplicating work queue of pair keys, as controller-runtime's.

- A key added many times before a worker takes it is handed out once.
- A key being worked on is never handed to a second worker; added meanwhile,
  it is handed out again once the first worker is done.
- ``add_after`` delays a key (a retry with backoff, or a re-check).
- ``backoff`` gives the next retry delay of a key: doubling per failure from
  ``base`` up to ``cap``; ``forget`` resets it after a success.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class ShutDown(Exception):
    """The queue is shut down; workers stop."""


class WorkQueue(Generic[K]):
    def __init__(
        self,
        *,
        base: float = 1.0,
        cap: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cond = threading.Condition()
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._delayed: list[tuple[float, int, K]] = []
        self._tiebreak = itertools.count()
        self._failures: dict[K, int] = {}
        self._shut = False
        self._base, self._cap, self._clock = base, cap, clock

    def add(self, key: K) -> None:
        with self._cond:
            self._add_locked(key)

    def _add_locked(self, key: K) -> None:
        if self._shut or key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._cond.notify()

    def add_after(self, key: K, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            heapq.heappush(self._delayed, (self._clock() + delay, next(self._tiebreak), key))
            self._cond.notify()

    def backoff(self, key: K) -> float:
        """The delay before the next retry of ``key`` (and count this failure)."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        return float(min(self._cap, self._base * 2**failures))

    def forget(self, key: K) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def _promote_due(self) -> float | None:
        """Move due delayed keys to the queue; the seconds until the next one, if any."""
        now = self._clock()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key = heapq.heappop(self._delayed)
            self._add_locked(key)
        return self._delayed[0][0] - now if self._delayed else None

    def get(self, timeout: float | None = None) -> K | None:
        """The next key (mark it processing), or None after ``timeout``; ShutDown when shut."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                if self._shut:
                    raise ShutDown
                wait = self._promote_due()
                if self._queue:
                    key = self._queue.popleft()
                    self._processing.add(key)
                    self._dirty.discard(key)
                    return key
                if deadline is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def done(self, key: K) -> None:
        """The worker finished ``key``; re-queue it when it was added meanwhile."""
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._shut = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)
