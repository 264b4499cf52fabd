"""CachePlacement: which replica holds each cache, and which replica a new one goes to.

The bookkeeping half of AsyncExecutorRouter (client/router.py), kept apart from the calls
that use it. A KV cache lives in one replica's memory and stays there unless it is moved, so a
table maps each cache id to its replica: pins made when a call may create a cache, undone
when the call certainly did not (client.errors.may_have_taken_effect), forgotten when the
cache is released or lost. New sequences go to the least loaded replica (fewest live caches, then most free KV
blocks from GetStatus, then in turn). client.drain.drain_replica moves caches between
replicas through `hold_calls`/`release_calls`, which is why every routed call is counted
in flight (`_guard`).

AsyncExecutorRouter.__init__ sets the state declared below; this class only reads and
updates it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Iterator, Sequence
from typing import TypeVar

from ._proto import executor_pb2 as pb
from .aio import AsyncExecutorClient
from .convert import cache_id_of
from .errors import ExecutorError, NotFoundError, may_have_taken_effect
from .types import KvCacheHandle, PrefillInput

__all__ = ["CachePlacement"]

_T = TypeVar("_T")

# Released ids remembered, so a repeated release (or a late call) reaches the right replica.
_RELEASED_REMEMBERED = 4096


class CachePlacement:
    """The cache-to-replica table, the load counters and the in-flight counts of a router."""

    # Declared here for the methods below; AsyncExecutorRouter.__init__ assigns them.
    replicas: list[AsyncExecutorClient]
    status_ttl_s: float  # GetStatus at most this often, and only when a sequence is placed
    draining: set[int]  # replicas that get no new sequence (client.drain.drain_replica)
    _prefix: str  # of the cache ids this router names (`new_cache_id`)
    _ids: Iterator[int]  # numbers the ids new_cache_id() makes
    _owner: dict[str, int]  # cache id -> replica holding (or creating) it
    _released: OrderedDict[str, int]  # the last released ids, so late calls still find their replica
    _live: list[int]  # caches created through this router and not released, per replica
    _free_blocks: list[int | None]  # per replica, as of the last GetStatus
    _healthy: list[bool]  # False: the last GetStatus failed; no new sequences until it answers
    _status_at: float  # time.monotonic() of the last refresh
    _refreshing: asyncio.Task | None  # the refresh in progress, shared by concurrent callers
    _turn: int  # ties in load go round-robin from here
    _held: dict[str, asyncio.Event]  # caches whose calls wait while they move
    _in_flight: dict[str, int]  # calls under way per cache; a move waits for them

    # -- placement ------------------------------------------------------------------------
    @property
    def targets(self) -> list[str]:
        return [r.target for r in self.replicas]

    def new_cache_id(self) -> str:
        """A cache id unique to this router (prefix + counter), for a new cache."""
        return f"{self._prefix}{next(self._ids)}"

    def replica_of(self, cache: KvCacheHandle | str) -> int | None:
        """Index of the replica holding (or creating) the cache, or None if unknown."""
        return self._owner.get(cache_id_of(cache))

    def live_caches(self) -> list[int]:
        """Caches created through this router and not yet released, per replica."""
        return list(self._live)

    def free_blocks(self) -> list[int | None]:
        """Free KV blocks per replica as of the last GetStatus (None: not asked yet or down)."""
        return list(self._free_blocks)

    def pin(self, cache_id: str, replica: int | None = None) -> int:
        """Send every call for `cache_id` to `replica` (chosen by load when None); returns it.

        For a caller-chosen id before the call that creates it; an id already pinned keeps
        its replica (a cache never moves) and pinning it elsewhere raises ValueError.
        """
        if cache_id in self._owner:
            if replica is not None and replica != self._owner[cache_id]:
                raise ValueError(f"cache {cache_id!r} lives on replica {self._owner[cache_id]}, not {replica}")
            return self._owner[cache_id]
        if replica is None:
            replica = self._least_loaded()
        if not 0 <= replica < len(self.replicas):
            raise ValueError(f"replica {replica} out of range [0, {len(self.replicas)})")
        self._owner[cache_id] = replica
        self._live[replica] += 1
        self._released.pop(cache_id, None)
        return replica

    def forget(self, cache_id: str) -> None:
        """Drop a cache from the table (it is gone: released, or its replica lost it)."""
        replica = self._owner.pop(cache_id, None)
        if replica is not None:
            self._live[replica] -= 1
            self._released[cache_id] = replica
            if len(self._released) > _RELEASED_REMEMBERED:
                self._released.popitem(last=False)

    def placement_order(self, exclude: int | None = None) -> list[int]:
        """Replicas for a new or moved cache, best first: fewest live caches, most free blocks."""
        order = [i for i in range(len(self.replicas)) if i != exclude and i not in self.draining]
        return sorted(order, key=lambda i: (not self._healthy[i], self._live[i], -(self._free_blocks[i] or 0)))

    # -- moving caches (client.drain.drain_replica) -------------------------------------
    async def hold_calls(self, cache_id: str) -> None:
        """Hold new calls for a cache, and wait until those in flight have finished."""
        self._held.setdefault(cache_id, asyncio.Event())
        while self._in_flight.get(cache_id):
            await asyncio.sleep(0.001)

    def release_calls(self, cache_id: str, replica: int | None) -> None:
        """Let a held cache's calls go: to `replica` when it moved there, else where it was."""
        if replica is not None:
            self._unpin(cache_id)
            self.pin(cache_id, replica)
        event = self._held.pop(cache_id, None)
        if event is not None:
            event.set()

    async def _wait_moves(self, cache_ids: Sequence[str]) -> None:
        while self._held and (event := next((self._held[c] for c in cache_ids if c in self._held), None)):
            await event.wait()

    # -- load: GetStatus and the least loaded replica -------------------------------------
    def _least_loaded(self) -> int:
        candidates = [i for i, ok in enumerate(self._healthy) if ok and i not in self.draining] or [
            i for i in range(len(self.replicas)) if i not in self.draining] or list(range(len(self.replicas)))
        n = len(self.replicas)
        # Fewest live caches, then most free blocks, then whoever's turn it is.
        best = min(candidates, key=lambda i: (self._live[i], -(self._free_blocks[i] or 0), (i - self._turn) % n))
        self._turn = (best + 1) % n
        return best

    async def refresh(self) -> list[pb.ExecutorStatus | None]:
        """GetStatus from every replica at once; a replica that fails is marked down."""
        async def one(i: int) -> pb.ExecutorStatus | None:
            try:
                status = await self.replicas[i].status(timeout=5.0)
            except ExecutorError:
                self._healthy[i], self._free_blocks[i] = False, None
                return None
            self._healthy[i] = True
            self._free_blocks[i] = status.kv_pool.free_blocks
            return status

        statuses = await asyncio.gather(*(one(i) for i in range(len(self.replicas))))
        self._status_at = time.monotonic()
        return list(statuses)

    async def _maybe_refresh(self) -> None:
        if len(self.replicas) < 2 or self.status_ttl_s <= 0:
            return
        if time.monotonic() - self._status_at < self.status_ttl_s:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh())
        await asyncio.shield(self._refreshing)

    # -- routing a call, and undoing pins a call certainly did not use --------------------
    def _route(self, cache_id: str, where: str) -> int:
        replica = self._owner.get(cache_id)
        if replica is None:
            replica = self._released.get(cache_id)
        if replica is None:
            raise NotFoundError(f"{where}: cache {cache_id!r} was not created through this router; "
                                "pin() it to the replica that holds it", reason="CACHE_NOT_ROUTED",
                                metadata={"cache_id": cache_id, "field": where})
        return replica

    def _place_new(self, cache_id: str) -> tuple[int, bool]:
        """(replica, pinned_now) for a cache this call may create."""
        if cache_id in self._owner:
            return self._owner[cache_id], False
        return self.pin(cache_id), True

    def _prefill_route(self, item: PrefillInput, where: str) -> tuple[PrefillInput, int, list[str]]:
        """(item, replica, ids pinned now) for a prefill: a new cache is named and placed here."""
        handle = item.kv_cache
        if handle is None:
            cid = self.new_cache_id()
            item = dataclasses.replace(item, kv_cache=KvCacheHandle(cid, 0))
            replica, _ = self._place_new(cid)
            return item, replica, [cid]
        if handle.sequence_length == 0 and handle.cache_id not in self._owner:
            replica, pinned = self._place_new(handle.cache_id)
            return item, replica, [handle.cache_id] if pinned else []
        return item, self._route(handle.cache_id, f"{where}.kv_cache"), []

    def _settle(self, created: list[str], error: BaseException | None) -> None:
        """Undo pins of caches a failed call certainly did not create."""
        if error is None:
            return
        # Only a status that says so proves nothing was created: a call cancelled (or
        # failed in any other way) after its request went out may have created its caches.
        if not may_have_taken_effect(error):
            self._undo_pins(created)

    def _undo_pins(self, created: list[str]) -> None:
        """Undo the pins of a call refused before it was sent (it created nothing)."""
        for cid in created:
            self._unpin(cid)

    def _unpin(self, cache_id: str) -> None:
        replica = self._owner.pop(cache_id, None)
        if replica is not None:
            self._live[replica] -= 1

    def _lost(self, error: BaseException, cache_ids: Sequence[str]) -> None:
        """A NOT_FOUND from a replica about a routed cache: it is gone there (released, lease ran out)."""
        if isinstance(error, NotFoundError) and error.reason in ("CACHE_NOT_FOUND", "CACHE_RELEASED"):
            gone = error.metadata.get("cache_id")
            for cid in cache_ids:
                if gone is None or gone == cid:
                    self.forget(cid)

    @contextlib.contextmanager
    def _calls_in_flight(self, touched: Sequence[str]) -> Iterator[None]:
        """Count calls on these caches under way while the block runs: a move waits for them."""
        for c in touched:
            self._in_flight[c] = self._in_flight.get(c, 0) + 1
        try:
            yield
        finally:
            for c in touched:
                if (n := self._in_flight[c] - 1) > 0:
                    self._in_flight[c] = n
                else:
                    del self._in_flight[c]

    async def _guard(self, call: Awaitable[_T], created: list[str], touched: Sequence[str]) -> _T:
        with self._calls_in_flight(touched):  # counted before the first await
            try:
                return await call
            except BaseException as e:
                self._settle(created, e)
                self._lost(e, [c for c in touched if c not in created])
                raise
