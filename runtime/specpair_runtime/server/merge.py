"""Several choices' streams as one: chunks in the order they come, each with its choice index.

A request with ``n > 1`` (or several prompts) runs one generation per choice;
its SSE stream interleaves their chunks as each is ready, as OpenAI's and
vLLM's do. Closing the merged stream closes every source (so each
generation aborts and frees its slot); a source that raises ends the merged
stream with that error after closing the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


async def merge_streams(sources: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(source index, item) pairs from all ``sources`` until each is exhausted."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                await queue.put((index, item))
        except BaseException as error:  # handed to the consumer, which re-raises it
            await queue.put((index, error))
            return
        await queue.put((index, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        for source in sources:
            closer = getattr(source, "aclose", None)
            if closer is not None:
                with contextlib.suppress(BaseException):
                    await closer()
