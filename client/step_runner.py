"""One step on one replica for the scheduler (client/scheduler.py): the UnifiedDecode call
with its retries, each item's result applied to its sequence (blocks, tokens, the token
drawn, the end of the request), and a failed step sorted out per request.

Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED) are retried with the same step,
which the executor replays rather than applies twice. A unified batch is all or nothing, so
a failed step changed no cache: a refusal (RESOURCE_EXHAUSTED) requeues the new requests and
corrects the free-block count, an error naming one item fails or recomputes that request.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np

from .errors import ExecutorError, NotFoundError
from .sequence import _Seq
from .step_planner import unadmit
from .types import UnifiedBatchItem, UnifiedItemResult

if TYPE_CHECKING:
    from .scheduler import Scheduler

_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})
_ITEM_FIELD = re.compile(r"^batch\.items\[(\d+)\]")


def _int(text: str | None, default: int) -> int:
    return int(text) if text is not None and text.isdigit() else default


async def run_step(sched: Scheduler, r: int, items: list[tuple[_Seq, int]]) -> None:
    batch = []
    for s, n in items:
        final = s.computed + n == len(s.tokens)
        batch.append(UnifiedBatchItem(s.cache_id, s.tokens[s.computed:s.computed + n], s.computed, final,
                                      logits_policy=s.step_policy(sched.eos_token_ids) if final else None))
    delay = sched.config.retry_backoff_s
    for attempt in itertools.count():
        try:
            # Compact handles: the scheduler reads a handle's length and held_blocks only, and block
            # ids that grow with every context would cost more to send than the step's tokens.
            results = await sched.router.unified_decode(batch, compact_handles=True)
            break
        except ExecutorError as e:
            if is_transient(e) and attempt < sched.config.retry_attempts:
                sched.stats.retries += 1
                await asyncio.sleep(delay)
                delay *= 2
                continue
            await step_failed(sched, r, items, e)
            return
    sched.stats.steps += 1
    sched.stats.max_items_per_step = max(sched.stats.max_items_per_step, len(items))
    for (s, n), res in zip(items, results):
        apply_result(sched, s, n, res)


def is_transient(e: ExecutorError) -> bool:
    if e.code in _TRANSIENT:
        return True
    # RESOURCE_EXHAUSTED without KV counts: too many RPCs in flight, not a full pool.
    return e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "blocks_free" not in e.metadata


def apply_result(sched: Scheduler, s: _Seq, n: int, res: UnifiedItemResult) -> None:
    moved = sched.router.replica_of(s.cache_id)
    if moved is not None and moved != s.replica:  # the router moved its cache (a drain): follow it
        sched.replicas[s.replica].free_blocks += s.blocks
        sched.replicas[moved].free_blocks -= s.blocks
        s.replica = moved
    rep = sched.replicas[s.replica]
    blocks = res.kv_cache.held_blocks or rep.blocks_for(s.computed + n)
    rep.free_blocks -= blocks - s.blocks
    s.blocks = blocks
    s.computed += n
    if s.computed < len(s.tokens):
        sched.stats.prefill_tokens += n
        return
    if n == 1 and s.computed > len(s.prompt):
        sched.stats.decode_tokens += 1
    else:
        sched.stats.prefill_tokens += n
    out = res.logits
    if out is None:  # a final item always carries logits; guard against a broken server
        sched._finish(s, "error", ExecutorError("a final item came back without logits"))
        return
    token = out.next_token()
    stop = sched.eos_token_ids if s.stop_ids is None else s.stop_ids
    c = s.completion
    if token in stop:
        sched._finish(s, "stop")
        return
    s.tokens.append(token)
    c.token_ids.append(token)
    c.logprobs.append(out.logprob)
    if out.logits is not None:
        c.logits.append(np.array(out.logits))
    if out.top_token_ids is not None and out.kind != "top_k":  # the policy's top_logprobs
        c.top_logprobs.append(dict(zip(out.top_token_ids.tolist(), out.top_logprobs.tolist())))
    c.token_times.append(time.monotonic())
    if c.first_token_at is None:
        c.first_token_at = c.token_times[-1]
    sched.stats.generated_tokens += 1
    s.stream._push(token)
    if len(c.token_ids) >= s.max_tokens or len(s.tokens) > rep.max_seq_len:
        sched._finish(s, "length")
    elif sched._handoff(s):
        sched._running.remove(s)


async def step_failed(sched: Scheduler, r: int, items: list[tuple[_Seq, int]], e: ExecutorError) -> None:
    """The step changed no cache (a unified batch is all or nothing): decide per request."""
    new = [s for s, _ in items if s.computed == 0]
    if e.reason == "RESPONSE_TOO_LARGE":
        # The step's answer would pass the server's message limit: the rows that are large
        # (full logits, top-k) cannot be had there; the others go on in the next step.
        large = [s for s, _ in items if s.policy.kind in ("full", "top_k")] or [s for s, _ in items]
        unadmit(sched, [s for s in new if s not in large])
        for s in large:
            sched._finish(s, "error", e)
        return
    if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        sched.stats.refused_steps += 1
        rep = sched.replicas[r]
        planned = sum(rep.blocks_for(s.computed + n) - s.blocks for s, n in items)
        free = _int(e.metadata.get("blocks_free"), 0)
        needed = _int(e.metadata.get("blocks_needed"), planned)
        # The error's count is the pool's state now; if the executor needed more than we
        # planned (our view is off), take the difference off too, so the next plan shrinks.
        rep.free_blocks = max(0, free - max(0, needed - planned))
        unadmit(sched, new)  # back to the queue; the next plan preempts if it must
        return
    m = _ITEM_FIELD.match(e.metadata.get("field", ""))
    culprit = items[int(m.group(1))][0] if m and int(m.group(1)) < len(items) else None
    if culprit is None and e.metadata.get("cache_id"):
        # A cache found gone (CACHE_RELEASED: its lease ran out) is named, not located by field.
        culprit = next((s for s, _ in items if s.cache_id == e.metadata["cache_id"]), None)
    if culprit is not None and isinstance(e, NotFoundError) and culprit.computed > 0:
        # Its cache is gone (lease ran out, replica restarted): recompute it.
        sched.router.forget(culprit.cache_id)
        culprit.blocks = 0
        sched._running.remove(culprit)
        unadmit(sched, [s for s in new if s is not culprit])
        culprit.completion.preemptions += 1
        sched._waiting.appendleft(culprit)
        return
    if culprit is not None:
        unadmit(sched, [s for s in new if s is not culprit])
        sched._finish(culprit, "error", e)
        return
    for s, _ in items:
        sched._finish(s, "error", e)
