"""SerialWorker: runs executor work one call at a time on its own thread.

Model work must not run on the event loop (health checks and other RPCs must answer during
a long forward), and executor state must not be touched by two calls at once. One worker
thread gives both: calls queue in arrival order and run alone.

A caller that goes away (cancelled, deadline exceeded, disconnected) does not stop a job
that has started: the job finishes, and `on_abandon` then runs on the worker with its
result, so the executor can undo what nobody will ever learn about (a new cache, say).
A job that had not started yet is simply dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from executors.timing import current_call_timer

T = TypeVar("T")


class SerialWorker:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.wait_samples = 0
        self.total_wait_ns = 0

    async def run(self, fn: Callable[..., T], *args: object,
                  on_abandon: Callable[[T], Any] | None = None) -> T:
        submitted = time.perf_counter_ns()
        started: list[int] = []

        def job() -> T:
            started.append(time.perf_counter_ns())
            return fn(*args)

        future = self._pool.submit(job)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel() and on_abandon is not None:
                future.add_done_callback(lambda f: self._abandoned(f, on_abandon))
            raise
        finally:
            if started:
                waited = started[0] - submitted
                self.wait_samples += 1
                self.total_wait_ns += waited
                timer = current_call_timer.get()
                if timer is not None:
                    timer.queue_ns += waited
                    timer.executor_ns += time.perf_counter_ns() - started[0]

    def submit(self, fn: Callable[..., Any], *args: object) -> None:
        """Queue clean-up that nobody waits for (it runs even when its caller was cancelled);
        dropped once the worker is closed, when nothing is left to clean."""
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # shut down
            pass

    def schedule(self, fn: Callable[..., T], *args: object) -> Future:
        """Queue work from a thread that is not the event loop's (a monitor); its Future."""
        return self._pool.submit(fn, *args)

    def _abandoned(self, future: Future, on_abandon: Callable[[Any], Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            # Queue the clean-up as a job of its own: this callback may run on any thread. The
            # forward may end after the worker closed (the server stopped, the interpreter is
            # exiting): then, as for submit(), there is nothing left to clean.
            self.submit(on_abandon, future.result())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
