"""DecodeCoalescer: concurrent Decode calls from many callers run as one batched forward.

The service wraps its executor in a DecodeCoalescer when `--coalesce-window-ms` is above 0.
Every method but `decode` passes straight through. Decode calls join a queue and leave it
as one `executor.batch_decode` call, each caller getting its own item's result:

- **No added latency at batch 1.** A decode that arrives while no coalesced batch is in
  flight and none finished within the last window, or while the last round's callers
  are all back already, is dispatched at once. A lone caller therefore never waits.
- **Waiting only while others decode.** Otherwise the call waits until (a) as many calls
  are queued as took part in the last round (the batch that just finished plus what was
  queued behind it: callers in lockstep come back together), (b) the window has passed
  since the oldest queued call, or (c) max_batch calls are queued. Calls queued while a
  batch is in flight are held until it finishes: the executor runs one call at a time, so
  dispatching them earlier only keeps them from merging with later arrivals.
- **Failures stay per item.** A batch is all or nothing in the executor, so when it fails
  (a stale handle, an unknown cache, a token outside the vocabulary, a pool too full for
  the whole batch...) nothing has changed, and its items are run again one by one: every
  caller gets exactly the result or the precise error a lone Decode would have got.
- A batch never holds two calls for the same cache (the later one waits for the next
  batch), nor calls of different caller identities (cache ownership is checked per call);
  it runs under its callers' identity, and each caller's CallTiming gets the batch's queue
  and executor time plus its own wait in the coalescer as queue time.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field

from executors.identity import current_identity
from executors.timing import CallTimer, current_call_timer
from executors.types import DecodeInput, DecodeOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Waiter:
    inp: DecodeInput
    identity: str | None
    future: asyncio.Future
    arrived: float  # loop time
    arrived_ns: int
    dispatched_ns: int = 0
    timer: CallTimer | None = None
    abandoned: bool = False  # the caller was cancelled


@dataclass(slots=True)
class CoalescerStats:
    calls: int = 0  # decode calls received
    batches: int = 0  # dispatches to the executor (batch_decode, or decode for a batch of one)
    batched_items: int = 0  # calls that went out in a batch of two or more
    immediate: int = 0  # calls dispatched on arrival, without waiting
    fallbacks: int = 0  # batches that failed and were re-run item by item
    max_batch: int = 0
    sizes: dict[int, int] = field(default_factory=dict)  # batch size -> dispatches


class DecodeCoalescer:
    """Wraps an executor; `decode` calls coalesce into `batch_decode` (see the module doc)."""

    def __init__(self, executor, window_s: float, max_batch: int) -> None:
        if window_s < 0:
            raise ValueError("window_s must be >= 0")
        self.inner = executor
        self.window_s = window_s
        self.max_batch = max(1, max_batch)
        self.coalescing = CoalescerStats()
        self._pending: list[_Waiter] = []
        self._in_flight = 0
        self._expected = 1  # callers expected back for the next round
        self._last_done = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    def __getattr__(self, name: str):
        # Everything but decode is the executor's own (only called for names not found here).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def decode(self, inp: DecodeInput) -> DecodeOutput:
        if self.window_s <= 0:
            return await self.inner.decode(inp)
        loop = asyncio.get_running_loop()
        w = _Waiter(inp, current_identity.get(), loop.create_future(), loop.time(), time.perf_counter_ns(),
                    timer=current_call_timer.get())
        self.coalescing.calls += 1
        self._pending.append(w)
        self._flush(loop, arriving=w)
        try:
            return await asyncio.shield(w.future)
        except asyncio.CancelledError:
            w.abandoned = True
            if w in self._pending:  # not dispatched yet: it never runs
                self._pending.remove(w)
            raise

    # -- the queue ------------------------------------------------------------------------
    def _flush(self, loop: asyncio.AbstractEventLoop, arriving: _Waiter | None = None) -> None:
        while self._pending:
            now = loop.time()
            n = len(self._pending)
            ready = n >= self.max_batch
            if not ready and self._in_flight == 0:
                idle = now - self._last_done > self.window_s
                expired = now >= self._pending[0].arrived + self.window_s
                ready = idle or expired or n >= self._expected
            if not ready:
                # While a batch runs, only its end (which flushes again) can make these ready:
                # a timer then would fire at once, past its deadline, and spin the event loop.
                if self._in_flight == 0:
                    self._arm(loop)
                return
            batch = self._take()
            if arriving is not None and batch == [arriving]:
                self.coalescing.immediate += 1
            self._dispatch(loop, batch)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        deadline = self._pending[0].arrived + self.window_s
        if self._timer is not None and self._timer.when() <= deadline:
            return
        if self._timer is not None:
            self._timer.cancel()

        def fire() -> None:
            self._timer = None
            self._flush(loop)

        self._timer = loop.call_at(deadline, fire)

    def _take(self) -> list[_Waiter]:
        """The oldest call and the queued calls that may share its batch, in arrival order."""
        first = self._pending[0]
        batch: list[_Waiter] = []
        caches: set[str] = set()
        for w in self._pending:
            if len(batch) == self.max_batch:
                break
            cache_id = w.inp.kv_cache.cache_id
            if w.identity != first.identity or cache_id in caches:
                continue
            caches.add(cache_id)
            batch.append(w)
        taken = {id(w) for w in batch}
        self._pending = [w for w in self._pending if id(w) not in taken]
        return batch

    def _dispatch(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiter]) -> None:
        s = self.coalescing
        s.batches += 1
        s.max_batch = max(s.max_batch, len(batch))
        s.sizes[len(batch)] = s.sizes.get(len(batch), 0) + 1
        if len(batch) > 1:
            s.batched_items += len(batch)
        now_ns = time.perf_counter_ns()
        for w in batch:
            w.dispatched_ns = now_ns
        # The batch runs under its callers' identity, with a timer of its own.
        ctx = contextvars.copy_context()
        timer = CallTimer()
        ctx.run(current_identity.set, batch[0].identity)
        ctx.run(current_call_timer.set, timer)
        self._in_flight += 1
        task = loop.create_task(self._run(loop, batch, timer), context=ctx)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiter], timer: CallTimer) -> None:
        outcomes: list[tuple[DecodeOutput | None, BaseException | None]]
        try:
            if len(batch) == 1:
                outcomes = [await self._one(batch[0])]
            else:
                try:
                    outs = await self.inner.batch_decode([w.inp for w in batch])
                    outcomes = [(o, None) for o in outs]
                except Exception as e:  # all or nothing: nothing changed, so run each alone
                    log.debug("coalesced batch of %d failed (%s); running its items one by one", len(batch), e)
                    self.coalescing.fallbacks += 1
                    outcomes = [await self._one(w) for w in batch]
        except asyncio.CancelledError:  # the server is stopping: every caller learns it
            outcomes = [(None, asyncio.CancelledError())] * len(batch)
            raise
        finally:
            self._in_flight -= 1
            self._last_done = loop.time()
            self._expected = min(self.max_batch, len(batch) + len(self._pending))
            for w, (out, err) in zip(batch, outcomes):
                if w.timer is not None:
                    w.timer.queue_ns += (w.dispatched_ns - w.arrived_ns) + timer.queue_ns
                    w.timer.executor_ns += timer.executor_ns
                if w.future.done() or w.abandoned:
                    continue
                if err is not None:
                    w.future.set_exception(err)
                else:
                    w.future.set_result(out)
            self._flush(loop)

    async def _one(self, w: _Waiter) -> tuple[DecodeOutput | None, BaseException | None]:
        try:
            return await self.inner.decode(w.inp), None
        except Exception as e:
            return None, e
