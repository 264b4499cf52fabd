"""Answers to a request stream in order, with later requests already read and under way.

StepSession's steps queue on the executor's one worker in the order their handling starts, so
starting a step's handling as soon as its request arrives (up to `limit` ahead of the oldest
unanswered one) keeps their order while the next request is read, converted and checked during
the step before it. Each answer is yielded once every earlier one has been.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any


async def answered_in_order(requests: AsyncIterable[Any], answer: Callable[[Any], Awaitable[Any]],
                            limit: int) -> AsyncIterator[Any]:
    """answer(request) for each request, started as it is read, yielded in the order read."""
    started: collections.deque[asyncio.Future] = collections.deque()
    incoming = aiter(requests)
    reading: asyncio.Future | None = asyncio.ensure_future(anext(incoming, None))
    try:
        while reading is not None or started:
            if reading is not None and len(started) < limit:
                # The next request or the oldest answer, whichever comes first (a later answer
                # may be ready sooner, refused before it queued: it waits its turn).
                await asyncio.wait({reading, *list(started)[:1]}, return_when=asyncio.FIRST_COMPLETED)
                if reading.done():
                    request, reading = reading.result(), None
                    if request is not None:
                        started.append(asyncio.ensure_future(answer(request)))
                        reading = asyncio.ensure_future(anext(incoming, None))
                    continue
            yield await started.popleft()
    finally:
        for pending in (*started, reading):
            if pending is not None:
                pending.cancel()
