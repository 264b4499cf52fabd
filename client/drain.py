"""Draining: every cache the caller owns on one executor moved to others (`drain`), or on
one of a router's replicas while the router keeps serving (`drain_replica`), each with
client/transfer.py's `move_cache`; then the source shut down if asked and all moved.
`python -m client drain` runs `drain` (`run_drain_command`).

Caches are listed and moved under the caller's identity: run a drain with the token of
the identity that owns the caches.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._proto import executor_pb2 as pb
from .aio import AsyncExecutorClient
from .errors import AlreadyExistsError, ExecutorError, NotFoundError, ResourceExhaustedError
from .transfer import MAX_MOVE_ROUNDS, MoveResult, move_cache

if TYPE_CHECKING:
    from .router import AsyncExecutorRouter

__all__ = ["DrainReport", "drain", "drain_replica", "run_drain_command"]


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


async def drain(source: AsyncExecutorClient, targets: Sequence[AsyncExecutorClient], *, shutdown: bool = True,
                grace_seconds: float = 0.0, concurrency: int = 4, max_chunk_bytes: int = 0,
                report: DrainReport | None = None) -> DrainReport:
    """Move every cache the caller owns on `source` to the targets (the one with the most
    free blocks first; the next when one is full), then shut `source` down if asked and
    every cache moved. `report.failed` names caches that could not be moved; a Shutdown that
    fails is `report.shutdown_error` (not raised: the moves it reports happened). Each move
    is in `report` (the caller's, if given) once it happened, so a caller that cancels the
    drain still knows where the caches it moved are."""
    if not targets:
        raise ValueError("drain needs at least one target to move the caches to")
    report = report if report is not None else DrainReport()
    started = time.perf_counter()
    caches = await source.list_caches()
    free = [s.kv_pool.free_blocks for s in await asyncio.gather(*(t.status() for t in targets))]
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(info: pb.CacheInfo) -> None:
        async with gate:
            order = sorted(range(len(targets)), key=lambda i: -free[i])
            for i in order:
                def landed(moved: MoveResult, i: int = i) -> None:  # the move's commit point
                    report.failed.pop(info.cache_id, None)
                    report.moved[info.cache_id] = i
                    report.bytes_moved += moved.bytes_moved
                    free[i] -= info.num_blocks

                try:
                    await move_cache(source, targets[i], info.cache_id, max_chunk_bytes=max_chunk_bytes,
                                     on_released=landed)
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
            landed: list[int] = []

            def route_there(moved: MoveResult, cid: str = cid, target: int = target, landed: list[int] = landed) -> None:
                # The source copy is released: the calls go to the target from now on, even if
                # the drain is cancelled right after (the move has happened all the same).
                landed.append(target)
                router.release_calls(cid, target)
                report.failed.pop(cid, None)
                report.moved[cid] = target
                report.bytes_moved += moved.bytes_moved

            try:
                await move_cache(source, router.replicas[target], cid, max_chunk_bytes=max_chunk_bytes,
                                 before_release=lambda c=cid: router.hold_calls(c), on_released=route_there)
            except BaseException as e:
                if landed:
                    raise  # cancelled once it had moved
                router.release_calls(cid, None)  # it stays where it was
                if not isinstance(e, ExecutorError):
                    raise
                if isinstance(e, NotFoundError):
                    break  # released meanwhile (its request ended): nothing to move
                report.failed[cid] = e
                if isinstance(e, ResourceExhaustedError | AlreadyExistsError):
                    continue  # the next replica may have room, or not the id already
                break
            break


def run_drain_command(args, **client_options: Any) -> bool:
    """`python -m client --target SOURCE drain --to A,B`: prints one line per cache moved and
    a summary; True when every cache moved and the source shut down (or --keep-running).
    `client_options` (credentials, token) go to the source's client and the targets'."""
    from .router import parse_targets

    names = parse_targets(args.to)

    report = DrainReport()

    async def run() -> DrainReport:
        source = AsyncExecutorClient(args.target, timeout=args.timeout, **client_options)
        targets = [AsyncExecutorClient(t, timeout=args.timeout, **client_options) for t in names]
        try:
            return await drain(source, targets, shutdown=not args.keep_running, grace_seconds=args.grace_seconds,
                               report=report)
        finally:
            await asyncio.gather(source.close(), *(t.close() for t in targets))

    def print_moved() -> None:
        for cid, i in report.moved.items():
            print(f"moved {cid} -> {names[i]}")

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # Ctrl-C: where the caches it moved went, then status 130
        print_moved()
        print(f"interrupted: {len(report.moved)} caches moved; the others are still on the source, which was "
              "left running", file=sys.stderr, flush=True)
        raise
    print_moved()
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
