"""The Scheduler's endings of sequences (client/scheduler.py): a request finished (its stream
told how), cancelled ones reaped between steps, caches released (concurrently; one already
gone is fine) and, at close, every sequence's. Scheduler inherits them; they use its queues,
replicas, router and stats.
"""

from __future__ import annotations

import asyncio
import collections
import time

from .errors import ExecutorError
from .sequence import _Seq


class SequenceEndings:
    """Finishing, reaping and releasing a Scheduler's sequences."""

    def _finish(self, s: _Seq, reason: str, error: BaseException | None = None) -> None:
        if s.done:
            return
        s.done = True
        c = s.completion
        c.finish_reason = reason
        c.error = error if isinstance(error, ExecutorError) else (
            ExecutorError(str(error)) if error is not None else None)
        c.finished_at = time.monotonic()
        self.stats.finished += 1
        s.stream._finish(c)

    async def _reap(self) -> None:
        """Between steps: finish cancelled requests; free caches of any that ended."""
        if any(s.cancelled for s in self._waiting):
            for s in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(s)
                if s.cache_id is not None and s.blocks:
                    await self._release([s])
                self._finish(s, "cancelled")
        ended = [s for s in self._running if s.cancelled or s.done]
        if ended:
            for s in ended:
                self._finish(s, "cancelled")
            await self._release(ended)
            self._running = [s for s in self._running if not s.done]

    async def _release(self, seqs: list[_Seq]) -> None:
        """ReleaseCache for each (concurrently); a cache already gone is fine."""
        async def one(s: _Seq) -> None:
            cid, s.cache_id = s.cache_id, None
            if cid is None:
                return
            rep = self.replicas[s.replica] if s.replica is not None else None
            held, s.blocks = s.blocks, 0
            try:
                result = await self.router.release_cache(cid)
                if rep is not None:
                    rep.free_blocks += result.freed_blocks
            except ExecutorError:
                self.router.forget(cid)
                if rep is not None:
                    rep.free_blocks += held
                    rep.stale = True

        await asyncio.gather(*(one(s) for s in seqs))

    async def _release_all(self) -> None:
        seqs = list(self._running) + [s for s in self._waiting if s.cache_id is not None]
        for s in list(self._running) + list(self._waiting):
            self._finish(s, "cancelled")
        self._running, self._waiting = [], collections.deque()
        if seqs:
            await asyncio.shield(asyncio.wait_for(self._release(seqs), 10))
