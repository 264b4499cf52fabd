"""Moving caches between executors: one cache (`move_cache`), or a whole replica (`drain`).

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

Caches are listed and moved under the caller's identity: run a drain with the token of
the identity that owns the caches.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._proto import executor_pb2 as pb
from .aio import AsyncExecutorClient
from .convert import cache_id_of
from .errors import (
    ERROR_DOMAIN,
    AlreadyExistsError,
    ExecutorError,
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
    may_have_taken_effect,
)
from .types import KvCacheHandle

if TYPE_CHECKING:
    from .router import AsyncExecutorRouter

__all__ = ["DrainReport", "MoveResult", "drain", "drain_replica", "move_cache"]

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


@dataclass(slots=True)
class DrainReport:
    """Where each cache of a drained replica went (target index), and those that failed.
    `shutdown_error`: the Shutdown call refused or failed after the caches moved (e.g.
    PERMISSION_DENIED from a server started without --allow-shutdown); the source is up."""

    moved: dict[str, int] = field(default_factory=dict)
    failed: dict[str, ExecutorError] = field(default_factory=dict)
    bytes_moved: int = 0
    seconds: float = 0.0
    shut_down: bool = False
    shutdown_error: ExecutorError | None = None


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


async def quietly(call: Awaitable[Any]) -> None:
    """A clean-up call (a release): its ExecutorError ignored, and run to its end even when
    the task is cancelled meanwhile (a scheduler's close() cancels moves; a release cut short
    leaks a cache), the cancellation re-raised after."""
    async def run() -> None:
        try:
            await call
        except ExecutorError:
            pass

    done = asyncio.ensure_future(run())
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        await done
        raise


async def move_cache(source: AsyncExecutorClient, target: AsyncExecutorClient, cache: KvCacheHandle | str, *,
                     target_id: str | None = None, release_source: bool = True, max_chunk_bytes: int = 0,
                     max_rounds: int = MAX_MOVE_ROUNDS,
                     before_release: Callable[[], Awaitable[None]] | None = None) -> MoveResult:
    """Copy a cache to `target` (under `target_id`, by default its own id), then release it
    on `source` once no step has grown it since (see the module doc). `before_release` is
    awaited before each release attempt (a router holds the cache's calls there)."""
    cid = cache_id_of(cache)
    tid = target_id or cid
    moved = [0, 0]
    started = time.perf_counter()
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
    try:
        rounds, result, released = await _release_source(source, target, cid, tid, result, release_source,
                                                         max_chunk_bytes, max_rounds, before_release, moved)
    except BaseException:
        await quietly(target.release_cache(tid))  # the source keeps the cache: drop the copy
        raise
    return MoveResult(result.kv_cache, rounds, moved[0], time.perf_counter() - started,
                      released if release_source else False)


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


async def _release_source(source, target, cid, tid, result, release_source, max_chunk_bytes, max_rounds,
                          before_release, moved) -> tuple[int, Any, bool | None]:
    length, rounds, released = result.kv_cache.sequence_length, 1, False
    while release_source:
        if before_release is not None:
            await before_release()
        try:
            released = await _release(source, cid, length)
            break
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
    return rounds, result, released


async def drain(source: AsyncExecutorClient, targets: Sequence[AsyncExecutorClient], *, shutdown: bool = True,
                grace_seconds: float = 0.0, concurrency: int = 4, max_chunk_bytes: int = 0) -> DrainReport:
    """Move every cache the caller owns on `source` to the targets (the one with the most
    free blocks first; the next when one is full), then shut `source` down if asked and
    every cache moved. `report.failed` names caches that could not be moved; a Shutdown that
    fails is `report.shutdown_error` (not raised: the moves it reports happened)."""
    if not targets:
        raise ValueError("drain needs at least one target to move the caches to")
    report = DrainReport()
    started = time.perf_counter()
    caches = await source.list_caches()
    free = [s.kv_pool.free_blocks for s in await asyncio.gather(*(t.status() for t in targets))]
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(info: pb.CacheInfo) -> None:
        async with gate:
            order = sorted(range(len(targets)), key=lambda i: -free[i])
            for i in order:
                try:
                    moved = await move_cache(source, targets[i], info.cache_id, max_chunk_bytes=max_chunk_bytes)
                except ResourceExhaustedError as e:
                    report.failed[info.cache_id] = e
                    free[i] = 0
                    continue
                except AlreadyExistsError as e:  # server-chosen ids (kv-N) are per server
                    report.failed[info.cache_id] = e
                    continue
                except ExecutorError as e:
                    report.failed[info.cache_id] = e
                    return
                report.failed.pop(info.cache_id, None)
                report.moved[info.cache_id] = i
                report.bytes_moved += moved.bytes_moved
                free[i] -= info.num_blocks
                return

    await asyncio.gather(*(one(c) for c in caches))
    report.seconds = time.perf_counter() - started
    if shutdown and not report.failed:
        try:
            await source.shutdown(grace_seconds)
            report.shut_down = True
        except ExecutorError as e:
            report.shutdown_error = e
    return report


async def drain_replica(router: AsyncExecutorRouter, replica: int, *, shutdown: bool = True,
                        grace_seconds: float = 0.0, max_chunk_bytes: int = 0) -> DrainReport:
    """Move every cache the caller owns on one of a router's replicas to the others while
    the router keeps serving: each cache's calls are held only for its final release (in
    flight ones finish first), then go to its new replica. No new sequence is placed on
    the replica meanwhile; it is shut down at the end if asked and every cache moved (a
    Shutdown that fails is `report.shutdown_error`, as in `drain`)."""
    if not 0 <= replica < len(router.replicas) or len(router.replicas) < 2:
        raise ValueError(f"replica {replica} cannot be drained: the router has {len(router.replicas)} replicas")
    router.draining.add(replica)
    report = DrainReport()
    started = time.perf_counter()
    source = router.replicas[replica]
    await router.refresh()
    # Listed again until none is left: a step in flight when draining began may create one.
    for _ in range(MAX_MOVE_ROUNDS):
        left = [i.cache_id for i in await source.list_caches() if i.cache_id not in report.failed]
        if not left:
            break
        await _move_all(router, replica, left, report, max_chunk_bytes)
    report.seconds = time.perf_counter() - started
    if shutdown and not report.failed:
        try:
            await source.shutdown(grace_seconds)
            report.shut_down = True
        except ExecutorError as e:  # the caches moved all the same: the report says so
            report.shutdown_error = e
    return report


async def _move_all(router: AsyncExecutorRouter, replica: int, cache_ids: list[str], report: DrainReport,
                    max_chunk_bytes: int) -> None:
    source = router.replicas[replica]
    for cid in cache_ids:
        for target in router.placement_order(exclude=replica):
            try:
                moved = await move_cache(source, router.replicas[target], cid, max_chunk_bytes=max_chunk_bytes,
                                         before_release=lambda c=cid: router.hold_calls(c))
            except BaseException as e:
                router.release_calls(cid, None)  # it stays where it was
                if not isinstance(e, ExecutorError):
                    raise
                if isinstance(e, NotFoundError):
                    break  # released meanwhile (its request ended): nothing to move
                report.failed[cid] = e
                if isinstance(e, ResourceExhaustedError | AlreadyExistsError):
                    continue  # the next replica may have room, or not the id already
                break
            router.release_calls(cid, target)
            report.failed.pop(cid, None)
            report.moved[cid] = target
            report.bytes_moved += moved.bytes_moved
            break


def run_drain_command(args, **client_options: Any) -> bool:
    """`python -m client --target SOURCE drain --to A,B`: prints one line per cache moved and
    a summary; True when every cache moved and the source shut down (or --keep-running).
    `client_options` (credentials, token) go to the source's client and the targets'."""
    from .router import parse_targets

    names = parse_targets(args.to)

    async def run() -> DrainReport:
        source = AsyncExecutorClient(args.target, timeout=args.timeout, **client_options)
        targets = [AsyncExecutorClient(t, timeout=args.timeout, **client_options) for t in names]
        try:
            return await drain(source, targets, shutdown=not args.keep_running, grace_seconds=args.grace_seconds)
        finally:
            await asyncio.gather(source.close(), *(t.close() for t in targets))

    report = asyncio.run(run())
    for cid, i in report.moved.items():
        print(f"moved {cid} -> {names[i]}")
    for cid, e in report.failed.items():
        print(f"failed {cid}: {e}", file=sys.stderr)
    if report.shut_down:
        outcome = "source shut down"
    elif report.shutdown_error is not None:
        outcome = "source left running: its shutdown failed"
    else:
        outcome = "source left running"
    print(f"{len(report.moved)} caches moved ({report.bytes_moved / 1e6:.1f} MB in {report.seconds:.2f} s), "
          f"{len(report.failed)} failed; {outcome}", flush=True)
    if report.failed:
        print("error: some caches could not be moved; the source was left running", file=sys.stderr)
    if report.shutdown_error is not None:
        print(f"error: the source did not shut down: {report.shutdown_error}"
              + (" (start it with --allow-shutdown)" if report.shutdown_error.code.name == "PERMISSION_DENIED"
                 else ""), file=sys.stderr)
    return not report.failed and report.shutdown_error is None
