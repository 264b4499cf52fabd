"""BatchRouting: batch and unified steps whose items live on several replicas.

Each item goes to the replica that holds its cache (CachePlacement); the batch is split
into one call per replica, run concurrently, and merged back in order. Each part is all or
nothing on its replica, but parts on different replicas cannot be: when some fail,
`PartialBatchError` carries the failures and the results of the parts that succeeded
(their caches did advance), with each error's "field" renumbered to the item's index in
the whole batch so it names the item the caller sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ._common import USE_DEFAULT, Timeout
from .errors import ExecutorError, InvalidArgumentError, UnknownError
from .router_placement import CachePlacement
from .types import (
    DecodeInput,
    DecodeOutput,
    PrefillInput,
    PrefillOutput,
    UnifiedBatch,
    UnifiedBatchItem,
    UnifiedItemResult,
)

__all__ = ["BatchRouting", "PartialBatchError"]

_T = TypeVar("_T")

# The item index in a replica's error "field" (its index in that replica's part).
_ITEM_FIELD = re.compile(r"^(?:inputs|batch\.items)\[(\d+)\]")


class PartialBatchError(ExecutorError):
    """Part of a batch split over replicas failed; the other parts succeeded.

    `results` has one entry per item, in order: the item's result, or None where its
    replica's part failed. `errors` maps replica index to its error (a part that failed on
    the client side, e.g. an item it could not encode, as INVALID_ARGUMENT or UNKNOWN with
    the original as __cause__). Code, reason and metadata are those of the first error, so handlers of ExecutorError still work
    (metadata "field" is renumbered to the item's index in the whole batch).
    """

    def __init__(self, errors: dict[int, ExecutorError], results: list[Any]) -> None:
        first = next(iter(errors.values()))
        super().__init__(f"{len(errors)} of the replicas failed their part of the batch: {first.details_message}",
                         code=first.code, reason=first.reason, metadata=first.metadata, domain=first.domain)
        self.errors = errors
        self.results = results


class BatchRouting(CachePlacement):
    """The router's batch calls: BatchPrefill, BatchDecode and UnifiedDecode, split per replica."""

    # -- batches: split per replica, merge in order --------------------------------------
    # compact_handles, as the clients' (None: each replica's client's own setting).
    async def batch_prefill(self, items: Sequence[PrefillInput], *, timeout: Timeout = USE_DEFAULT,
                            compact_handles: bool | None = None) -> list[PrefillOutput]:
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
            self._undo_pins(created)
            raise
        touched = [it.kv_cache.cache_id for it in routed]
        return await self._split(routed, replicas, lambda r, part: self.replicas[r].batch_prefill(
                                     part, timeout=timeout, compact_handles=compact_handles), created, touched)

    async def batch_decode(self, items: Sequence[DecodeInput], *, timeout: Timeout = USE_DEFAULT,
                           compact_handles: bool | None = None) -> list[DecodeOutput]:
        await self._wait_moves([it.kv_cache.cache_id for it in items])
        replicas = [self._route(it.kv_cache.cache_id, f"inputs[{i}].kv_cache") for i, it in enumerate(items)]
        touched = [it.kv_cache.cache_id for it in items]
        return await self._split(list(items), replicas,
                                 lambda r, part: self.replicas[r].batch_decode(
                                     part, timeout=timeout, compact_handles=compact_handles), [], touched)

    async def unified_decode(self, batch: UnifiedBatch | Sequence[UnifiedBatchItem], *,
                             timeout: Timeout = USE_DEFAULT,
                             compact_handles: bool | None = None) -> list[UnifiedItemResult]:
        items = list(batch.items if isinstance(batch, UnifiedBatch) else batch)
        if any(not it.seq_id or (it.pos_offset == 0 and it.seq_id not in self._owner) for it in items):
            await self._maybe_refresh()
        # No await from here until the calls are counted in flight: a move that found none
        # under way must not see one reach the replica it is moving the cache from.
        await self._wait_moves([it.seq_id for it in items if it.seq_id])
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
            self._undo_pins(created)
            raise
        touched = [it.seq_id for it in routed]
        return await self._split(routed, replicas,
                                 lambda r, part: self.replicas[r].unified_decode(
                                     part, timeout=timeout, compact_handles=compact_handles),
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

        # The parts start on a later turn of the loop: counted in flight now, before it turns,
        # so that a move waiting for this cache's calls waits for them too.
        with self._calls_in_flight(touched):
            outs = await asyncio.gather(*(part(r, idx) for r, idx in groups.items()), return_exceptions=True)
        failures = [o for o in outs if isinstance(o, BaseException)]
        if len(failures) == len(outs) and (odd := [o for o in failures if not isinstance(o, ExecutorError)]):
            raise odd[0]  # no part advanced a cache: no results to keep
        results: list[Any] = [None] * len(items)
        errors: dict[int, ExecutorError] = {}
        for (r, idx), out in zip(groups.items(), outs):
            if isinstance(out, BaseException):
                errors[r] = _renumbered(_as_executor_error(out), idx)
                continue
            for i, res in zip(idx, out):
                results[i] = res
        if errors:
            raise PartialBatchError(errors, results)
        return results


def _as_executor_error(error: BaseException) -> ExecutorError:
    """A part's failure as an ExecutorError, so that a PartialBatchError can carry it beside
    the other parts' results (which advanced their caches): a client-side refusal of the
    part's items (ValueError, TypeError) as INVALID_ARGUMENT, anything else as UNKNOWN."""
    if isinstance(error, ExecutorError):
        return error
    if not isinstance(error, Exception):
        raise error  # a cancellation or an interpreter exit is not a part's failure
    kind = InvalidArgumentError if isinstance(error, ValueError | TypeError | OverflowError) else UnknownError
    wrapped = kind(f"{type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def _renumbered(error: ExecutorError, idx: list[int]) -> ExecutorError:
    """The error with its metadata "field" naming the item's index in the whole batch."""
    field = error.metadata.get("field", "")
    m = _ITEM_FIELD.match(field)
    if m and int(m.group(1)) < len(idx):
        error.metadata["field"] = field[:m.start(1)] + str(idx[int(m.group(1))]) + field[m.end(1):]
    return error
