"""The engine thread's hand-offs to the event loop: in order, one wake-up for many."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specpair_runtime.server.mailbox import Mailbox, mailbox_for


def test_posts_from_another_thread_run_in_order_with_one_wake_up() -> None:
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        mailbox = mailbox_for(loop)
        assert mailbox_for(loop) is mailbox  # one per loop
        wake_ups = 0
        real = loop.call_soon_threadsafe

        def counting(*args: object, **kwargs: object) -> asyncio.Handle:
            nonlocal wake_ups
            wake_ups += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        seen: list[int] = []
        done = asyncio.Event()

        def step() -> None:  # the engine thread: one step's updates for 8 streams
            for stream in range(8):
                mailbox.post(seen.append, stream)
            mailbox.post(lambda _: done.set(), None)

        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
        await asyncio.wait_for(done.wait(), 5)
        return seen, wake_ups

    seen, wake_ups = asyncio.run(main())
    assert seen == list(range(8))
    assert wake_ups == 1


def test_a_post_after_the_loop_ran_the_last_ones_wakes_it_again() -> None:
    async def main() -> list[str]:
        mailbox = Mailbox(asyncio.get_running_loop())
        seen: list[str] = []
        mailbox.post(seen.append, "first")
        await asyncio.sleep(0)  # the loop runs the first post
        assert seen == ["first"]
        mailbox.post(seen.append, "second")
        await asyncio.sleep(0)
        return seen

    assert asyncio.run(main()) == ["first", "second"]


def test_posting_to_a_closed_loop_raises_every_time() -> None:
    loop = asyncio.new_event_loop()
    mailbox = Mailbox(loop)
    loop.close()
    for _ in range(2):  # not swallowed after the first: the engine thread must see it
        with pytest.raises(RuntimeError):
            mailbox.post(print, "lost")
