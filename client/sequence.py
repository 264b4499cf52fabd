"""One request inside the scheduler (client/scheduler.py): `_Seq`, its state (tokens,
cache, replica, place in the queues), and `RequestStream`, the caller's side of it (the
tokens as they come, the Completion at the end, cancel()).

The scheduler's planning and stepping modules change a `_Seq`; the stream is what submit()
hands out. Apart from the Scheduler so that both sides can use them without a cycle.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Self

from .logits_policy import with_banned
from .scheduler_types import Completion
from .types import LogitsPolicy, Penalties

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["RequestStream"]

_END = object()


class _Seq:
    """One request's state: tokens = prompt + generated; `computed` of them are in its cache."""

    __slots__ = (
        "attempt",
        "blocks",
        "cache_id",
        "cancelled",
        "completion",
        "computed",
        "done",
        "id",
        "max_tokens",
        "min_tokens",
        "order",
        "penalties",
        "policy",
        "prompt",
        "replica",
        "serial",
        "stall_since",
        "stop_ids",
        "stream",
        "tokens",
    )

    def __init__(self, rid: str, serial: int, prompt: list[int], max_tokens: int, policy: LogitsPolicy,
                 stop_ids: frozenset[int] | None, stream: RequestStream, penalties: Penalties | None = None,
                 min_tokens: int = 0) -> None:
        self.id = rid  # the caller's name for it: any string, not necessarily unique
        self.serial = serial  # unique in its scheduler: its cache ids are made from it
        self.prompt = prompt
        self.tokens = list(prompt)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens  # the stop ids are banned until this many tokens came
        self.policy = policy
        self.penalties = penalties if penalties else None
        self.stop_ids = stop_ids  # None: the scheduler's end-of-sequence ids
        self.stream = stream
        self.completion = Completion(rid, list(prompt), submitted_at=time.monotonic())
        self.computed = 0
        self.cache_id: str | None = None
        self.replica: int | None = None
        self.blocks = 0
        self.cancelled = False
        self.done = False
        self.attempt = 0
        self.order = 0
        self.stall_since: float | None = None

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.computed

    def step_policy(self, eos_ids: frozenset[int]) -> LogitsPolicy:
        """The policy of the step that samples the next token: with penalties, over the prompt
        and the tokens generated so far; short of min_tokens, the stop ids (`eos_ids`, the
        scheduler's, unless the request named its own) banned."""
        policy = self.policy
        if self.penalties is None and not self.min_tokens:  # most requests: no copy of their tokens a step
            return policy
        generated = self.tokens[len(self.prompt):]
        if self.penalties is not None:
            policy = self.penalties.apply(policy, self.prompt, generated)
        stop = eos_ids if self.stop_ids is None else self.stop_ids
        if len(generated) < self.min_tokens and stop:
            policy = with_banned(policy, stop)
        return policy


class RequestStream:
    """The tokens of one request as they come: `async for token in stream`.

    Iteration ends when the request finishes; if it failed, the error is raised then.
    `await stream.result()` gives the Completion; `cancel()` (or leaving `async with`
    early, or cancelling the task that iterates) stops the request and frees its cache.
    """

    def __init__(self, scheduler: Scheduler, request_id: str) -> None:
        self._scheduler = scheduler
        self.request_id = request_id
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._done: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._seq: _Seq | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> int:
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if item is _END:
            self._queue.put_nowait(_END)  # later iterations end too
            completion = self._done.result()
            if completion.finish_reason == "error" and completion.error is not None:
                raise completion.error
            raise StopAsyncIteration
        return item

    async def result(self) -> Completion:
        """The completion, once the request has finished (never raises its error: see .error)."""
        return await asyncio.shield(self._done)

    async def completion(self) -> Completion:
        """As result(), but cancelling the wait cancels the request (what generate() does)."""
        try:
            return await self.result()
        except asyncio.CancelledError:
            self.cancel()
            raise

    @property
    def done(self) -> bool:
        return self._done.done()

    def cancel(self) -> None:
        if self._seq is not None and not self._done.done():
            self._scheduler._cancel(self._seq)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def _push(self, token: int) -> None:
        self._queue.put_nowait(token)

    def _finish(self, completion: Completion) -> None:
        if not self._done.done():
            self._done.set_result(completion)
            self._queue.put_nowait(_END)
