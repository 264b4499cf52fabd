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

This module is the router's entry point: its constructor, the calls for one cache and the
descriptive calls. The cache-to-replica table and load balancing are in router_placement.py
(CachePlacement), batches split over replicas in router_batches.py (BatchRouting).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Self

from ._common import USE_DEFAULT, Timeout
from ._proto import executor_pb2 as pb
from .aio import AsyncExecutorClient
from .convert import cache_id_of
from .errors import NotFoundError
from .limits import DEFAULT_TIMEOUT_S
from .router_batches import BatchRouting, PartialBatchError
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
)

__all__ = ["AsyncExecutorRouter", "PartialBatchError", "parse_targets"]

# What a cache id allows (kvcache.manager.CACHE_ID_PATTERN), leaving room for the rest of it.
_ID_PREFIX = re.compile(r"[A-Za-z0-9._:-]{0,64}")


def parse_targets(targets: str | Sequence[str]) -> list[str]:
    """`"h1:1,h2:2"` or a list of addresses, as a list without blanks."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    out = [t.strip() for t in items if t and t.strip()]
    if not out:
        raise ValueError("at least one target (HOST:PORT or unix:///path) is needed")
    return out


class AsyncExecutorRouter(BatchRouting):
    """Several executor endpoints behind the methods of `AsyncExecutorClient`.

    `targets`: addresses, or ready clients (the router then does not own them and
    `close()` leaves them open). Client keyword arguments (timeout, credentials, token,
    ...) apply to the clients it builds. `id_prefix` starts the ids of the caches it names
    (`new_cache_id()`: the prefix, a random part, a counter; "rt-" by default).
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
        if id_prefix is not None and not _ID_PREFIX.fullmatch(id_prefix):
            raise ValueError(f"id_prefix {id_prefix!r}: use at most 64 characters from [A-Za-z0-9._:-] "
                             "(cache ids allow those, up to 128)")
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
        # A random part even after a caller's prefix: two routers naming caches on one
        # executor alike would share them, and release them from under each other.
        self._prefix = f"{'rt-' if id_prefix is None else id_prefix}{uuid.uuid4().hex[:12]}-"
        self._ids = itertools.count(1)
        self._owner: dict[str, int] = {}
        self._released: OrderedDict[str, int] = OrderedDict()
        self._live = [0] * len(self.replicas)
        self._free_blocks: list[int | None] = [None] * len(self.replicas)
        self._healthy = [True] * len(self.replicas)
        self._status_at = float("-inf")
        self._refreshing: asyncio.Task | None = None
        self._turn = 0
        self.draining: set[int] = set()  # replicas that get no new sequence (client.drain.drain_replica)
        self._held: dict[str, asyncio.Event] = {}  # caches whose calls wait while they move
        self._in_flight: dict[str, int] = {}

    # -- single-cache calls ---------------------------------------------------------------
    # compact_handles, as the clients' (None: the replica's client's own setting).
    async def prefill(self, item: PrefillInput, *, timeout: Timeout = USE_DEFAULT,
                      compact_handles: bool | None = None) -> PrefillOutput:
        await self._maybe_refresh()
        if item.kv_cache is not None:
            await self._wait_moves([item.kv_cache.cache_id])
        item, replica, created = self._prefill_route(item, "input")
        out = await self._guard(self.replicas[replica].prefill(item, timeout=timeout, compact_handles=compact_handles),
                                created, [item.kv_cache.cache_id])
        return out

    async def decode(self, item: DecodeInput, *, timeout: Timeout = USE_DEFAULT,
                     compact_handles: bool | None = None) -> DecodeOutput:
        cid = item.kv_cache.cache_id
        await self._wait_moves([cid])
        replica = self._route(cid, "input.kv_cache")
        return await self._guard(self.replicas[replica].decode(item, timeout=timeout, compact_handles=compact_handles),
                                 [], [cid])

    async def forward_verify(
        self, kv_cache: KvCacheHandle, tokens: TokenIds, logits_policy: LogitsPolicy | None = None,
        *, timeout: Timeout = USE_DEFAULT, compact_handles: bool | None = None,
    ) -> ForwardVerifyOutput:
        await self._wait_moves([kv_cache.cache_id])
        replica = self._route(kv_cache.cache_id, "kv_cache")
        call = self.replicas[replica].forward_verify(kv_cache, tokens, logits_policy, timeout=timeout,
                                                     compact_handles=compact_handles)
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
        # Counted in flight: a move of this cache waits for it, and then finds it gone.
        with self._calls_in_flight([cid]):
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

