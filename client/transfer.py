"""Moving a cache between executors (`move_cache`); client/drain.py moves a whole replica's.

A move streams ExportKv from the source straight into ImportKv on the target (no whole
cache is ever buffered here, and chunks are forwarded as the bytes they arrived as, never
parsed: both RPCs carry a chunk as the same field), then releases the source copy only if it still holds the
length that was moved (ReleaseCache's expected_length). If a step grew it meanwhile, the
new tail is moved the same way and the release tried again, so a scheduler that keeps
decoding during the move loses nothing: each of its steps lands either on the source
before the release (and its token is moved with the tail) or, after it, on the target.
If the source shrank (a truncate) the target copy is dropped and the move starts over.

A cache is never left on neither executor: a release whose answer was lost is asked
again (a retry that finds nothing left to release means the lost one did it), and if no
answer comes at all the target copy is kept (MoveResult.source_released None). A source
found already released (its owner ended it during the move) drops the copy: NOT_FOUND.
The release is the move's commit point: a cancellation that arrives while it is in flight
waits for its answer, and if the source was released the copy is kept and `on_released`
told (a drain cancelled by Ctrl-C used to drop the copy of a cache it had just released).

A cache is moved under the caller's identity: the one that owns it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ._proto import executor_pb2 as pb
from .aio import AsyncExecutorClient
from .convert import cache_id_of
from .errors import ERROR_DOMAIN, ExecutorError, FailedPreconditionError, NotFoundError, may_have_taken_effect
from .types import KvCacheHandle

__all__ = ["MAX_MOVE_ROUNDS", "MoveResult", "move_cache", "quietly", "through_cancellation"]

MAX_MOVE_ROUNDS = 16
RELEASE_ATTEMPTS = 3  # a source release whose answer was lost is asked again, this often in all


@dataclass(slots=True)
class MoveResult:
    """The cache on the target, and what it took to get it there."""

    kv_cache: KvCacheHandle
    rounds: int  # exports streamed (1, plus one per tail a concurrent step added)
    bytes_moved: int  # K and V bytes streamed
    seconds: float
    # True: the source copy was released; False: not asked to (release_source=False); None:
    # its release went unanswered every time it was asked (the source unreachable): the
    # target copy is the cache now, and the source may hold a stale one until its lease ends.
    source_released: bool | None = True

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds else 0.0


def _export(source: AsyncExecutorClient, cache_id: str, start: int, max_chunk_bytes: int) -> AsyncIterator[bytes]:
    return source.export_kv(cache_id, start=start or None, max_chunk_bytes=max_chunk_bytes, raw=True)


async def _counted(stream: AsyncIterator[bytes], counter: list[int]) -> AsyncIterator[bytes]:
    """The stream's serialized messages; the K and V bytes its description announces counted
    (counter[0]), and the length the copy will have (counter[1])."""
    first = True
    async for message in stream:
        if first:
            description = pb.ExportKvResponse.FromString(message).description
            counter[0] += description.total_bytes
            counter[1] = description.end_position
            first = False
        yield message


async def through_cancellation(call: Awaitable[Any]) -> tuple[Any, bool]:
    """(the call's result, whether the task was cancelled meanwhile): the call runs to its end
    however often the task is cancelled, so that the caller can act on its outcome before it
    re-raises the cancellation. A call that failed raises its error, or, once the task was
    cancelled, CancelledError."""
    task = asyncio.ensure_future(call)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])  # unlike awaiting the task, a cancellation here leaves it running
        except asyncio.CancelledError:
            cancelled = True
    if cancelled and (task.cancelled() or task.exception() is not None):
        raise asyncio.CancelledError
    return task.result(), cancelled


async def quietly(call: Awaitable[Any]) -> None:
    """A clean-up call (a release): its ExecutorError ignored, and run to its end even when
    the task is cancelled meanwhile (a scheduler's close() cancels moves; a release cut short
    leaks a cache), the cancellation re-raised after."""
    async def run() -> None:
        try:
            await call
        except ExecutorError:
            pass

    if (await through_cancellation(run()))[1]:
        raise asyncio.CancelledError


async def move_cache(source: AsyncExecutorClient, target: AsyncExecutorClient, cache: KvCacheHandle | str, *,
                     target_id: str | None = None, release_source: bool = True, max_chunk_bytes: int = 0,
                     max_rounds: int = MAX_MOVE_ROUNDS,
                     before_release: Callable[[], Awaitable[None]] | None = None,
                     on_released: Callable[[MoveResult], None] | None = None) -> MoveResult:
    """Copy a cache to `target` (under `target_id`, by default its own id), then release it
    on `source` once no step has grown it since (see the module doc). `before_release` is
    awaited before each release attempt (a router holds the cache's calls there);
    `on_released` is called with the result the moment the source copy is released (or its
    release went unanswered), even when the task is cancelled at that moment: the copy on the
    target is the cache from then on, and the CancelledError that follows does not undo it."""
    cid = cache_id_of(cache)
    tid = target_id or cid
    moved = [0, 0]
    started = time.perf_counter()
    committed: list[MoveResult] = []

    def commit(rounds: int, result: Any, released: bool | None) -> None:
        committed.append(MoveResult(result.kv_cache, rounds, moved[0], time.perf_counter() - started, released))
        if on_released is not None:
            on_released(committed[0])

    try:
        result = await target.import_kv(_counted(_export(source, cid, 0, max_chunk_bytes), moved), tid)
    except BaseException as e:
        # Not after a refusal (no room, the id another cache's there): nothing was created; nor
        # before the stream's start went out. Otherwise the import may have completed, its answer
        # lost: drop the copy, and only a copy of that length (an id the target had already is
        # another's cache, and the import may have failed before the target said so).
        if may_have_taken_effect(e) and moved[1]:
            await quietly(target.release_cache(tid, expected_length=moved[1]))
        raise
    if not release_source:
        return MoveResult(result.kv_cache, 1, moved[0], time.perf_counter() - started, False)
    try:
        await _release_source(source, target, cid, tid, result, max_chunk_bytes, max_rounds, before_release,
                              moved, commit)
    except BaseException:
        if not committed:  # the source keeps the cache: drop the copy
            await quietly(target.release_cache(tid))
        raise
    return committed[0]


async def _release(source: AsyncExecutorClient, cid: str, length: int) -> bool | None:
    """Release the source copy if it holds `length` tokens: True once released, None if no
    answer came back (it may or may not have been); NotFoundError if it was gone already
    (its owner released it during the move: the copy would bring it back)."""
    lost = 0
    while True:
        try:
            result = await source.release_cache(cid, expected_length=length)
        except ExecutorError as e:
            if not may_have_taken_effect(e):
                raise
            lost += 1
            if lost == RELEASE_ATTEMPTS:
                return None  # the copy is kept: on both, maybe, rather than on neither
            await asyncio.sleep(0.05 * 4 ** lost)
            continue
        # After an answer was lost, "nothing to release" is that attempt's own success.
        if not result.released and not lost:
            raise NotFoundError(f"cache {cid!r} was released on the source while it moved", reason="CACHE_RELEASED",
                                metadata={"cache_id": cid}, domain=ERROR_DOMAIN)
        return True


async def _release_source(source, target, cid, tid, result, max_chunk_bytes, max_rounds, before_release, moved,
                          commit: Callable[[int, Any, bool | None], None]) -> None:
    length, rounds = result.kv_cache.sequence_length, 1
    while True:
        if before_release is not None:
            await before_release()
        try:
            released, cancelled = await through_cancellation(_release(source, cid, length))
            commit(rounds, result, released)
            if cancelled:
                raise asyncio.CancelledError
            return
        except FailedPreconditionError as e:
            if e.reason != "STALE_CACHE_HANDLE" or rounds >= max_rounds:
                raise
            now = int(e.metadata.get("cache_length", "-1"))
        rounds += 1
        tail = _export(source, cid, length, max_chunk_bytes) if now > length else None
        try:
            if tail is None:
                raise FailedPreconditionError("the source cache shrank", reason="KV_TOKENS_MISMATCH")
            result = await target.import_kv(_counted(tail, moved), tid)
        except FailedPreconditionError:
            # Shrunk, or rewritten past the moved length: the copy is stale; move it anew.
            await target.release_cache(tid)
            result = await target.import_kv(_counted(_export(source, cid, 0, max_chunk_bytes), moved), tid)
        length = result.kv_cache.sequence_length
