"""AsyncExecutorRouter: one client over several executor replicas; a cache stays where it was made.

A KV cache lives in one replica's memory and never moves, so every call for a cache must
reach the replica that holds it. The router learns that from the calls that create caches
(the cache id in the handle or unified result a replica returned) and pins caller-chosen
ids when it creates them; afterwards prefill continuations, decode, batch and unified
steps, ForwardVerify, TruncateKv and ReleaseCache for that id go to that replica.

New sequences are spread by load: the replica with the fewest live caches this router
created there, ties broken by the most free KV blocks from GetStatus (refreshed at most
every `status_ttl_s`, concurrently, and only when a new sequence is placed), then in
turn. A replica whose GetStatus fails is skipped for new sequences until it answers.

Server-chosen ids are per replica ("kv-1" exists on each), so for a new cache without an
id the router names it itself (`new_cache_id()`, unique per router) and creates it under
that caller-chosen id. A batch whose items live on several replicas is split into one
call per replica, run concurrently, and merged back in order; each part is all or nothing
on its replica, but parts on different replicas cannot be: when some fail,
`PartialBatchError` carries the failures and the results of the parts that succeeded
(their caches did advance).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import grpc

from ._common import USE_DEFAULT, Timeout
from ._proto import executor_pb2 as pb
from .aio import AsyncExecutorClient
from .convert import cache_id_of
from .errors import ExecutorError, NotFoundError
from .limits import DEFAULT_TIMEOUT_S
from .types import (
    DecodeInput,
    DecodeOutput,
    ForwardOutput,
    ForwardVerifyOutput,
    KvCacheHandle,
    LogitsPolicy,
    PrefillInput,
    PrefillOutput,
    ReleaseResult,
    TokenIds,
    TruncateResult,
    UnifiedBatch,
    UnifiedBatchItem,
    UnifiedItemResult,
)

__all__ = ["AsyncExecutorRouter", "PartialBatchError", "parse_targets"]

_T = TypeVar("_T")

# Failures after which the executor guarantees nothing changed: a cache this call was to
# create does not exist, so its pin can go. Anything else (a deadline, a lost connection)
# may have created it, so the pin stays and a retry lands on the same replica, where the
# executor replays the step.
_DEFINITE = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
})
# Released ids remembered, so a repeated release (or a late call) reaches the right replica.
_RELEASED_REMEMBERED = 4096
_ITEM_FIELD = re.compile(r"^(?:inputs|batch\.items)\[(\d+)\]")


def parse_targets(targets: str | Sequence[str]) -> list[str]:
    """`"h1:1,h2:2"` or a list of addresses, as a list without blanks."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    out = [t.strip() for t in items if t and t.strip()]
    if not out:
        raise ValueError("at least one target (HOST:PORT or unix:///path) is needed")
    return out


class PartialBatchError(ExecutorError):
    """Part of a batch split over replicas failed; the other parts succeeded.

    `results` has one entry per item, in order: the item's result, or None where its
    replica's part failed. `errors` maps replica index to its error. Code, reason and
    metadata are those of the first error, so handlers of ExecutorError still work
    (metadata "field" is renumbered to the item's index in the whole batch).
    """

    def __init__(self, errors: dict[int, ExecutorError], results: list[Any]) -> None:
        first = next(iter(errors.values()))
        super().__init__(f"{len(errors)} of the replicas failed their part of the batch: {first.details_message}",
                         code=first.code, reason=first.reason, metadata=first.metadata, domain=first.domain)
        self.errors = errors
        self.results = results


class AsyncExecutorRouter:
    """Several executor endpoints behind the methods of `AsyncExecutorClient`.

    `targets`: addresses, or ready clients (the router then does not own them and
    `close()` leaves them open). Client keyword arguments (timeout, credentials, token,
    ...) apply to the clients it builds.
    """

    def __init__(
        self,
        targets: str | Sequence[str | AsyncExecutorClient],
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        status_ttl_s: float = 1.0,
        id_prefix: str | None = None,
        **client_kwargs: Any,
    ) -> None:
        items = parse_targets(targets) if isinstance(targets, str) else list(targets)
        if not items:
            raise ValueError("at least one target (HOST:PORT or unix:///path) is needed")
        self.replicas: list[AsyncExecutorClient] = []
        self._owned: list[bool] = []
        for t in items:
            if isinstance(t, AsyncExecutorClient):
                self.replicas.append(t)
                self._owned.append(False)
            else:
                self.replicas.append(AsyncExecutorClient(t, timeout=timeout, **client_kwargs))
                self._owned.append(True)
        self.status_ttl_s = status_ttl_s
        self._prefix = id_prefix if id_prefix is not None else f"rt-{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count(1)
        self._owner: dict[str, int] = {}
        self._released: OrderedDict[str, int] = OrderedDict()
        self._live = [0] * len(self.replicas)
        self._free_blocks: list[int | None] = [None] * len(self.replicas)
        self._healthy = [True] * len(self.replicas)
        self._status_at = float("-inf")
        self._refreshing: asyncio.Task | None = None
        self._turn = 0
        self.draining: set[int] = set()  # replicas that get no new sequence (client.transfer.drain_replica)
        self._held: dict[str, asyncio.Event] = {}  # caches whose calls wait while they move
        self._in_flight: dict[str, int] = {}

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

    # -- moving caches (client.transfer.drain_replica) -------------------------------------
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

    def _settle(self, created: list[str], error: BaseException | None) -> None:
        """Undo pins of caches a failed call certainly did not create."""
        if error is None:
            return
        if isinstance(error, ExecutorError) and error.code not in _DEFINITE:
            return
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

    async def _guard(self, call: Awaitable[_T], created: list[str], touched: Sequence[str]) -> _T:
        for c in touched:  # counted before the first await: a move waits for these calls
            self._in_flight[c] = self._in_flight.get(c, 0) + 1
        try:
            result = await call
        except BaseException as e:
            self._settle(created, e)
            self._lost(e, [c for c in touched if c not in created])
            raise
        finally:
            for c in touched:
                if (n := self._in_flight[c] - 1) > 0:
                    self._in_flight[c] = n
                else:
                    del self._in_flight[c]
        return result

    # -- single-cache calls ---------------------------------------------------------------
    async def prefill(self, item: PrefillInput, *, timeout: Timeout = USE_DEFAULT) -> PrefillOutput:
        await self._maybe_refresh()
        if item.kv_cache is not None:
            await self._wait_moves([item.kv_cache.cache_id])
        item, replica, created = self._prefill_route(item, "input")
        out = await self._guard(self.replicas[replica].prefill(item, timeout=timeout), created,
                                [item.kv_cache.cache_id])
        return out

    async def decode(self, item: DecodeInput, *, timeout: Timeout = USE_DEFAULT) -> DecodeOutput:
        cid = item.kv_cache.cache_id
        await self._wait_moves([cid])
        replica = self._route(cid, "input.kv_cache")
        return await self._guard(self.replicas[replica].decode(item, timeout=timeout), [], [cid])

    async def forward_verify(
        self, kv_cache: KvCacheHandle, tokens: TokenIds, logits_policy: LogitsPolicy | None = None,
        *, timeout: Timeout = USE_DEFAULT,
    ) -> ForwardVerifyOutput:
        await self._wait_moves([kv_cache.cache_id])
        replica = self._route(kv_cache.cache_id, "kv_cache")
        call = self.replicas[replica].forward_verify(kv_cache, tokens, logits_policy, timeout=timeout)
        return await self._guard(call, [], [kv_cache.cache_id])

    async def truncate_kv(self, cache: KvCacheHandle | str, new_length: int, *,
                          timeout: Timeout = USE_DEFAULT) -> TruncateResult:
        cid = cache_id_of(cache)
        await self._wait_moves([cid])
        replica = self._route(cid, "cache_id")
        return await self._guard(self.replicas[replica].truncate_kv(cache, new_length, timeout=timeout), [], [cid])

    async def release_cache(self, cache: KvCacheHandle | str, *, timeout: Timeout = USE_DEFAULT) -> ReleaseResult:
        cid = cache_id_of(cache)
        await self._wait_moves([cid])
        replica = self._route(cid, "cache_id")
        try:
            result = await self.replicas[replica].release_cache(cache, timeout=timeout)
        except NotFoundError:
            self.forget(cid)  # the replica never knew it (or forgot it long ago): gone either way
            raise
        self.forget(cid)
        return result

    async def forward(self, input_ids: TokenIds, output: str = "logits", dtype: str = "float32", *,
                      timeout: Timeout = USE_DEFAULT) -> ForwardOutput:
        """No cache involved: any replica will do; the least loaded takes it."""
        await self._maybe_refresh()
        return await self.replicas[self._least_loaded()].forward(input_ids, output, dtype, timeout=timeout)

    def _prefill_route(self, item: PrefillInput, where: str) -> tuple[PrefillInput, int, list[str]]:
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

    # -- batches: split per replica, merge in order --------------------------------------
    async def batch_prefill(self, items: Sequence[PrefillInput], *,
                            timeout: Timeout = USE_DEFAULT) -> list[PrefillOutput]:
        await self._maybe_refresh()
        await self._wait_moves([it.kv_cache.cache_id for it in items if it.kv_cache is not None])
        routed, replicas, created = [], [], []
        try:
            for i, it in enumerate(items):
                it, r, c = self._prefill_route(it, f"inputs[{i}]")
                routed.append(it)
                replicas.append(r)
                created.extend(c)
        except BaseException:
            self._settle(created, NotFoundError())
            raise
        touched = [it.kv_cache.cache_id for it in routed]
        return await self._split(routed, replicas, lambda r, part: self.replicas[r].batch_prefill(part, timeout=timeout),
                                 created, touched)

    async def batch_decode(self, items: Sequence[DecodeInput], *, timeout: Timeout = USE_DEFAULT) -> list[DecodeOutput]:
        await self._wait_moves([it.kv_cache.cache_id for it in items])
        replicas = [self._route(it.kv_cache.cache_id, f"inputs[{i}].kv_cache") for i, it in enumerate(items)]
        touched = [it.kv_cache.cache_id for it in items]
        return await self._split(list(items), replicas,
                                 lambda r, part: self.replicas[r].batch_decode(part, timeout=timeout), [], touched)

    async def unified_decode(self, batch: UnifiedBatch | Sequence[UnifiedBatchItem], *,
                             timeout: Timeout = USE_DEFAULT) -> list[UnifiedItemResult]:
        items = list(batch.items if isinstance(batch, UnifiedBatch) else batch)
        await self._wait_moves([it.seq_id for it in items if it.seq_id])
        if any(not it.seq_id or (it.pos_offset == 0 and it.seq_id not in self._owner) for it in items):
            await self._maybe_refresh()
        routed, replicas, created = [], [], []
        try:
            for i, it in enumerate(items):
                if not it.seq_id:
                    it = dataclasses.replace(it, seq_id=self.new_cache_id())
                if it.pos_offset == 0 and it.seq_id not in self._owner:
                    r, pinned = self._place_new(it.seq_id)
                    if pinned:
                        created.append(it.seq_id)
                else:
                    r = self._route(it.seq_id, f"batch.items[{i}].seq_id")
                routed.append(it)
                replicas.append(r)
        except BaseException:
            self._settle(created, NotFoundError())
            raise
        touched = [it.seq_id for it in routed]
        return await self._split(routed, replicas,
                                 lambda r, part: self.replicas[r].unified_decode(part, timeout=timeout),
                                 created, touched)

    async def _split(self, items: list[Any], replicas: list[int],
                     call: Callable[[int, list[Any]], Awaitable[list[_T]]],
                     created: list[str], touched: list[str]) -> list[_T]:
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(replicas):
            groups.setdefault(r, []).append(i)
        if len(groups) <= 1:
            return await self._guard(call(replicas[0], items), created, touched) if items else []

        async def part(r: int, idx: list[int]) -> list[_T]:
            sub_created = [c for c in created if c in {touched[i] for i in idx}]
            return await self._guard(call(r, [items[i] for i in idx]), sub_created, [touched[i] for i in idx])

        outs = await asyncio.gather(*(part(r, idx) for r, idx in groups.items()), return_exceptions=True)
        results: list[Any] = [None] * len(items)
        errors: dict[int, ExecutorError] = {}
        for (r, idx), out in zip(groups.items(), outs):
            if isinstance(out, BaseException):
                if not isinstance(out, ExecutorError):
                    raise out
                errors[r] = _renumbered(out, idx)
                continue
            for i, res in zip(idx, out):
                results[i] = res
        if errors:
            raise PartialBatchError(errors, results)
        return results

    # -- descriptive calls: one replica, or all -------------------------------------------
    async def info(self, replica: int = 0, *, timeout: Timeout = USE_DEFAULT) -> pb.ModelInfo:
        return await self.replicas[replica].info(timeout=timeout)

    async def server_info(self, replica: int = 0, *, timeout: Timeout = USE_DEFAULT) -> pb.GetInfoResponse:
        return await self.replicas[replica].server_info(timeout=timeout)

    async def capabilities(self, replica: int = 0, *, timeout: Timeout = USE_DEFAULT) -> pb.ExecutorCapabilities:
        return await self.replicas[replica].capabilities(timeout=timeout)

    async def status(self, replica: int = 0, *, timeout: Timeout = USE_DEFAULT) -> pb.ExecutorStatus:
        return await self.replicas[replica].status(timeout=timeout)

    async def all_capabilities(self, *, timeout: Timeout = USE_DEFAULT) -> list[pb.ExecutorCapabilities]:
        return list(await asyncio.gather(*(r.capabilities(timeout=timeout) for r in self.replicas)))

    async def all_statuses(self, *, timeout: Timeout = USE_DEFAULT) -> list[pb.ExecutorStatus]:
        return list(await asyncio.gather(*(r.status(timeout=timeout) for r in self.replicas)))

    async def wait_ready(self, timeout: float = DEFAULT_TIMEOUT_S, *, poll_interval: float = 0.1) -> None:
        """Every replica SERVING."""
        await asyncio.gather(*(r.wait_ready(timeout, poll_interval=poll_interval) for r in self.replicas))

    async def close(self) -> None:
        """Close the clients the router built (not those it was given)."""
        await asyncio.gather(*(r.close() for r, own in zip(self.replicas, self._owned) if own))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _renumbered(error: ExecutorError, idx: list[int]) -> ExecutorError:
    """The error with its metadata "field" naming the item's index in the whole batch."""
    field = error.metadata.get("field", "")
    m = _ITEM_FIELD.match(field)
    if m and int(m.group(1)) < len(idx):
        error.metadata["field"] = field[:m.start(1)] + str(idx[int(m.group(1))]) + field[m.end(1):]
    return error
