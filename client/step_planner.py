"""What the scheduler (client/scheduler.py) runs next: the plan of one step per replica,
and the moves between its waiting queue and running list that the plan makes (admission,
preemption, and the undoing of an admission whose first step was refused).

A step is planned so that it fits the replicas' free blocks, batch slots and token budget:
decodes first, then continuing prefill chunks, then new requests in arrival order; the
newest running sequences are preempted when the running ones outgrow a pool. Functions of
the Scheduler's state rather than methods, apart from the loop that issues the steps.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from .errors import ExecutorError, OutOfRangeError, ResourceExhaustedError
from .scheduler_types import _Replica
from .sequence import _Seq

if TYPE_CHECKING:
    from .scheduler import Scheduler

Plan = dict[int, list[tuple[_Seq, int]]]  # replica index -> (sequence, tokens it runs) this step


def plan_step(sched: Scheduler) -> tuple[Plan, list[_Seq]]:
    """This step's items per replica, and the sequences preempted to make room."""
    cfg = sched.config
    plan: Plan = {r.index: [] for r in sched.replicas}
    tokens = {r.index: r.max_tokens for r in sched.replicas}
    free = {r.index: r.free_blocks for r in sched.replicas}
    chunk = cfg.max_prefill_chunk or 1 << 31
    scheduled: set[int] = set()
    victims: list[_Seq] = []

    # Running sequences: decodes first, then prefill chunks, oldest first within each.
    order = [s for s in sched._running if s.remaining == 1] + [s for s in sched._running if s.remaining > 1]
    for s in order:
        if s.done or s in victims:
            continue
        r, rep = s.replica, sched.replicas[s.replica]
        if len(plan[r]) >= rep.max_items or tokens[r] == 0:
            continue
        n = min(s.remaining, tokens[r], chunk)
        if rep.blocks_for(s.computed + n) > rep.total_blocks:
            sched._finish(s, "error", ResourceExhaustedError(
                f"request {s.id}: {s.computed + n} tokens outgrow the whole KV pool of replica {r}",
                reason="KV_CACHE_EXHAUSTED", metadata={"blocks_needed": str(rep.blocks_for(s.computed + n)),
                                                       "blocks_free": str(rep.total_blocks)}))
            continue
        need = rep.blocks_for(s.computed + n) - s.blocks
        while need > free[r]:
            victim = next((v for v in reversed(sched._running) if v.replica == r and not v.done
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
        preempt(sched, v)
    # A replica that just preempted takes no new request this step (it would thrash).
    closed = {v.replica for v in victims}
    running = collections.Counter(q.replica for q in sched._running if not q.done)

    # New requests, in arrival order, while one fits somewhere.
    while sched._waiting:
        s = sched._waiting[0]
        if s.cancelled:
            sched._waiting.popleft()
            sched._finish(s, "cancelled")
            continue
        if s in victims:  # its old cache is released after this plan: readmit it in the next one
            break
        if (err := impossible(s, sched.replicas, cfg.kv_watermark_blocks)) is not None:
            sched._waiting.popleft()
            sched._finish(s, "error", err)
            continue
        fits = [rep for rep in sched.replicas
                if rep.index not in closed and rep.index not in sched.router.draining
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
        sched._waiting.popleft()
        admit(sched, s, r)
        running[r] += 1
        plan[r].append((s, n))
    return plan, victims


def impossible(s: _Seq, replicas: list[_Replica], kv_watermark_blocks: int) -> ExecutorError | None:
    """Why a request can never run on any replica, or None."""
    if all(len(s.tokens) > rep.max_seq_len for rep in replicas):
        limit = max(rep.max_seq_len for rep in replicas)
        return OutOfRangeError(f"request {s.id}: {len(s.tokens)} tokens exceed max_sequence_length {limit}",
                               reason="PROMPT_TOO_LONG", metadata={"tokens": str(len(s.tokens))})
    if all(rep.blocks_for(len(s.tokens)) > rep.total_blocks - kv_watermark_blocks for rep in replicas):
        need = min(rep.blocks_for(len(s.tokens)) for rep in replicas)
        return ResourceExhaustedError(
            f"request {s.id}: its {len(s.tokens)} tokens need {need} KV blocks, more than any pool holds",
            reason="KV_CACHE_EXHAUSTED",
            metadata={"blocks_needed": str(need), "blocks_free": str(max(r.total_blocks for r in replicas))})
    return None


def admit(sched: Scheduler, s: _Seq, replica: int) -> None:
    s.attempt += 1
    # From the serial, not the request id: that one is the caller's, maybe shared by two
    # live requests, maybe with characters a cache id refuses.
    s.cache_id = f"{sched._prefix}{s.serial}.{s.attempt}"
    s.replica = replica
    s.computed = 0
    s.blocks = 0
    s.stall_since = None
    s.order = next(sched._order)
    sched.router.pin(s.cache_id, replica)
    sched._running.append(s)


def preempt(sched: Scheduler, s: _Seq) -> None:
    """Recompute-style: the cache goes (released by the caller of plan_step), the request
    goes back to the front of the queue with everything it has produced so far."""
    sched._running.remove(s)
    s.completion.preemptions += 1
    sched.stats.preemptions += 1
    sched._waiting.appendleft(s)


def unadmit(sched: Scheduler, seqs: list[_Seq]) -> None:
    """Sequences whose first step was refused: no cache was made; requeue them in order."""
    for s in reversed(seqs):
        if s.cache_id is not None:
            sched.router.forget(s.cache_id)
        s.cache_id, s.replica = None, None
        sched._running.remove(s)
        sched._waiting.appendleft(s)
