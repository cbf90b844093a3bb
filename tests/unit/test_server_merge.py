"""Choices' streams merged into one: interleaved, complete, closed together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from specpair_runtime.server.merge import merge_streams


async def ticking(name: str, count: int, delay: float, closed: list[str]) -> AsyncIterator[str]:
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        closed.append(name)


async def test_items_come_as_they_are_ready_with_their_index() -> None:
    closed: list[str] = []
    got = [
        pair
        async for pair in merge_streams(
            [ticking("a", 3, 0.03, closed), ticking("b", 3, 0.01, closed)]
        )
    ]
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1"), (1, "b2")]
    assert got[0] == (1, "b0")  # the faster source is not held behind the slower one
    assert [item for index, item in got if index == 0] == ["a0", "a1", "a2"]
    assert sorted(closed) == ["a", "b"]


async def test_closing_the_merged_stream_closes_every_source() -> None:
    closed: list[str] = []
    merged = merge_streams([ticking("a", 100, 0.01, closed), ticking("b", 100, 0.01, closed)])
    async for _ in merged:
        break
    await merged.aclose()  # type: ignore[attr-defined]
    assert sorted(closed) == ["a", "b"]


async def test_an_error_in_one_source_ends_the_stream_and_closes_the_rest() -> None:
    closed: list[str] = []

    async def failing() -> AsyncIterator[str]:
        await asyncio.sleep(0.02)
        raise RuntimeError("engine failed")
        yield "never"

    with pytest.raises(RuntimeError, match="engine failed"):
        async for _ in merge_streams([ticking("a", 100, 0.01, closed), failing()]):
            pass
    assert closed == ["a"]
