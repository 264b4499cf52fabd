"""SerialWorker: runs executor work one call at a time on its own thread.

Model work must not run on the event loop (health checks and other RPCs must answer during
a long forward), and executor state must not be touched by two calls at once. One worker
thread gives both: calls queue in arrival order and run alone.

A caller that goes away (cancelled, deadline exceeded, disconnected) does not stop a job
that has started: the job finishes, and `on_abandon` then runs on the worker with its
result, so the executor can undo what nobody will ever learn about (a new cache, say).
A job that had not started yet is simply dropped.

A step may leave work in flight on the device when its job returns (executors/step_overlap.py):
`in_flight` is then set, and the worker settles it (waits for the device, finishes the step's
bookkeeping, answers its caller) before any job that does not say it `overlaps`, as soon as
the device is done when no job is queued, and before it stops. A job that overlaps (the next
step) runs first and settles it itself, after launching its own device work.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from executors.timing import current_call_timer

T = TypeVar("T")

# How often an idle worker with work in flight asks whether the device is done: a new job wakes
# it at once; this bounds how late a step is answered when none comes.
POLL_S = 20e-6


class InFlight(Protocol):
    def ready(self) -> bool:
        """Whether settling would not wait (the device finished the step)."""

    def settle(self) -> None:
        """Finish the step and answer its caller; never raises (failures go to the caller)."""


class SerialWorker:
    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.in_flight: InFlight | None = None
        self.wait_samples = 0
        self.total_wait_ns = 0
        self._thread = threading.Thread(target=self._serve, name=f"{name}-worker", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: object,
                  on_abandon: Callable[[T], Any] | None = None, overlaps: bool = False) -> T:
        """fn(*args) on the worker. `overlaps`: fn may run while a step is in flight (it settles
        that step itself); every other job runs after it is settled."""
        submitted = time.perf_counter_ns()
        started: list[int] = []

        def job() -> T:
            started.append(time.perf_counter_ns())
            return fn(*args)

        future = self._put(job, (), overlaps)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel() and on_abandon is not None:
                self.undo_when_done(future, on_abandon)
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
            self._put(fn, args, False)
        except RuntimeError:  # shut down
            pass

    def schedule(self, fn: Callable[..., T], *args: object) -> Future:
        """Queue work from a thread that is not the event loop's (a monitor); its Future."""
        return self._put(fn, args, False)

    def _put(self, fn: Callable[..., Any], args: tuple, overlaps: bool) -> Future:
        if self._closed:
            raise RuntimeError("cannot schedule new work after the worker was closed")
        future: Future = Future()
        self._jobs.put((future, fn, args, overlaps))
        return future

    def undo_when_done(self, future: Future, on_abandon: Callable[[Any], Any]) -> None:
        """Once future (work its caller abandoned) succeeds, queue on_abandon(its result)."""
        future.add_done_callback(lambda f: self._abandoned(f, on_abandon))

    def _abandoned(self, future: Future, on_abandon: Callable[[Any], Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            # Queue the clean-up as a job of its own: this callback may run on any thread. The
            # forward may end after the worker closed (the server stopped, the interpreter is
            # exiting): then, as for submit(), there is nothing left to clean.
            self.submit(on_abandon, future.result())

    def settle(self) -> None:
        """Settle the step in flight, if any (on the worker thread)."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            flight.settle()

    def _next(self):
        while True:
            flight = self.in_flight
            if flight is None:
                return self._jobs.get()
            try:
                return self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                if flight.ready():
                    self.settle()

    def _serve(self) -> None:
        while True:
            item = self._next()
            if item is None:  # close()
                self.settle()
                return
            self._run_job(*item)
            # Nothing of a finished job stays referenced while the thread waits for the next
            # (a stopped server's executor must be collectable).
            del item

    def _run_job(self, future: Future, fn: Callable[..., Any], args: tuple, overlaps: bool) -> None:
        if not future.set_running_or_notify_cancel():
            return  # cancelled while queued
        if not overlaps:
            self.settle()
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller, as a ThreadPoolExecutor does
            future.set_exception(e)
        else:
            future.set_result(result)

    def close(self) -> None:
        """Drop what is queued (its callers see it cancelled), finish the job under way and what
        is in flight, and stop the thread."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self._jobs.get_nowait()
                    if item is not None:
                        item[0].cancel()
            self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()
