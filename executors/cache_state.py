"""Per-cache facts the executor keeps beside the block tables: owner, lease, last step.

- owner: the identity that created the cache; nobody else may use it.
- adapter: the LoRA adapter its K and V were computed with, for every later step.
- last_used: when the cache was last touched; idle caches past their lease are reclaimed,
  so a client that vanished does not hold KV blocks forever. A call naming the cache counts
  as use from its arrival to its end (`using`): a cache is not reaped while a call for it
  waits in the queue or runs, and its lease starts over when the call ends, not when it began.
- last_step: what the latest append did and returned, so a retried step (same position,
  same tokens, same policy) gets the same answer instead of appending its tokens twice.
- serial and claims: which creation this is (ids are reused once released), and how many
  later calls have completed on it. A call whose caller went away undoes the caches it
  created, but only those nobody else has completed on since: a retry that got the same
  cache by replay, or a step that continued it, now owns it (`unclaimed`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from executors.errors import PermissionDenied

if TYPE_CHECKING:
    from executors.lora import LoraAdapter


@dataclass(frozen=True, slots=True)
class StepRecord:
    start: int
    tokens: tuple[int, ...]
    request: Any  # what else must match for a replay (rows wanted, logits policy)
    result: Any  # the StepResult that was returned


@dataclass(slots=True)
class CacheState:
    owner: str | None
    adapter: LoraAdapter | None = None
    last_used: float = field(default_factory=time.monotonic)
    last_step: StepRecord | None = None
    serial: int = 0  # which creation of this id
    claims: int = 0  # later calls that completed on the cache


class CacheRegistry:
    def __init__(self) -> None:
        self._states: dict[str, CacheState] = {}
        self._serials = itertools.count(1)
        self.leases_expired = 0
        # Calls under way per cache id: counted on the event loop, read by the reaper on the worker.
        self._in_use: dict[str, int] = {}
        self._in_use_lock = threading.Lock()

    def add(self, cache_id: str, owner: str | None, adapter: LoraAdapter | None = None) -> int:
        """Register a new cache; returns its creation serial."""
        serial = next(self._serials)
        self._states[cache_id] = CacheState(owner, adapter, serial=serial)
        return serial

    def claim(self, cache_id: str) -> None:
        """A call other than the creating one completed on the cache."""
        state = self._states.get(cache_id)
        if state is not None:
            state.claims += 1

    def mark(self, cache_id: str) -> tuple[int, int]:
        """(creation serial, claims): equal later only if no other call completed on the cache since."""
        state = self._states.get(cache_id)
        return (state.serial, state.claims) if state is not None else (0, -1)

    def unclaimed(self, cache_id: str, serial: int) -> bool:
        """The cache is still the creation `serial` and no later call has completed on it."""
        return self.mark(cache_id) == (serial, 0)

    def adapter_bindings(self) -> dict[str, int]:
        """Live caches per LoRA adapter name."""
        counts: dict[str, int] = {}
        for state in list(self._states.values()):  # read from the event loop while the worker runs
            if state.adapter is not None:
                counts[state.adapter.name] = counts.get(state.adapter.name, 0) + 1
        return counts

    def items(self) -> list[tuple[str, CacheState]]:
        """Every cache's state, in creation order."""
        return list(self._states.items())

    def remove(self, cache_id: str) -> None:
        self._states.pop(cache_id, None)

    def clear(self) -> None:
        self._states.clear()

    def touch(self, cache_id: str, identity: str | None, where: str) -> CacheState:
        """The cache's state, after checking the caller owns it; renews its lease."""
        state = self._states[cache_id]
        if state.owner != identity:
            raise PermissionDenied(f"{where}: cache {cache_id!r} belongs to another identity",
                                   field=where, reason="CACHE_OWNED_BY_ANOTHER", cache_id=cache_id)
        state.last_used = time.monotonic()
        return state

    def replay(self, cache_id: str, length: int, start: int, tokens: Sequence[int], request: Any) -> Any | None:
        """The recorded result if this request repeats the cache's last step exactly, else None."""
        last = self._states[cache_id].last_step
        if (last is not None and last.start == start and length == start + len(last.tokens)
                and last.tokens == tuple(tokens) and last.request == request):
            return last.result
        return None

    def last_step(self, cache_id: str) -> StepRecord | None:
        return self._states[cache_id].last_step

    def record(self, cache_id: str, start: int, tokens: Sequence[int], request: Any, result: Any) -> None:
        self._states[cache_id].last_step = StepRecord(start, tuple(tokens), request, result)

    def forget_step(self, cache_id: str) -> None:
        self._states[cache_id].last_step = None

    def use(self, cache_ids: Collection[str]) -> None:
        """Calls for these caches arrived: none is idle until done_using."""
        with self._in_use_lock:
            for cid in cache_ids:
                self._in_use[cid] = self._in_use.get(cid, 0) + 1

    def done_using(self, cache_ids: Collection[str]) -> None:
        """Those calls ended: their caches' leases start over from now."""
        now = time.monotonic()
        with self._in_use_lock:
            for cid in cache_ids:
                if (left := self._in_use[cid] - 1) > 0:
                    self._in_use[cid] = left
                else:
                    del self._in_use[cid]
                if (state := self._states.get(cid)) is not None:
                    state.last_used = max(state.last_used, now)

    @contextlib.contextmanager
    def using(self, cache_ids: Collection[str]) -> Iterator[None]:
        self.use(cache_ids)
        try:
            yield
        finally:
            self.done_using(cache_ids)

    def renew(self, cache_ids: Collection[str]) -> None:
        """A step on these caches just ended (on the worker, before a reaper queued behind it runs)."""
        now = time.monotonic()
        for cid in cache_ids:
            if (state := self._states.get(cid)) is not None:
                state.last_used = now

    def idle(self, ttl_s: float) -> list[str]:
        """Ids of caches untouched for longer than ttl_s, and with no call for them under way."""
        cutoff = time.monotonic() - ttl_s
        with self._in_use_lock:
            busy = set(self._in_use)
        return [cid for cid, s in self._states.items() if s.last_used < cutoff and cid not in busy]
