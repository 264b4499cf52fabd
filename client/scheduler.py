"""A continuous-batching reference scheduler driving executors over gRPC (asyncio, typed client only).

    async with Scheduler(AsyncExecutorClient("localhost:50051")) as sched:
        async for token in sched.submit(prompt_ids, max_tokens=32):
            ...

Every step is one UnifiedDecode per executor that mixes decode steps (one token each)
with prefill chunks: a prompt longer than the step's token budget is cut into chunks,
each continuing the cache at `pos_offset`, only the last marked `is_final_chunk`. Logits
come back as ARGMAX, SAMPLE (sampled on the server) or TOP_K; full rows only for a
request whose policy asks for them.

Capacity comes from the executors: GetCapabilities (kv_block_size, kv_total_blocks,
max_sequence_length, limits.max_batch_size, limits.max_tokens_per_request) and GetStatus
(free blocks, refreshed every `status_refresh_s` and whenever a step is refused). Between
refreshes the scheduler keeps count itself from the block tables the steps return. A
step is planned so that it fits: decodes first, then continuing prefill chunks, then new
requests in arrival order, admitted only while a replica has a batch slot, token budget
and free blocks for the whole prompt. When running sequences outgrow the pool the newest
is preempted: its cache is released and it is requeued at the front, to be recomputed
(prompt plus the tokens it already produced) when blocks are free again. A step refused
with RESOURCE_EXHAUSTED (KV_CACHE_EXHAUSTED: another client took blocks) changes no cache;
the scheduler takes `blocks_free` from the error and plans again.

A request ends on an end-of-sequence id (GetInfo metadata "eos_token_ids", or given),
at max_tokens or at the model's max_sequence_length; its cache is released then, and
also when it fails, is cancelled, or the scheduler closes. Transient failures
(UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED) are retried with the same step, which the
executor replays rather than applies twice.

Several executors: pass an `AsyncExecutorRouter`; each sequence is placed on the replica
with the most room and its cache stays there.

Prefill on some executors and decode on others: client/disaggregated.py (two of these
schedulers, joined by the `_handoff` hook and a cache move).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import re
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import grpc
import numpy as np

from .aio import AsyncExecutorClient
from .convert import metadata_from_proto
from .errors import ExecutorError, NotFoundError, OutOfRangeError, ResourceExhaustedError
from .router import AsyncExecutorRouter
from .types import LogitsPolicy, UnifiedBatchItem, UnifiedItemResult

__all__ = ["Completion", "RequestStream", "Scheduler", "SchedulerConfig", "SchedulerStats", "run_batch"]

_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})
_ITEM_FIELD = re.compile(r"^batch\.items\[(\d+)\]")
_END = object()


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-replica step budget and behaviour; the executor's own limits cap the budgets."""

    max_num_seqs: int = 32  # sequences in one step (capped by limits.max_batch_size)
    max_num_batched_tokens: int = 512  # tokens in one step (capped by limits.max_tokens_per_request)
    max_prefill_chunk: int | None = None  # longest prefill chunk; None: the step's token budget
    kv_watermark_blocks: int = 0  # blocks kept free when admitting new requests
    status_refresh_s: float = 1.0  # GetStatus at most this often (and after a refused step)
    eos_token_ids: tuple[int, ...] | None = None  # None: GetInfo metadata "eos_token_ids"
    retry_attempts: int = 3  # retries of a step that failed transiently
    retry_backoff_s: float = 0.05  # first retry delay; doubles each time
    max_stall_s: float = 30.0  # a request that cannot get KV blocks for this long fails

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be >= 1")


@dataclass(slots=True)
class Completion:
    """A finished request. finish_reason: "stop" (an end-of-sequence id, not included in
    token_ids), "length" (max_tokens or the model's limit), "cancelled" or "error"."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # only for a full-logits policy
    finish_reason: str | None = None
    error: ExecutorError | None = None
    preemptions: int = 0
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    token_times: list[float] = field(default_factory=list)  # time.monotonic() as each token came

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def itl_s(self) -> float | None:
        """Inter-token latency: the mean gap between successive tokens (None below two)."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0  # UnifiedDecode calls
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    refused_steps: int = 0  # RESOURCE_EXHAUSTED answers
    retries: int = 0
    max_items_per_step: int = 0
    finished: int = 0


@dataclass(slots=True)
class _Replica:
    index: int
    block_size: int
    total_blocks: int
    max_seq_len: int
    max_items: int
    max_tokens: int
    free_blocks: int
    stale: bool = False

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


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
        "order",
        "policy",
        "prompt",
        "replica",
        "stall_since",
        "stop_ids",
        "stream",
        "tokens",
    )

    def __init__(self, rid: str, prompt: list[int], max_tokens: int, policy: LogitsPolicy,
                 stop_ids: frozenset[int] | None, stream: RequestStream) -> None:
        self.id = rid
        self.prompt = prompt
        self.tokens = list(prompt)
        self.max_tokens = max_tokens
        self.policy = policy
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


def _int(text: str | None, default: int) -> int:
    return int(text) if text is not None and text.isdigit() else default


class Scheduler:
    """Continuous batching over one executor (an AsyncExecutorClient) or several (an AsyncExecutorRouter)."""

    def __init__(self, executor: AsyncExecutorClient | AsyncExecutorRouter,
                 config: SchedulerConfig | None = None, **overrides: Any) -> None:
        base = config or SchedulerConfig()
        self.config = SchedulerConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **overrides})
        self.router = executor if isinstance(executor, AsyncExecutorRouter) else AsyncExecutorRouter([executor])
        self.stats = SchedulerStats()
        self.eos_token_ids: frozenset[int] = frozenset()
        self.replicas: list[_Replica] = []
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []  # in admission order
        self._order = itertools.count()
        self._ids = itertools.count(1)
        self._prefix = f"sched-{uuid.uuid4().hex[:6]}-"
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._started: asyncio.Future | None = None
        self._closing = False
        self._refreshed_at = float("-inf")
        self._stall_delay = 0.0
        self._refusal_delay = 0.0

    # -- public API -----------------------------------------------------------------------
    async def start(self) -> None:
        """Read capacity from the executors (done on first submit otherwise); raises their errors."""
        self._ensure_task()
        assert self._started is not None
        await asyncio.shield(self._started)

    def submit(self, prompt_ids: Sequence[int], *, max_tokens: int = 64, policy: LogitsPolicy | None = None,
               stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
               request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its token stream. policy: ARGMAX by default."""
        if self._closing:
            raise RuntimeError("the scheduler is closed")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, rid)
        stop = frozenset() if ignore_eos else (frozenset(int(t) for t in stop_token_ids)
                                               if stop_token_ids is not None else None)
        seq = _Seq(rid, prompt, max_tokens, policy or LogitsPolicy.argmax(), stop, stream)
        stream._seq = seq
        self._waiting.append(seq)
        self._ensure_task()
        assert self._wake is not None
        self._wake.set()
        return stream

    async def generate(self, prompt_ids: Sequence[int], **kwargs: Any) -> Completion:
        """Submit and wait for the completion."""
        return await self.submit(prompt_ids, **kwargs).completion()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def drain(self) -> None:
        """Wait until every submitted request has finished."""
        while self._waiting or self._running:
            seqs = list(self._waiting) + list(self._running)
            await asyncio.gather(*(s.stream.result() for s in seqs))

    async def close(self) -> None:
        """Cancel what is still queued or running, release every cache, stop the loop."""
        self._closing = True
        for s in list(self._waiting) + list(self._running):
            s.cancelled = True
        if self._task is not None:
            if self._wake is not None:
                self._wake.set()
            try:
                await self._task
            except (asyncio.CancelledError, ExecutorError):
                pass

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the loop -------------------------------------------------------------------------
    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            if self._started is None or (self._started.done() and (
                    self._started.cancelled() or self._started.exception() is not None)):
                self._started = loop.create_future()
            self._task = loop.create_task(self._loop(), name="scheduler")

    def _cancel(self, seq: _Seq) -> None:
        seq.cancelled = True
        if self._wake is not None:
            self._wake.set()

    async def _setup(self) -> None:
        caps, statuses, info = await asyncio.gather(
            self.router.all_capabilities(), self.router.all_statuses(), self.router.info())
        self.replicas = []
        for i, (c, s) in enumerate(zip(caps, statuses)):
            max_seq = c.max_sequence_length or 1 << 31
            if c.HasField("kv_capacity"):
                max_seq = min(max_seq, c.kv_capacity)
            self.replicas.append(_Replica(
                index=i, block_size=c.kv_block_size or s.kv_pool.block_size or 16,
                total_blocks=c.kv_total_blocks or s.kv_pool.total_blocks, max_seq_len=max_seq,
                max_items=min(self.config.max_num_seqs, c.limits.max_batch_size or c.max_batch_size or 1 << 31),
                max_tokens=min(self.config.max_num_batched_tokens, c.limits.max_tokens_per_request or 1 << 31),
                free_blocks=s.kv_pool.free_blocks))
        if self.config.eos_token_ids is not None:
            self.eos_token_ids = frozenset(self.config.eos_token_ids)
        else:
            eos = metadata_from_proto(info.metadata).get("eos_token_ids") or []
            self.eos_token_ids = frozenset(int(t) for t in (eos if isinstance(eos, list) else [eos]))
        self._refreshed_at = time.monotonic()

    async def _loop(self) -> None:
        assert self._started is not None and self._wake is not None
        try:
            await self._setup()
        except BaseException as e:
            if not self._started.done():
                self._started.set_exception(e)
                self._started.exception()  # retrieved: a later start() re-raises it from a fresh future
            for s in list(self._waiting):
                self._finish(s, "error", e if isinstance(e, ExecutorError) else None)
            self._waiting.clear()
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        self._started.set_result(None)
        try:
            while True:
                await self._reap()
                if not self._waiting and not self._running:
                    if self._closing:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._iteration()
        finally:
            await self._release_all()

    async def _iteration(self) -> None:
        if any(r.stale for r in self.replicas) or (
                time.monotonic() - self._refreshed_at >= self.config.status_refresh_s and self._waiting):
            await self._refresh()
        plan, victims = self._plan()
        if victims:
            await self._release(victims)
        if not any(plan.values()):
            await self._stall()
            return
        self._stall_delay = 0.0
        refused = self.stats.refused_steps
        await asyncio.gather(*(self._step(r, items) for r, items in plan.items() if items))
        await self._release([s for s in self._running if s.done])
        self._running = [s for s in self._running if not s.done]
        if self.stats.refused_steps > refused:
            # Another client took blocks: back off (growing while refusals go on) and plan again.
            self._refusal_delay = min(max(2 * self._refusal_delay, 0.005), 0.5)
            await asyncio.sleep(self._refusal_delay)
        else:
            self._refusal_delay = 0.0

    async def _refresh(self) -> None:
        statuses = await self.router.refresh()
        for rep, st in zip(self.replicas, statuses):
            if st is not None:
                rep.free_blocks = st.kv_pool.free_blocks
                rep.stale = False
        self._refreshed_at = time.monotonic()

    async def _stall(self) -> None:
        """Nothing fits anywhere: other clients hold the blocks. Wait, look again, and in the
        end fail the request at the head of the queue rather than wait forever."""
        now = time.monotonic()
        head = self._waiting[0] if self._waiting else None
        if head is not None:
            head.stall_since = head.stall_since or now
            if now - head.stall_since > self.config.max_stall_s:
                self._waiting.popleft()
                need = max(r.blocks_for(len(head.tokens) + 1) for r in self.replicas)
                self._finish(head, "error", ResourceExhaustedError(
                    f"request {head.id}: no replica freed {need} KV blocks within {self.config.max_stall_s:g}s",
                    reason="KV_CACHE_EXHAUSTED",
                    metadata={"blocks_needed": str(need),
                              "blocks_free": str(max(r.free_blocks for r in self.replicas))}))
                return
        self._stall_delay = min(max(2 * self._stall_delay, 0.01), 0.5)
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), self._stall_delay)
        except TimeoutError:
            pass
        for rep in self.replicas:
            rep.stale = True

    # -- planning -------------------------------------------------------------------------
    def _plan(self) -> tuple[dict[int, list[tuple[_Seq, int]]], list[_Seq]]:
        """This step's items per replica, and the sequences preempted to make room."""
        cfg = self.config
        plan: dict[int, list[tuple[_Seq, int]]] = {r.index: [] for r in self.replicas}
        tokens = {r.index: r.max_tokens for r in self.replicas}
        free = {r.index: r.free_blocks for r in self.replicas}
        chunk = cfg.max_prefill_chunk or 1 << 31
        scheduled: set[int] = set()
        victims: list[_Seq] = []

        # Running sequences: decodes first, then prefill chunks, oldest first within each.
        order = [s for s in self._running if s.remaining == 1] + [s for s in self._running if s.remaining > 1]
        for s in order:
            if s.done or s in victims:
                continue
            r, rep = s.replica, self.replicas[s.replica]
            if len(plan[r]) >= rep.max_items or tokens[r] == 0:
                continue
            n = min(s.remaining, tokens[r], chunk)
            if rep.blocks_for(s.computed + n) > rep.total_blocks:
                self._finish(s, "error", ResourceExhaustedError(
                    f"request {s.id}: {s.computed + n} tokens outgrow the whole KV pool of replica {r}",
                    reason="KV_CACHE_EXHAUSTED", metadata={"blocks_needed": str(rep.blocks_for(s.computed + n)),
                                                           "blocks_free": str(rep.total_blocks)}))
                continue
            need = rep.blocks_for(s.computed + n) - s.blocks
            while need > free[r]:
                victim = next((v for v in reversed(self._running) if v.replica == r and not v.done
                               and id(v) not in scheduled and v not in victims), None)
                if victim is None:
                    break
                victims.append(victim)
                free[r] += victim.blocks
                if victim is s:
                    break
            if s in victims or need > free[r]:
                continue
            free[r] -= need
            tokens[r] -= n
            plan[r].append((s, n))
            scheduled.add(id(s))
        for v in victims:
            self._preempt(v)
        # A replica that just preempted takes no new request this step (it would thrash).
        closed = {v.replica for v in victims}
        running = collections.Counter(q.replica for q in self._running if not q.done)

        # New requests, in arrival order, while one fits somewhere.
        while self._waiting:
            s = self._waiting[0]
            if s.cancelled:
                self._waiting.popleft()
                self._finish(s, "cancelled")
                continue
            if s in victims:  # its old cache is released after this plan: readmit it in the next one
                break
            if (err := self._impossible(s)) is not None:
                self._waiting.popleft()
                self._finish(s, "error", err)
                continue
            fits = [rep for rep in self.replicas
                    if rep.index not in closed and rep.index not in self.router.draining
                    and running[rep.index] < rep.max_items
                    and len(plan[rep.index]) < rep.max_items and tokens[rep.index] > 0
                    and len(s.tokens) <= rep.max_seq_len
                    and rep.blocks_for(len(s.tokens)) <= free[rep.index] - cfg.kv_watermark_blocks]
            if not fits:
                break
            rep = min(fits, key=lambda x: (running[x.index], -free[x.index], x.index))
            r = rep.index
            n = min(len(s.tokens), tokens[r], chunk)
            free[r] -= rep.blocks_for(len(s.tokens))
            tokens[r] -= n
            self._waiting.popleft()
            self._admit(s, r)
            running[r] += 1
            plan[r].append((s, n))
        return plan, victims

    def _impossible(self, s: _Seq) -> ExecutorError | None:
        """Why a request can never run on any replica, or None."""
        if all(len(s.tokens) > rep.max_seq_len for rep in self.replicas):
            limit = max(rep.max_seq_len for rep in self.replicas)
            return OutOfRangeError(f"request {s.id}: {len(s.tokens)} tokens exceed max_sequence_length {limit}",
                                   reason="PROMPT_TOO_LONG", metadata={"tokens": str(len(s.tokens))})
        if all(rep.blocks_for(len(s.tokens)) > rep.total_blocks - self.config.kv_watermark_blocks
               for rep in self.replicas):
            need = min(rep.blocks_for(len(s.tokens)) for rep in self.replicas)
            return ResourceExhaustedError(
                f"request {s.id}: its {len(s.tokens)} tokens need {need} KV blocks, more than any pool holds",
                reason="KV_CACHE_EXHAUSTED",
                metadata={"blocks_needed": str(need), "blocks_free": str(max(r.total_blocks for r in self.replicas))})
        return None

    def _admit(self, s: _Seq, replica: int) -> None:
        s.attempt += 1
        s.cache_id = f"{self._prefix}{s.id}.{s.attempt}"[:128]
        s.replica = replica
        s.computed = 0
        s.blocks = 0
        s.stall_since = None
        s.order = next(self._order)
        self.router.pin(s.cache_id, replica)
        self._running.append(s)

    def _preempt(self, s: _Seq) -> None:
        """Recompute-style: the cache goes (released by the caller of _plan), the request
        goes back to the front of the queue with everything it has produced so far."""
        self._running.remove(s)
        s.completion.preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(s)

    # -- one step on one replica ----------------------------------------------------------
    async def _step(self, r: int, items: list[tuple[_Seq, int]]) -> None:
        batch = []
        for s, n in items:
            final = s.computed + n == len(s.tokens)
            batch.append(UnifiedBatchItem(s.cache_id, s.tokens[s.computed:s.computed + n], s.computed, final,
                                          logits_policy=s.policy if final else None))
        delay = self.config.retry_backoff_s
        for attempt in itertools.count():
            try:
                results = await self.router.unified_decode(batch)
                break
            except ExecutorError as e:
                if self._transient(e) and attempt < self.config.retry_attempts:
                    self.stats.retries += 1
                    await asyncio.sleep(delay)
                    delay *= 2
                    continue
                await self._step_failed(r, items, e)
                return
        self.stats.steps += 1
        self.stats.max_items_per_step = max(self.stats.max_items_per_step, len(items))
        for (s, n), res in zip(items, results):
            self._apply(s, n, res)

    @staticmethod
    def _transient(e: ExecutorError) -> bool:
        if e.code in _TRANSIENT:
            return True
        # RESOURCE_EXHAUSTED without KV counts: too many RPCs in flight, not a full pool.
        return e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "blocks_free" not in e.metadata

    def _apply(self, s: _Seq, n: int, res: UnifiedItemResult) -> None:
        moved = self.router.replica_of(s.cache_id)
        if moved is not None and moved != s.replica:  # the router moved its cache (a drain): follow it
            self.replicas[s.replica].free_blocks += s.blocks
            self.replicas[moved].free_blocks -= s.blocks
            s.replica = moved
        rep = self.replicas[s.replica]
        blocks = len(res.kv_cache.block_ids) if res.kv_cache.block_ids else rep.blocks_for(s.computed + n)
        rep.free_blocks -= blocks - s.blocks
        s.blocks = blocks
        s.computed += n
        if s.computed < len(s.tokens):
            self.stats.prefill_tokens += n
            return
        if n == 1 and s.computed > len(s.prompt):
            self.stats.decode_tokens += 1
        else:
            self.stats.prefill_tokens += n
        out = res.logits
        if out is None:  # a final item always carries logits; guard against a broken server
            self._finish(s, "error", ExecutorError("a final item came back without logits"))
            return
        token = out.next_token()
        stop = self.eos_token_ids if s.stop_ids is None else s.stop_ids
        c = s.completion
        if token in stop:
            self._finish(s, "stop")
            return
        s.tokens.append(token)
        c.token_ids.append(token)
        c.logprobs.append(out.logprob)
        if out.logits is not None:
            c.logits.append(np.array(out.logits))
        c.token_times.append(time.monotonic())
        if c.first_token_at is None:
            c.first_token_at = c.token_times[-1]
        self.stats.generated_tokens += 1
        s.stream._push(token)
        if len(c.token_ids) >= s.max_tokens or len(s.tokens) > rep.max_seq_len:
            self._finish(s, "length")
        elif self._handoff(s):
            self._running.remove(s)

    def _handoff(self, s: _Seq) -> bool:
        """Hook after a token: True takes the sequence, cache and all, out of this scheduler
        (client/disaggregated.py moves it to a decode executor); the stream goes on."""
        return False

    async def _step_failed(self, r: int, items: list[tuple[_Seq, int]], e: ExecutorError) -> None:
        """The step changed no cache (a unified batch is all or nothing): decide per request."""
        new = [s for s, _ in items if s.computed == 0]
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.stats.refused_steps += 1
            rep = self.replicas[r]
            planned = sum(rep.blocks_for(s.computed + n) - s.blocks for s, n in items)
            free = _int(e.metadata.get("blocks_free"), 0)
            needed = _int(e.metadata.get("blocks_needed"), planned)
            # The error's count is the pool's state now; if the executor needed more than we
            # planned (our view is off), take the difference off too, so the next plan shrinks.
            rep.free_blocks = max(0, free - max(0, needed - planned))
            self._unadmit(new)  # back to the queue; the next plan preempts if it must
            return
        m = _ITEM_FIELD.match(e.metadata.get("field", ""))
        culprit = items[int(m.group(1))][0] if m and int(m.group(1)) < len(items) else None
        if culprit is not None and isinstance(e, NotFoundError) and culprit.computed > 0:
            # Its cache is gone (lease ran out, replica restarted): recompute it.
            self.router.forget(culprit.cache_id)
            culprit.blocks = 0
            self._running.remove(culprit)
            self._unadmit([s for s in new if s is not culprit])
            culprit.completion.preemptions += 1
            self._waiting.appendleft(culprit)
            return
        if culprit is not None:
            self._unadmit([s for s in new if s is not culprit])
            self._finish(culprit, "error", e)
            return
        for s, _ in items:
            self._finish(s, "error", e)

    def _unadmit(self, seqs: list[_Seq]) -> None:
        """Sequences whose first step was refused: no cache was made; requeue them in order."""
        for s in reversed(seqs):
            if s.cache_id is not None:
                self.router.forget(s.cache_id)
            s.cache_id, s.replica = None, None
            self._running.remove(s)
            self._waiting.appendleft(s)

    # -- endings --------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# A batch of prompts through a scheduler, with progress (the CLI: client/schedule_cli.py)
# ---------------------------------------------------------------------------------------


class _Progress:
    """A one-line progress bar on stderr (rewritten in place on a terminal, else a line per request)."""

    def __init__(self, total: int, stream: Any = None, width: int = 24) -> None:
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.done = 0
        self.tokens = 0
        self._last = 0.0

    def update(self, *, token: bool = False, finished: bool = False) -> None:
        self.tokens += token
        self.done += finished
        now = time.monotonic()
        if not finished and (not self.tty or now - self._last < 0.1):
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        filled = self.width * self.done // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} requests  "
                f"{self.tokens} tokens  {self.tokens / elapsed:.1f} tok/s  {elapsed:.1f}s")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


async def run_batch(scheduler: Any, prompts: list[list[int]], *, max_tokens: int,
                    policy: LogitsPolicy | Sequence[LogitsPolicy | None] | None = None,
                    progress: _Progress | None = None, ignore_eos: bool = False) -> list[Completion]:
    """Submit every prompt at once to `scheduler` (a Scheduler, or anything with its `submit`,
    as DisaggregatedScheduler); wait for all; return the completions in prompt order.

    `policy`: one for all prompts, or one per prompt (None: ARGMAX)."""
    policies = list(policy) if isinstance(policy, Sequence) else [policy] * len(prompts)
    async def consume(i: int, stream: RequestStream) -> Completion:
        try:
            async for _ in stream:
                if progress:
                    progress.update(token=True)
        except ExecutorError:
            pass  # reported in the completion
        if progress:
            progress.update(finished=True)
        return await stream.result()

    streams = [scheduler.submit(p, max_tokens=max_tokens, policy=pol, ignore_eos=ignore_eos,
                                request_id=f"req-{i}") for i, (p, pol) in enumerate(zip(prompts, policies))]
    return list(await asyncio.gather(*(consume(i, s) for i, s in enumerate(streams))))

