"""SerialWorker: runs executor work one call at a time on its own thread.

Model work must not run on the event loop (health checks and other RPCs must answer during
a long forward), and executor state must not be touched by two calls at once. One worker
thread gives both: calls queue in arrival order and run alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from executors.timing import current_call_timer

T = TypeVar("T")


class SerialWorker:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.wait_samples = 0
        self.total_wait_ns = 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        submitted = time.perf_counter_ns()
        started: list[int] = []

        def job() -> T:
            started.append(time.perf_counter_ns())
            return fn(*args)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, job)
        finally:
            if started:
                waited = started[0] - submitted
                self.wait_samples += 1
                self.total_wait_ns += waited
                timer = current_call_timer.get()
                if timer is not None:
                    timer.queue_ns += waited
                    timer.executor_ns += time.perf_counter_ns() - started[0]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
