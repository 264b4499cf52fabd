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
the scheduler takes `blocks_free` from the error and plans again. One refused because its
answer would pass the server's message limit (RESPONSE_TOO_LARGE) fails the requests
asking for full logits or top-k rows; the others go on.

A request ends on an end-of-sequence id (GetInfo metadata "eos_token_ids", or given),
at max_tokens or at the model's max_sequence_length; its cache is released then, and
also when it fails, is cancelled, or the scheduler closes. Transient failures
(UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED) are retried with the same step, which the
executor replays rather than applies twice.

Several executors: pass an `AsyncExecutorRouter`; each sequence is placed on the replica
with the most room and its cache stays there.

Prefill on some executors and decode on others: client/disaggregated.py (two of these
schedulers, joined by the `_handoff` hook and a cache move).

This module holds the Scheduler: its API and the loop that plans, runs and releases. The
parts: client/scheduler_types.py (SchedulerConfig, Completion, SchedulerStats),
client/sequence.py (a request's state and its RequestStream), client/scheduler_endings.py
(finishing, reaping and releasing sequences), client/step_planner.py
(admission, preemption, the plan of a step), client/step_runner.py (a step's call, its
retries, results and failures) and client/batch_runner.py (run_batch).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
import uuid
from collections.abc import Sequence
from typing import Any, Self

from .aio import AsyncExecutorClient
from .batch_runner import run_batch
from .convert import metadata_from_proto
from .errors import ExecutorError, ResourceExhaustedError
from .router import AsyncExecutorRouter
from .scheduler_endings import SequenceEndings
from .scheduler_types import Completion, SchedulerConfig, SchedulerStats, _Replica
from .sequence import RequestStream, _Seq
from .step_planner import plan_step
from .step_runner import is_transient, run_step
from .types import LogitsPolicy, Penalties

__all__ = ["Completion", "RequestStream", "Scheduler", "SchedulerConfig", "SchedulerStats", "run_batch"]


class Scheduler(SequenceEndings):
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
        self._prefix = f"sched-{uuid.uuid4().hex[:12]}-"  # of its cache ids; random: several may share an executor
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
               request_id: str | None = None, penalties: Penalties | None = None,
               min_tokens: int = 0) -> RequestStream:
        """Queue a request; returns its token stream. policy: ARGMAX by default. penalties:
        repetition over the prompt and the generated tokens, presence and frequency over the
        generated ones, sent with every sampling step (argmax and sample policies).
        min_tokens: the stop ids are banned until this many tokens came (at most max_tokens)."""
        if self._closing:
            raise RuntimeError("the scheduler is closed")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {max_tokens}], got {min_tokens}")
        serial = next(self._ids)
        rid = request_id or f"req-{serial}"
        stream = RequestStream(self, rid)
        stop = frozenset() if ignore_eos else (frozenset(int(t) for t in stop_token_ids)
                                               if stop_token_ids is not None else None)
        policy = policy or LogitsPolicy.argmax()
        if (penalties or min_tokens) and policy.kind not in ("argmax", "sample"):
            raise ValueError(f"penalties and min_tokens apply to argmax and sample policies, not {policy.kind!r}")
        seq = _Seq(rid, serial, prompt, max_tokens, policy, stop, stream, penalties, min_tokens)
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
        plan, victims = plan_step(self)
        if victims:
            await self._release(victims)
        if not any(plan.values()):
            await self._stall()
            return
        self._stall_delay = 0.0
        refused = self.stats.refused_steps
        await asyncio.gather(*(run_step(self, r, items) for r, items in plan.items() if items))
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

    # -- steps: planned by client/step_planner.py, run by client/step_runner.py ------------
    _transient = staticmethod(is_transient)  # also decides the retries of client/disaggregated.py's moves

    def _handoff(self, s: _Seq) -> bool:
        """Hook after a token: True takes the sequence, cache and all, out of this scheduler
        (client/disaggregated.py moves it to a decode executor); the stream goes on."""
        return False
