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
from executors.step_overlap import HostPairs, InFlightStep, fill_fed_tokens, plain_argmax
from executors.types import LogitsKind, LogitsPolicy, LogitsResult

if TYPE_CHECKING:
    from executors.kv_executor import KvCacheExecutor
    from kvcache.copy_on_write import Swap


def replay_key(s: ItemSpec) -> tuple:
    """What else a retry must repeat to be replayed: the rows it wants and, when it wants
    any, their policy (an item that returns no logits ignores its policy, even a NaN one,
    which would never equal itself), and whether its token was fed."""
    return (s.rows, None if s.rows is Rows.NONE else s.policy, s.feed)


def run_step(ex: KvCacheExecutor, specs: list[ItemSpec], identity: str | None) -> list[StepResult] | InFlightStep:
    """Run the specs as one forward; a spec that repeats its cache's last step is replayed.

    A fed step of plain ARGMAX decode rows through the decode graphs, on an executor that
    overlaps steps, returns in flight (step_overlap.py): its caller waits for InFlightStep.future."""
    started = time.perf_counter_ns()
    flight = ex.worker.in_flight if isinstance(ex.worker.in_flight, InFlightStep) else None
    if flight is not None and not flight.continued_by(specs):
        ex.worker.settle()
        flight = None
    specs = [feed(ex, s, identity, flight) if s.feed else s for s in specs]
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
        items = [it for _, it in work]
        if flight is not None and any(it.fed_row is not None for it in items) and not ex._feeds_on_device(items):
            settled(ex, work, flight)  # a forward that takes its tokens from the host
            flight = None
        step = ex._forward_step(items) if work else None
        if flight is not None:  # launched behind it: now the step before can be finished
            settled(ex, work, flight)
            ex.stats.begin(len(specs))
        if step is not None and leaves_in_flight(ex, work, step):
            return in_flight(ex, specs, work, resolved, created, step, started)
        outputs = step_outputs(work, step, ex.policy_kernels) if step is not None else []
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
    return conclude(ex, specs, work, resolved, fresh, created, started)


def leaves_in_flight(ex: KvCacheExecutor, work: list[tuple[ItemSpec, StepItem]], step: StepLogits) -> bool:
    """Whether a launched step is left in flight: every row through the decode graphs (whose
    argmax pairs are all it needs: plain ARGMAX rows) and some fed, the mark of a caller that keeps
    steps in flight. A caller that sends its tokens waits for each step: finishing it at once
    answers it without the idle worker's polling (up to ~0.1 ms)."""
    return (ex.overlaps_steps and step.argmax is not None and ex.kv.window is None
            and any(s.feed for s, _ in work) and all(plain_argmax(s.policy) for s, _ in work))


def settled(ex: KvCacheExecutor, work: list[tuple[ItemSpec, StepItem]], flight: InFlightStep) -> None:
    """Settle the step in flight; the tokens its rows fed to this step's become the host's."""
    ex.worker.settle()
    fill_fed_tokens(work, flight)


def in_flight(ex: KvCacheExecutor, specs: list[ItemSpec], work: list[tuple[ItemSpec, StepItem]],
              resolved: list[StepItem | StepResult], created: dict[str, int], step: StepLogits,
              started: int) -> InFlightStep:
    """Leave a launched step in flight: its handles now (a later step grows its caches before it
    is settled), its outputs and bookkeeping once its pairs reach the host."""
    unanswered = [finish(ex, it, None, created.get(it.cache_id)) for _, it in work]

    def conclude_with(ids: list[int], logprobs: list[float]) -> list[StepResult]:
        fresh = [dataclasses.replace(r, outputs=[LogitsResult(LogitsKind.ARGMAX, token_id=ids[i], logprob=logprobs[i])])
                 for r, (i, _) in zip(unanswered, step.spans)]
        return conclude(ex, specs, work, resolved, fresh, created, started)

    flight = InFlightStep(HostPairs(step.argmax),
                          rows={it.cache_id: span[0] for (_, it), span in zip(work, step.spans)},
                          ends={it.cache_id: it.start + len(it.tokens) for _, it in work}, conclude=conclude_with)
    ex.worker.in_flight = flight
    return flight


def conclude(ex: KvCacheExecutor, specs: list[ItemSpec], work: list[tuple[ItemSpec, StepItem]],
             resolved: list[StepItem | StepResult], fresh: list[StepResult], created: dict[str, int],
             started: int) -> list[StepResult]:
    """Commit a step that ran: its filled blocks named, its record kept for a retry, its stats."""
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


def feed(ex: KvCacheExecutor, s: ItemSpec, identity: str | None, flight: InFlightStep | None) -> ItemSpec:
    """A feed_sampled_token item with its token: the one its cache's latest step sampled, when
    that step made the cache's length the item's position (still on the device when that step
    is in flight: the item then names its row); for a retry of a fed step that succeeded, the
    token that step ran (resolve then replays its record)."""
    table = ex.kv.get(s.cache_id)  # raises CacheNotFound
    ex.caches.touch(s.cache_id, identity, s.where)  # the owner's only
    if flight is not None and flight.ends.get(s.cache_id) == s.expected_length == table.num_tokens:
        return dataclasses.replace(s, tokens=[0], fed_row=flight.rows[s.cache_id])
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
    return StepItem(cache_id, table, s.tokens[skip:], s.expected_length + skip, s.rows, reused, adapter, s.fed_row)


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
