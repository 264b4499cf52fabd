"""service/read_ahead.py: answers in the order read, started as requests arrive, at most `limit` ahead."""

from __future__ import annotations

import asyncio

import pytest

from service.read_ahead import answered_in_order


async def requests(items, gate: asyncio.Event | None = None):
    for i, item in enumerate(items):
        if gate is not None and i == 2:
            await gate.wait()
        yield item


def test_answers_come_in_order_though_later_ones_end_first():
    started: list[int] = []

    async def answer(n: int) -> int:
        started.append(n)
        await asyncio.sleep(0.02 * (4 - n))  # the first request takes longest
        return n * 10

    async def drive():
        return [a async for a in answered_in_order(requests([0, 1, 2, 3]), answer, limit=4)]

    assert asyncio.run(drive()) == [0, 10, 20, 30]
    assert started == [0, 1, 2, 3]


def test_no_more_than_limit_are_under_way():
    live, most = 0, 0

    async def answer(n: int) -> int:
        nonlocal live, most
        live += 1
        most = max(most, live)
        await asyncio.sleep(0.005)
        live -= 1
        return n

    async def drive():
        return [a async for a in answered_in_order(requests(range(12)), answer, limit=3)]

    assert asyncio.run(drive()) == list(range(12))
    assert most == 3


def test_the_next_request_starts_while_the_one_before_runs():
    """Request 1 is started before answer 0 is yielded; closing the stream early cancels what runs."""
    events: list[str] = []
    gate = asyncio.Event()
    cancelled: list[int] = []

    async def answer(n: int) -> int:
        events.append(f"start {n}")
        try:
            await asyncio.sleep(0.05 if n < 2 else 10)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        return n

    async def drive():
        gen = answered_in_order(requests([0, 1, 2, 3], gate), answer, limit=4)
        first = await anext(gen)
        events.append(f"answer {first}")
        gate.set()
        await anext(gen)
        await asyncio.sleep(0.01)  # requests 2 and 3 start
        await gen.aclose()

    asyncio.run(drive())
    assert events[:3] == ["start 0", "start 1", "answer 0"]
    assert sorted(cancelled) == [2, 3]


def test_a_broken_request_stream_raises_at_once_and_cancels_what_runs():
    """The call is over (a client that went away): nobody would read the answers."""
    cancelled: list[int] = []

    async def broken():
        yield 1
        raise RuntimeError("stream broke")

    async def answer(n: int) -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        return n

    async def drive():
        got = []
        with pytest.raises(RuntimeError, match="stream broke"):
            async for a in answered_in_order(broken(), answer, limit=2):
                got.append(a)
        return got

    assert asyncio.run(drive()) == [] and cancelled == [1]
