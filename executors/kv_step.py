"""One step of a KvCacheExecutor, on its worker: validated ItemSpecs in, StepResults out.

Each spec is resolved to its cache (continued, created, or a retry of the cache's last
step, which is replayed from its record instead of run twice); then every cache grows at
once, the model runs all of them as one forward, and one pass of the logits policies
covers every row. It is all or nothing: whatever fails, every cache goes back to its
length and blocks before the call and the caches it created go. Only then is the step
committed: filled blocks named for prefix reuse, sliding windows moved on, the step
recorded for a replay, the stats counted.

This is the per-step hot path: plain functions over the executor's state, no layers.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from executors.descriptions import ExecutorState
from executors.errors import FailedPrecondition, OutOfRange
from executors.kv_status import used_bytes
from executors.logits import apply_policies
from executors.lora_calls import named_adapter
from executors.step_items import ItemSpec, Rows, StepItem, StepLogits, StepResult
from executors.types import LogitsKind, LogitsPolicy, LogitsResult

if TYPE_CHECKING:
    from executors.kv_executor import KvCacheExecutor
    from kvcache.copy_on_write import Swap


def replay_key(s: ItemSpec) -> tuple:
    """What else a retry must repeat to be replayed: the rows it wants and, when it wants
    any, their policy (an item that returns no logits ignores its policy, even a NaN one,
    which would never equal itself), and whether its token was fed."""
    return (s.rows, None if s.rows is Rows.NONE else s.policy, s.feed)


def run_step(ex: KvCacheExecutor, specs: list[ItemSpec], identity: str | None) -> list[StepResult]:
    """Run the specs as one forward; a spec that repeats its cache's last step is replayed."""
    started = time.perf_counter_ns()
    specs = [feed(ex, s, identity) if s.feed else s for s in specs]
    ex.stats.begin(len(specs))
    created: dict[str, int] = {}  # cache id -> creation serial
    # Server-chosen ids never equal an id a caller names anywhere in this call.
    named = frozenset(s.cache_id for s in specs if s.cache_id is not None)
    resolved: list[StepItem | StepResult] = []
    swapped: list[Swap] = []  # copy-on-write swaps, undone if the step fails
    try:
        for s in specs:
            resolved.append(resolve(ex, s, created, identity, named))
        work = [(s, it) for s, it in zip(specs, resolved) if isinstance(it, StepItem)]
        copies = ex.kv.extend_many([(it.cache_id, it.start + len(it.tokens)) for _, it in work], swapped)
        ex.pool.copy_blocks(copies)  # copy-on-write: before anything writes into them
        outputs = step_outputs(work, ex._forward_step([it for _, it in work]), ex.policy_kernels) if work else []
        fresh = [finish(ex, it, out, created.get(it.cache_id)) for (_, it), out in zip(work, outputs)]
    except BaseException:
        # Undo everything: caches this call created go, the others return to their
        # length before it (dropping any prefix blocks they were given) and to the shared
        # blocks a copy-on-write replaced (the copy may never have been made).
        ex.kv.unswap(swapped)
        for s, it in zip(specs, resolved):
            if isinstance(it, StepItem) and it.cache_id not in created and it.table.num_tokens > s.expected_length:
                ex.kv.truncate(it.cache_id, s.expected_length)
        for cid in created:
            ex.kv.release(cid)
            ex.caches.remove(cid)
        ex.stats.state = ExecutorState.READY
        ex.stats.current_batch_size = 0
        raise
    for i, ((s, it), res) in enumerate(zip(work, fresh)):
        ex.kv.commit(it.cache_id, it.start, it.tokens)  # name the blocks filled, for reuse
        if ex.kv.slide(it.cache_id):  # every layer sliding: blocks the windows left go back to the pool
            res = fresh[i] = dataclasses.replace(res, kv_cache=ex._handle(it.cache_id))
        if it.reused is not None:
            ex.kv.record_lookup(it.reused)
        ex.caches.record(it.cache_id, s.expected_length, s.tokens, replay_key(s), res)
    computed = iter(fresh)
    results = [r if isinstance(r, StepResult) else next(computed) for r in resolved]
    for r in results:
        if r.cache_id not in created:  # this call completed on a cache an earlier one made
            ex.caches.claim(r.cache_id)
    ex.caches.renew([r.cache_id for r in results])  # leases run from a step's end: it may outlast one
    ex.peak_used_bytes = max(ex.peak_used_bytes, used_bytes(ex))
    ran = [s for s, _ in work]  # replayed items cost nothing and are not counted
    decode_items = sum(s.is_decode for s in ran)
    ex.stats.end(
        prefill_items=len(ran) - decode_items,
        decode_items=decode_items,
        elapsed_ns=time.perf_counter_ns() - started,
        full_logits=any(s.policy.kind is LogitsKind.FULL for s in ran if s.rows is not Rows.NONE),
    )
    return results


def feed(ex: KvCacheExecutor, s: ItemSpec, identity: str | None) -> ItemSpec:
    """A feed_sampled_token item with its token: the one its cache's latest step sampled, when
    that step made the cache's length the item's position; for a retry of a fed step that
    succeeded, the token that step ran (resolve then replays its record)."""
    table = ex.kv.get(s.cache_id)  # raises CacheNotFound
    ex.caches.touch(s.cache_id, identity, s.where)  # the owner's only
    last = ex.caches.last_step(s.cache_id)
    end = last.start + len(last.tokens) if last is not None else -1
    if last is not None and table.num_tokens == end:
        if s.expected_length == end:
            outs = getattr(last.result, "outputs", None)  # an imported cache records no step result
            out = outs[-1] if outs else None
            if out is not None and out.kind in (LogitsKind.ARGMAX, LogitsKind.SAMPLE):
                return dataclasses.replace(s, tokens=[out.token_id])
        elif s.expected_length == last.start and last.request == replay_key(s):
            return dataclasses.replace(s, tokens=list(last.tokens))
    if table.num_tokens != s.expected_length:
        raise _stale(s, table.num_tokens)
    raise FailedPrecondition(
        f"{s.where}.feed_sampled_token: cache {s.cache_id!r} has no sampled token to feed at position "
        f"{s.expected_length}: its latest step returned no ARGMAX or SAMPLE token, or the cache changed since",
        field=f"{s.where}.feed_sampled_token", reason="NO_SAMPLED_TOKEN", cache_id=s.cache_id)


def _stale(s: ItemSpec, length: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"{s.where}: cache {s.cache_id!r} holds {length} tokens but the request continues it at "
        f"{s.expected_length}; the caller's handle is stale",
        field=s.where, reason="STALE_CACHE_HANDLE", cache_id=s.cache_id, cache_length=length)


def resolve(ex: KvCacheExecutor, s: ItemSpec, created: dict[str, int], identity: str | None,
            named: frozenset[str]) -> StepItem | StepResult:
    if s.cache_id is not None and s.cache_id in ex.kv:
        table = ex.kv.get(s.cache_id)
        adapter = ex.caches.touch(s.cache_id, identity, s.where).adapter
        if table.num_tokens != s.expected_length:
            replayed = ex.caches.replay(s.cache_id, table.num_tokens, s.expected_length, s.tokens,
                                        replay_key(s))
            if replayed is not None:
                return dataclasses.replace(replayed, created=False)  # a retry of a step that succeeded
            raise _stale(s, table.num_tokens)
        cache_id = s.cache_id
        if s.adapter is not None and s.adapter != (adapter.name if adapter else None):
            bound = f"LoRA adapter {adapter.name!r}" if adapter else "no LoRA adapter"
            raise FailedPrecondition(
                f"{s.where}: cache {s.cache_id!r} was created with {bound}; its K and V cannot continue "
                f"under adapter {s.adapter!r}", field=f"{s.where}.metadata", reason="LORA_ADAPTER_MISMATCH",
                cache_id=s.cache_id)
    elif s.cache_id is not None and not s.may_create:
        ex.kv.get(s.cache_id)  # raises CacheNotFound, saying whether it was released
        raise AssertionError("unreachable")
    else:
        adapter = named_adapter(ex.loras, s.adapter, f"{s.where}.metadata", ex.name)
        cache_id, table = ex.kv.create(s.cache_id, namespace=adapter.key if adapter else "", avoid=named)
        created[cache_id] = ex.caches.add(cache_id, identity, adapter)
    end = s.expected_length + len(s.tokens)
    if end > ex.max_sequence_length:
        raise OutOfRange(
            f"{s.where}: {len(s.tokens)} tokens at position {s.expected_length} would reach {end}, "
            f"past max_sequence_length {ex.max_sequence_length}", field=s.where)
    reused = None
    if not s.is_decode and s.rows is not Rows.ALL:
        # A prompt or chunk: take its leading full blocks from the prefix cache. The last
        # token is always computed, so that its logits (and its K and V) exist.
        reused = ex.kv.match_prefix(cache_id, s.tokens, limit=len(s.tokens) - 1)
    skip = reused or 0
    return StepItem(cache_id, table, s.tokens[skip:], s.expected_length + skip, s.rows, reused, adapter)


def step_outputs(work: list[tuple[ItemSpec, StepItem]], step: StepLogits,
                 policy_kernels) -> list[list[LogitsResult] | None]:
    """Every item's logits policy over its rows, all rows at once: one argmax (or top-k,
    or draw) over the step's rows, and one copy of the ids to the host, whatever the
    batch size."""
    if step.logits is None:
        return [None] * len(work)
    policies: list[LogitsPolicy | None] = [None] * step.logits.shape[0]
    positions = [0] * step.logits.shape[0]
    for (s, it), span in zip(work, step.spans):
        if span is not None:
            first, n = span
            # Row r predicts the token at position first_predicted + r; it seeds sampling.
            first_predicted = it.start + len(it.tokens) - n + 1
            policies[first:first + n] = [s.policy] * n
            positions[first:first + n] = range(first_predicted, first_predicted + n)
    results = apply_policies(step.logits, policies, positions, policy_kernels, step.argmax)
    return [None if span is None else results[span[0]:span[0] + span[1]] for span in step.spans]


def finish(ex: KvCacheExecutor, it: StepItem, outputs: list[LogitsResult] | None, serial: int | None) -> StepResult:
    """serial: the creation serial when this call created the cache, else None."""
    return StepResult(it.cache_id, outputs, ex._handle(it.cache_id), serial is not None, serial or 0)
