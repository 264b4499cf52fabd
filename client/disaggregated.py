"""Disaggregated serving: prompts prefilled on some executors, decoded on others, each cache
moved once in between (client/transfer.py's `move_cache`).

    prefill = AsyncExecutorRouter(["gpu0:50051"])
    decode = AsyncExecutorRouter(["gpu1:50051", "gpu2:50051"])
    async with DisaggregatedScheduler(prefill, decode, max_num_batched_tokens=512) as sched:
        async for token in sched.submit(prompt_ids, max_tokens=32):
            ...

Two continuous-batching schedulers (client/scheduler.py), with one config, do the stepping.
The prefill one batches prompt chunks over the prefill executors. Once a prompt is in and
its first token drawn, the sequence leaves it with its cache (Scheduler._handoff); the
cache is streamed to a decode executor (ExportKv into ImportKv) and released on the
prefill side; the decode scheduler adopts the sequence and batches its decode steps with
the others there. A request that ends with its first token never moves.

Decode target: the fewest live sequences (running there, or moving there), then the most
free blocks. An import refused with RESOURCE_EXHAUSTED goes to the next target; when all
refuse, the move backs off and tries again as decodes finish, and fails the request after
`max_stall_s`. A transient failure (UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED) goes to the
next target, `retry_attempts` times at most; anything else fails that request alone.
Whatever a failed or cancelled move leaves (the copy on the target, the prefill cache) is
released. Preempted on the decode side, a sequence is recomputed there.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from .aio import AsyncExecutorClient
from .errors import ExecutorError, ResourceExhaustedError
from .router import AsyncExecutorRouter
from .scheduler import Completion, RequestStream, Scheduler, SchedulerConfig, SchedulerStats
from .sequence import _Seq
from .step_runner import _int
from .transfer import move_cache, quietly
from .types import KvCacheHandle

__all__ = ["DisaggregatedScheduler", "DisaggregatedStats"]


@dataclass(slots=True)
class DisaggregatedStats:
    prefill: SchedulerStats
    decode: SchedulerStats
    moves: int = 0  # caches moved to a decode executor
    move_refusals: int = 0  # imports refused with RESOURCE_EXHAUSTED (tried elsewhere, or later)
    move_retries: int = 0  # transient move failures tried again
    failed_moves: int = 0  # requests failed by their move
    bytes_moved: int = 0
    move_seconds: float = 0.0  # summed over moves

    @property
    def steps(self) -> int:
        return self.prefill.steps + self.decode.steps

    @property
    def preemptions(self) -> int:
        return self.prefill.preemptions + self.decode.preemptions

    @property
    def max_items_per_step(self) -> int:
        return max(self.prefill.max_items_per_step, self.decode.max_items_per_step)

    @property
    def generated_tokens(self) -> int:
        return self.prefill.generated_tokens + self.decode.generated_tokens


class _PrefillScheduler(Scheduler):
    def __init__(self, owner: DisaggregatedScheduler, executor: Any, config: SchedulerConfig | None,
                 **overrides: Any) -> None:
        super().__init__(executor, config, **overrides)
        self._owner = owner

    def _handoff(self, s: _Seq) -> bool:
        return self._owner._handoff(s)


class _DecodeScheduler(Scheduler):
    def adopt(self, s: _Seq, replica: int, cache: KvCacheHandle, reserved: int) -> None:
        """Run a sequence whose cache was just imported on `replica` (`reserved` blocks of it
        already counted off that replica's free blocks)."""
        rep = self.replicas[replica]
        s.cache_id, s.replica, s.computed = cache.cache_id, replica, cache.sequence_length
        s.blocks = cache.held_blocks or rep.blocks_for(cache.sequence_length)
        rep.free_blocks -= s.blocks - reserved
        s.order, s.stall_since = next(self._order), None
        s.stream._scheduler = self  # its cancel() reaches this scheduler from now on
        self.router.pin(s.cache_id, replica)
        self._running.append(s)
        self._ensure_task()
        assert self._wake is not None
        self._wake.set()


class DisaggregatedScheduler:
    """Prefill on `prefill`, decode on `decode` (each an AsyncExecutorClient or an
    AsyncExecutorRouter); submit() and generate() as Scheduler's. Config and overrides
    apply to both sides; `max_concurrent_moves` bounds the moves in flight."""

    def __init__(self, prefill: AsyncExecutorClient | AsyncExecutorRouter,
                 decode: AsyncExecutorClient | AsyncExecutorRouter, config: SchedulerConfig | None = None, *,
                 max_concurrent_moves: int = 4, **overrides: Any) -> None:
        self.prefill = _PrefillScheduler(self, prefill, config, **overrides)
        self.config = self.prefill.config
        self.decode = _DecodeScheduler(decode, self.config)
        self.stats = DisaggregatedStats(self.prefill.stats, self.decode.stats)
        self._gate = asyncio.Semaphore(max(1, max_concurrent_moves))
        self._moves: set[asyncio.Task] = set()
        self._incoming: collections.Counter[int] = collections.Counter()  # moves in flight per decode replica
        self._streams: set[RequestStream] = set()
        self._closing = False

    # -- public API (as Scheduler's) ------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(self.prefill.start(), self.decode.start())

    def submit(self, prompt_ids: Sequence[int], **kwargs: Any) -> RequestStream:
        """Queue a request (keywords as Scheduler.submit); returns its token stream."""
        if self._closing:
            raise RuntimeError("the scheduler is closed")
        stream = self.prefill.submit(prompt_ids, **kwargs)
        self.decode._ensure_task()  # reads the decode side's capacity meanwhile
        self._streams.add(stream)
        stream._done.add_done_callback(lambda _: self._streams.discard(stream))
        return stream

    async def generate(self, prompt_ids: Sequence[int], **kwargs: Any) -> Completion:
        return await self.submit(prompt_ids, **kwargs).completion()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.prefill.eos_token_ids

    @property
    def num_moving(self) -> int:
        return len(self._moves)

    async def drain(self) -> None:
        """Wait until every submitted request has finished."""
        while self._streams:
            await asyncio.gather(*(s.result() for s in list(self._streams)))

    async def close(self) -> None:
        """Cancel everything queued, running or moving; release every cache on both sides."""
        self._closing = True
        await self.prefill.close()
        for task in list(self._moves):
            task.cancel()
        await asyncio.gather(*self._moves, return_exceptions=True)
        await self.decode.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- moves ----------------------------------------------------------------------------
    def _handoff(self, s: _Seq) -> bool:
        """The prefill scheduler drew a first token: move the sequence (not once closing)."""
        if self._closing:
            return False
        assert s.replica is not None and s.cache_id is not None
        task = asyncio.get_running_loop().create_task(self._move(s, s.replica, s.cache_id, s.blocks),
                                                      name=f"move-{s.id}")
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)
        return True

    async def _move(self, s: _Seq, src: int, cid: str, blocks: int) -> None:
        source = self.prefill.router.replicas[src]
        placed: tuple[int, KvCacheHandle, int] | None = None
        landed: list[tuple[int, KvCacheHandle]] = []  # where a move cancelled after its commit left the cache
        error: BaseException | None = None
        try:
            async with self._gate:
                if not s.cancelled:
                    await self.decode.start()
                    placed = await self._place(s, source, cid, landed)
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - fails this request alone (cancel: close())
            error = e
        adopt = placed is not None and not self._closing and not s.cancelled
        try:
            if placed is None and landed:  # cancelled once the source was released: drop the copy
                await quietly(self.decode.router.replicas[landed[0][0]].release_cache(landed[0][1].cache_id))
            elif placed is None:
                await quietly(source.release_cache(cid))
            elif not adopt:  # closed or cancelled while it moved
                await quietly(self.decode.router.replicas[placed[0]].release_cache(placed[1].cache_id))
        finally:  # even if cancelled meanwhile: the request ends or goes on, never hangs
            # The prefill side's blocks are free again (move_cache released them on success).
            self.prefill.router.forget(cid)
            self.prefill.replicas[src].free_blocks += blocks
            if self.prefill._wake is not None:
                self.prefill._wake.set()
            if adopt:
                assert placed is not None
                self.decode.adopt(s, *placed)
            elif isinstance(error, Exception) and not s.cancelled:
                self.stats.failed_moves += 1
                self.decode._finish(s, "error", error)
            else:
                self.decode._finish(s, "cancelled")

    def _targets(self) -> list[int]:
        """Decode replicas not being drained, least loaded first: live sequences (and moves
        there), then free blocks."""
        live, reps = self.decode.router.live_caches(), self.decode.replicas
        order = [r for r in range(len(reps)) if r not in self.decode.router.draining]
        return sorted(order, key=lambda r: (live[r] + self._incoming[r], -reps[r].free_blocks, r))

    async def _place(self, s: _Seq, source: AsyncExecutorClient, cid: str,
                     landed: list[tuple[int, KvCacheHandle]]) -> tuple[int, KvCacheHandle, int] | None:
        """Move the cache to a decode replica: (replica, cache there, blocks reserved), or
        None when the request was cancelled meanwhile. `landed` gets (replica, cache there)
        once a move commits, even if a cancellation then cuts it short."""
        started, delay, transient = time.monotonic(), 0.0, 0
        while not s.cancelled:
            tried = False
            for r in self._targets():
                rep, target = self.decode.replicas[r], self.decode.router.replicas[r]
                need = rep.blocks_for(s.computed)
                if s.cancelled:
                    return None
                if need > rep.total_blocks:
                    continue
                tried = True
                rep.free_blocks -= need  # reserved: the decode scheduler plans around it
                self._incoming[r] += 1
                try:
                    moved = await move_cache(source, target, cid,
                                             on_released=lambda m, r=r: landed.append((r, m.kv_cache)))
                except BaseException as e:
                    # move_cache has dropped any copy it made (not one under this id it did
                    # not make: an ALREADY_EXISTS names another's cache).
                    rep.free_blocks += need
                    refused = isinstance(e, ResourceExhaustedError)
                    if refused and "blocks_free" in e.metadata:
                        self.stats.move_refusals += 1
                        rep.free_blocks = _int(e.metadata.get("blocks_free"), rep.free_blocks)
                        continue
                    retry = isinstance(e, ExecutorError) and Scheduler._transient(e)
                    if retry and transient < self.config.retry_attempts:
                        transient += 1
                        self.stats.move_retries += 1
                        continue
                    raise
                finally:
                    self._incoming[r] -= 1
                self.stats.moves += 1
                self.stats.bytes_moved += moved.bytes_moved
                self.stats.move_seconds += moved.seconds
                return r, moved.kv_cache, need
            waited = time.monotonic() - started
            if not tried or waited > self.config.max_stall_s:
                need = min(rep.blocks_for(s.computed) for rep in self.decode.replicas)
                why = ("more than any decode pool (not being drained) holds" if not tried
                       else f"not free within {self.config.max_stall_s:g}s")
                raise ResourceExhaustedError(
                    f"request {s.id}: its {s.computed}-token cache needs {need} KV blocks, {why}",
                    reason="KV_CACHE_EXHAUSTED",
                    metadata={"blocks_needed": str(need),
                              "blocks_free": str(max(rep.free_blocks for rep in self.decode.replicas))})
            delay = min(max(2 * delay, 0.01), 0.5)
            await asyncio.sleep(delay)
            for rep in self.decode.replicas:
                rep.stale = True  # the decode scheduler refreshes its counts (and so ours)
        return None
