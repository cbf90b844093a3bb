"""Hand-offs from the engine thread to the event loop, one wake-up for many.

``loop.call_soon_threadsafe`` writes a byte to the loop's self-pipe on every
call: a system call on the engine thread, and a wake-up of the event loop
that then takes the GIL from it. The engine thread hands over one update per
running request per step, so at 8 streams a step woke the loop 8 times. A
``Mailbox`` queues the callbacks and asks for one wake-up until the loop has
run them; the order of the callbacks is kept.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any

_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = (
    weakref.WeakKeyDictionary()
)
_CREATE = threading.Lock()


class Mailbox:
    """Callbacks posted from any thread, run on ``loop`` in the order posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], object], Any]] = []

    def post(self, callback: Callable[[Any], object], argument: Any) -> None:
        """Run ``callback(argument)`` on the loop soon; callable from any thread."""
        with self._lock:
            self._pending.append((callback, argument))
            if len(self._pending) > 1:
                return  # a wake-up is already on its way and will run this one too
        try:
            self._loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed: nothing will run, say so to every poster
            with self._lock:
                self._pending.clear()
            raise

    def _run(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for callback, argument in pending:
            callback(argument)


def mailbox_for(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one mailbox (made on first use)."""
    with _CREATE:
        mailbox = _MAILBOXES.get(loop)
        if mailbox is None:
            mailbox = _MAILBOXES[loop] = Mailbox(loop)
        return mailbox
