"""KvCacheExecutor: every executor method on top of a paged KV pool and one forward hook.

Subclasses supply the model: `_forward_step` runs a list of StepItems (each a run of
tokens continuing one cache) as one forward, writing K and V through the pool, and
`_forward_sequence` runs a whole sequence without any cache. Everything else lives here,
once for every model: request validation, cache creation and lookup, all-or-nothing KV
growth with rollback, logits policies, status, metrics and lifecycle.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from executors.adapters import LoraRegistry
from executors.base import ModelExecutor
from executors.cache_state import CacheRegistry
from executors.errors import (
    FailedPrecondition,
    InvalidParameter,
    NotFound,
    OutOfRange,
    Unavailable,
    Unsupported,
)
from executors.identity import current_identity
from executors.kv_moves import KvMoves
from executors.kv_sizing import kv_bytes_per_block
from executors.logits import apply_policies, to_host_tensor
from executors.lora import LoraAdapter
from executors.stats import ExecutorStats
from executors.types import (
    FLOAT_OUTPUT_DTYPES,
    CacheMetrics,
    DecodeInput,
    DecodeOutput,
    DType,
    ExecutorLockMetrics,
    ExecutorState,
    ExecutorStatus,
    ForwardKind,
    HostTensor,
    KvCacheHandle,
    KvPoolStatus,
    LogitsKind,
    LogitsPolicy,
    LogitsResult,
    LoraAdapterInfo,
    LoraMetrics,
    LoraSource,
    MemoryUsage,
    PrefillInput,
    PrefillOutput,
    ReleaseResult,
    TruncateResult,
    UnifiedBatchItem,
    UnifiedItemResult,
    VerifyOutput,
)
from executors.worker import SerialWorker
from kvcache import BlockTable, KvCacheManager
from kvcache.kv_pool import PagedKvPool

log = logging.getLogger(__name__)


class Rows(enum.Enum):
    """Which positions of an item need logits."""

    NONE = 0  # a non-final prefill chunk: skip the lm_head
    LAST = 1  # prefill, decode, final chunk
    ALL = 2  # forward_verify


@dataclass(slots=True)
class ItemSpec:
    """A validated request for one cache, before any state is touched."""

    where: str  # field path used in error messages: "input", "inputs[2]", "batch.items[0]"
    cache_id: str | None  # None: a new cache with a server-chosen id
    expected_length: int  # the cache's length as the caller believes it
    may_create: bool  # an id not in use may be created (expected_length is 0)
    tokens: list[int]
    rows: Rows
    policy: LogitsPolicy
    is_decode: bool
    adapter: str | None = None  # the LoRA adapter named in the request's metadata


@dataclass(frozen=True, slots=True)
class StepResult:
    cache_id: str
    outputs: list[LogitsResult] | None  # one per logits row; None for Rows.NONE
    kv_cache: KvCacheHandle
    created: bool = False  # this step created the cache
    serial: int = 0  # the creation's serial (CacheRegistry), when created


class StepLogits(NamedTuple):
    """The logits of one forward: policies then run over all of its rows at once."""

    logits: torch.Tensor | None  # [rows, vocab], float32: every row some item needs
    spans: list[tuple[int, int] | None]  # per item: (first row, rows) in logits; None for Rows.NONE


@dataclass(slots=True)
class StepItem:
    """One cache's share of a forward: tokens at positions start..start+len-1."""

    cache_id: str
    table: BlockTable
    tokens: list[int]
    start: int
    rows: Rows
    reused: int | None = None  # prompt tokens taken from the prefix cache; None: no lookup
    adapter: LoraAdapter | None = None  # the cache's LoRA adapter


class KvCacheExecutor(KvMoves, ModelExecutor):
    pool_class: type[PagedKvPool] = PagedKvPool  # tensor parallelism: one that mirrors block copies

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        max_sequence_length: int,
        max_batch_size: int,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        prefix_caching: bool = True,
        scratch_blocks: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.device = device
        self.kv = KvCacheManager(num_blocks, block_size, prefix_caching=prefix_caching)
        # Said before the allocation, which takes seconds for a large pool (zero-filled).
        pool_bytes = (num_blocks + scratch_blocks) * kv_bytes_per_block(num_layers, num_kv_heads, head_dim, kv_dtype,
                                                                        block_size)
        log.info("allocating the KV pool: %d blocks of %d tokens (%d tokens), %.1f MiB of %s on %s", num_blocks,
                 block_size, num_blocks * block_size, pool_bytes / 2**20, str(kv_dtype).removeprefix("torch."), device)
        started = time.perf_counter()
        self.pool = self.pool_class(num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, device,
                                scratch_blocks)
        if (took := time.perf_counter() - started) > 1:
            log.info("KV pool allocated in %.1f s", took)
        self.worker = SerialWorker(self.name)
        self.caches = CacheRegistry()
        self.stats = ExecutorStats()
        self.peak_used_bytes = 0
        # What takes the ARGMAX rows of a step in one call (LlmExecutor: its model's CPU kernels).
        self.policy_kernels = None
        self.loras: LoraRegistry | None = None  # set by executors that apply LoRA adapters
        self._fingerprint = None  # KvMoves.kv_fingerprint, computed on first use
        self._fingerprint_lock = asyncio.Lock()
        self._fingerprint_task: asyncio.Future | None = None  # warm-up's digest, kept referenced

    # -- the model ------------------------------------------------------------------------
    @abc.abstractmethod
    def _forward_step(self, items: list[StepItem]) -> StepLogits:
        """Run the items as one forward; K and V of their tokens go into the pool.

        Returns the logits rows of every item that needs them, in one tensor, and per
        item where its rows are (one for Rows.LAST, len(tokens) for Rows.ALL, None for
        Rows.NONE).
        """

    @abc.abstractmethod
    def _forward_sequence(self, tokens: list[int], hidden: bool) -> torch.Tensor:
        """Logits ([n, vocab]) or final hidden states ([n, hidden]) without any cache."""

    @property
    def parameter_bytes(self) -> int:
        return 0

    # -- public methods -------------------------------------------------------------------
    def supports_native_unified_decode(self) -> bool:
        return True

    def kv_capacity(self) -> int | None:
        pool_tokens = self.kv.allocator.num_total * self.kv.block_size
        return pool_tokens if pool_tokens < self.max_sequence_length else None

    async def prefill(self, inp: PrefillInput) -> PrefillOutput:
        (res,) = await self._step([self._prefill_spec(inp, "input")])
        return PrefillOutput(logits=res.outputs[0], kv_cache=res.kv_cache)

    async def batch_prefill(self, inputs: Sequence[PrefillInput]) -> list[PrefillOutput]:
        specs = [self._prefill_spec(inp, f"inputs[{i}]") for i, inp in enumerate(inputs)]
        return [PrefillOutput(r.outputs[0], r.kv_cache) for r in await self._step(specs, "inputs")]

    async def decode(self, inp: DecodeInput) -> DecodeOutput:
        (res,) = await self._step([self._decode_spec(inp, "input")])
        return DecodeOutput(logits=res.outputs[0], kv_cache=res.kv_cache)

    async def batch_decode(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        specs = [self._decode_spec(inp, f"inputs[{i}]") for i, inp in enumerate(inputs)]
        return [DecodeOutput(r.outputs[0], r.kv_cache) for r in await self._step(specs, "inputs")]

    async def unified_decode(self, items: Sequence[UnifiedBatchItem]) -> list[UnifiedItemResult]:
        specs = [self._unified_spec(it, f"batch.items[{i}]") for i, it in enumerate(items)]
        results = await self._step(specs, "batch.items")
        return [UnifiedItemResult(r.cache_id, r.outputs[0] if r.outputs else None, r.kv_cache) for r in results]

    async def forward_verify(
        self, kv_cache: KvCacheHandle, tokens: Sequence[int], policy: LogitsPolicy
    ) -> VerifyOutput:
        tokens = self._check_tokens(tokens, "tokens")
        policy.validate(self.vocab_size, "logits_policy")
        spec = ItemSpec("kv_cache", kv_cache.cache_id, kv_cache.sequence_length, False, tokens, Rows.ALL,
                        policy, is_decode=True)
        (res,) = await self._step([spec])
        return VerifyOutput(outputs=res.outputs, kv_cache=res.kv_cache)

    async def forward(self, input_ids: Sequence[int], kind: ForwardKind, dtype: DType) -> HostTensor:
        tokens = self._check_tokens(input_ids, "input_ids")
        if len(tokens) > self.max_sequence_length:
            raise OutOfRange(
                f"input_ids holds {len(tokens)} tokens, more than max_sequence_length "
                f"{self.max_sequence_length}", field="input_ids")
        if dtype not in FLOAT_OUTPUT_DTYPES:
            raise InvalidParameter(f"dtype must be FLOAT32, BFLOAT16 or FLOAT16, got {dtype.name}", field="dtype")
        if kind is ForwardKind.TOKEN_LOGPROBS and len(tokens) < 2:
            raise InvalidParameter("TOKEN_LOGPROBS needs at least two input_ids", field="input_ids")
        return await self._run(self._forward_now, tokens, kind, dtype)

    async def truncate_kv(self, cache_id: str, new_length: int) -> TruncateResult:
        return await self._run(self._truncate_now, cache_id, new_length, current_identity.get())

    async def release_cache(self, cache_id: str, expected_length: int | None = None) -> ReleaseResult:
        return await self._run(self._release_now, cache_id, current_identity.get(), expected_length)

    async def reap_idle(self, ttl_s: float) -> list[str]:
        """Release caches idle for longer than ttl_s (their lease ran out); returns their ids."""
        return await self._run(self._reap_now, ttl_s)

    async def warmup(self) -> None:
        await self._run(self._warmup_now)
        # The weights' digest (seconds for a large model) in the background, off the worker: the
        # first move then finds it ready, and becoming ready does not wait for it.
        if self._fingerprint_task is None:
            self._fingerprint_task = asyncio.ensure_future(self._digest_in_background())

    async def _digest_in_background(self) -> None:
        with contextlib.suppress(Unsupported):  # an executor that cannot name its weights
            await self.kv_fingerprint()

    # -- LoRA adapters --------------------------------------------------------------------
    async def load_lora_adapter(self, name: str, source: LoraSource) -> LoraAdapterInfo:
        # Reading and validating stay off the worker, so steps keep running meanwhile.
        adapter = await asyncio.to_thread(self._loras().read, name, source)
        return await self._run(self._add_adapter_now, adapter)

    async def unload_lora_adapter(self, name: str) -> LoraAdapterInfo:
        return await self._run(self._remove_adapter_now, self._loras(), name)

    def list_lora_adapters(self) -> list[LoraAdapterInfo]:
        return self._loras().infos(self.caches.adapter_bindings())

    def lora_metrics(self) -> LoraMetrics | None:
        if self.loras is None:
            return None
        return LoraMetrics(
            enabled=True,
            adapter_count=len(self.loras),
            active_cache_bindings=sum(self.caches.adapter_bindings().values()),
            projection_applications=self.loras.projection_applications,
            position="real-inference",
            source="modelexec-multi-lora",
        )

    def _loras(self) -> LoraRegistry:
        if self.loras is None:
            raise Unsupported(f"the {self.name} executor has no LoRA support")
        return self.loras

    def _add_adapter_now(self, adapter: LoraAdapter) -> LoraAdapterInfo:
        self.loras.add(adapter)
        return self.loras.info(adapter.name, 0)

    def _remove_adapter_now(self, loras: LoraRegistry, name: str) -> LoraAdapterInfo:
        loras.get(name, "name")
        bound = self.caches.adapter_bindings().get(name, 0)
        info = loras.info(name, bound)
        loras.remove(name, bound)
        return info

    async def shutdown(self) -> int:
        released = await self._run(self._release_all_now)
        self.stats.state = ExecutorState.SHUTDOWN
        return released

    def status(self) -> ExecutorStatus:
        s, kv = self.stats, self.kv.stats()
        allocated = self.parameter_bytes + self.pool.total_bytes
        used = self._used_bytes()
        return ExecutorStatus(
            state=s.state,
            is_ready=s.state in (ExecutorState.READY, ExecutorState.BUSY),
            current_batch_size=s.current_batch_size,
            prefill_operations=s.prefill_operations,
            decode_operations=s.decode_operations,
            avg_prefill_time_ms=s.avg_prefill_time_ms,
            avg_decode_time_ms=s.avg_decode_time_ms,
            memory_usage=MemoryUsage(
                allocated_bytes=allocated,
                used_bytes=used,
                peak_bytes=max(self.peak_used_bytes, used),
                utilization_percent=100.0 * used / allocated if allocated else 0.0,
            ),
            last_operation_unix_s=s.last_operation_unix_s,
            kv_pool=KvPoolStatus(
                total_blocks=kv.total_blocks,
                used_blocks=kv.used_blocks,
                free_blocks=kv.free_blocks,
                block_size=kv.block_size,
                active_caches=kv.active_caches,
                block_allocations=kv.block_allocations,
                allocation_failures=kv.allocation_failures,
                leases_expired=self.caches.leases_expired,
                cached_blocks=kv.cached_blocks,
                window_freed_blocks=kv.window_freed_blocks,
            ),
        )

    def cache_metrics(self) -> CacheMetrics | None:
        w, prefix = self.worker, self.kv.prefix_stats()
        return CacheMetrics(
            position="real-kv-reuse",
            source="paged-block-prefix-cache",
            enabled=prefix.enabled,
            hits=prefix.hits,
            misses=prefix.misses,
            evictions=prefix.evictions,
            saved_prefill_tokens=prefix.saved_tokens,
            entries=prefix.entries,
            bytes=prefix.entries * self.pool.bytes_per_block,
            block_size=self.kv.block_size,
            kv_dtype=DType(str(self.pool.dtype).removeprefix("torch.")),
            decode_batch=self.stats.decode_batch_metrics(),
            executor_lock=ExecutorLockMetrics(
                samples=w.wait_samples,
                total_wait_time_us=w.total_wait_ns // 1000,
                avg_wait_time_ms=w.total_wait_ns / w.wait_samples / 1e6 if w.wait_samples else 0.0,
            ),
        )

    # -- request validation (no state read) -----------------------------------------------
    def _check_tokens(self, tokens: Sequence[int], where: str) -> list[int]:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise InvalidParameter(f"{where} must hold at least one token", field=where)
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameter(
                f"{where}[{bad}] = {tokens[bad]} is outside the vocabulary [0, {self.vocab_size})",
                field=f"{where}[{bad}]",
            )
        return tokens

    def _prefill_spec(self, inp: PrefillInput, where: str) -> ItemSpec:
        tokens = self._check_tokens(inp.input_ids, f"{where}.input_ids")
        inp.logits_policy.validate(self.vocab_size, f"{where}.logits_policy")
        if inp.attention_mask is not None and len(inp.attention_mask) > 0:
            if len(inp.attention_mask) != len(tokens):
                raise InvalidParameter(
                    f"{where}.attention_mask has {len(inp.attention_mask)} entries for {len(tokens)} input_ids",
                    field=f"{where}.attention_mask")
            if any(m != 1 for m in inp.attention_mask):
                raise InvalidParameter(
                    f"{where}.attention_mask must be all ones: each input is one unpadded sequence",
                    field=f"{where}.attention_mask")
        handle = inp.kv_cache
        start = handle.sequence_length if handle is not None else 0
        if inp.position_ids is not None and len(inp.position_ids) > 0:
            expected = list(range(start, start + len(tokens)))
            if [int(p) for p in inp.position_ids] != expected:
                raise FailedPrecondition(
                    f"{where}.position_ids must continue the cache: expected {start}..{start + len(tokens) - 1}",
                    field=f"{where}.position_ids", reason="POSITION_MISMATCH")
        adapter = _adapter_name(inp.metadata, where)
        if handle is None:
            return ItemSpec(where, None, 0, True, tokens, Rows.LAST, inp.logits_policy, False, adapter)
        return ItemSpec(where, handle.cache_id, start, start == 0, tokens, Rows.LAST, inp.logits_policy, False,
                        adapter)

    def _decode_spec(self, inp: DecodeInput, where: str) -> ItemSpec:
        tokens = self._check_tokens([inp.token_id], f"{where}.token_id")
        inp.logits_policy.validate(self.vocab_size, f"{where}.logits_policy")
        length = inp.kv_cache.sequence_length
        if inp.position_id is not None and inp.position_id != length:
            raise FailedPrecondition(
                f"{where}.position_id {inp.position_id} does not continue the cache (length {length})",
                field=f"{where}.position_id", reason="POSITION_MISMATCH")
        return ItemSpec(where, inp.kv_cache.cache_id, length, False, tokens, Rows.LAST, inp.logits_policy, True,
                        _adapter_name(inp.metadata, where))

    def _unified_spec(self, it: UnifiedBatchItem, where: str) -> ItemSpec:
        tokens = self._check_tokens(it.q_tokens, f"{where}.q_tokens")
        if it.is_final_chunk:
            it.logits_policy.validate(self.vocab_size, f"{where}.logits_policy")
        if not it.seq_id and it.pos_offset != 0:
            raise InvalidParameter(f"{where}.seq_id is required when pos_offset > 0", field=f"{where}.seq_id")
        is_decode = it.pos_offset > 0 and len(tokens) == 1 and it.is_final_chunk
        rows = Rows.LAST if it.is_final_chunk else Rows.NONE
        return ItemSpec(where, it.seq_id or None, it.pos_offset, it.pos_offset == 0, tokens, rows,
                        it.logits_policy, is_decode, _adapter_name(it.metadata, where))

    def _check_batch(self, specs: list[ItemSpec], where: str) -> None:
        if not specs:
            raise InvalidParameter(f"{where} must hold at least one item", field=where)
        if len(specs) > self.max_batch_size:
            raise InvalidParameter(
                f"{where} holds {len(specs)} items, more than max_batch_size {self.max_batch_size}", field=where)
        seen: dict[str, str] = {}
        for s in specs:
            if s.cache_id is None:
                continue
            if s.cache_id in seen:
                raise InvalidParameter(
                    f"{s.where} names cache {s.cache_id!r} already named by {seen[s.cache_id]}: "
                    "one item per cache per call", field=s.where)
            seen[s.cache_id] = s.where

    # -- execution (worker thread) --------------------------------------------------------
    async def _run(self, fn, *args, on_abandon=None):
        if self.stats.state is ExecutorState.SHUTDOWN:
            raise Unavailable(f"{self.name} executor is shut down")
        return await self.worker.run(fn, *args, on_abandon=on_abandon)

    async def _step(self, specs: list[ItemSpec], where: str = "input") -> list[StepResult]:
        self._check_batch(specs, where)
        return await self._run(self._step_now, specs, current_identity.get(), on_abandon=self._undo_created)

    def _step_now(self, specs: list[ItemSpec], identity: str | None) -> list[StepResult]:
        """Run the specs as one forward; a spec that repeats its cache's last step is replayed."""
        started = time.perf_counter_ns()
        self.stats.begin(len(specs))
        created: dict[str, int] = {}  # cache id -> creation serial
        # Server-chosen ids never equal an id a caller names anywhere in this call.
        named = frozenset(s.cache_id for s in specs if s.cache_id is not None)
        resolved: list[StepItem | StepResult] = []
        try:
            for s in specs:
                resolved.append(self._resolve(s, created, identity, named))
            work = [(s, it) for s, it in zip(specs, resolved) if isinstance(it, StepItem)]
            copies = self.kv.extend_many([(it.cache_id, it.start + len(it.tokens)) for _, it in work])
            self.pool.copy_blocks(copies)  # copy-on-write: before anything writes into them
            outputs = self._outputs(work, self._forward_step([it for _, it in work])) if work else []
            fresh = [self._finish(it, out, created.get(it.cache_id)) for (_, it), out in zip(work, outputs)]
        except BaseException:
            # Undo everything: caches this call created go, the others return to their
            # length before it (dropping any prefix blocks they were given).
            for s, it in zip(specs, resolved):
                if isinstance(it, StepItem) and it.cache_id not in created and it.table.num_tokens > s.expected_length:
                    self.kv.truncate(it.cache_id, s.expected_length)
            for cid in created:
                self.kv.release(cid)
                self.caches.remove(cid)
            self.stats.state = ExecutorState.READY
            self.stats.current_batch_size = 0
            raise
        for i, ((s, it), res) in enumerate(zip(work, fresh)):
            self.kv.commit(it.cache_id, it.start, it.tokens)  # name the blocks filled, for reuse
            if self.kv.slide(it.cache_id):  # every layer sliding: blocks the windows left go back to the pool
                res = fresh[i] = dataclasses.replace(res, kv_cache=self._handle(it.cache_id))
            if it.reused is not None:
                self.kv.record_lookup(it.reused)
            self.caches.record(it.cache_id, s.expected_length, s.tokens, (s.rows, s.policy), res)
        computed = iter(fresh)
        results = [r if isinstance(r, StepResult) else next(computed) for r in resolved]
        for r in results:
            if r.cache_id not in created:  # this call completed on a cache an earlier one made
                self.caches.claim(r.cache_id)
        self.peak_used_bytes = max(self.peak_used_bytes, self._used_bytes())
        ran = [s for s, _ in work]  # replayed items cost nothing and are not counted
        decode_items = sum(s.is_decode for s in ran)
        self.stats.end(
            prefill_items=len(ran) - decode_items,
            decode_items=decode_items,
            elapsed_ns=time.perf_counter_ns() - started,
            full_logits=any(s.policy.kind is LogitsKind.FULL for s in ran if s.rows is not Rows.NONE),
        )
        return results

    def _resolve(self, s: ItemSpec, created: dict[str, int], identity: str | None,
                 named: frozenset[str]) -> StepItem | StepResult:
        if s.cache_id is not None and s.cache_id in self.kv:
            table = self.kv.get(s.cache_id)
            adapter = self.caches.touch(s.cache_id, identity, s.where).adapter
            if table.num_tokens != s.expected_length:
                replayed = self.caches.replay(s.cache_id, table.num_tokens, s.expected_length, s.tokens,
                                              (s.rows, s.policy))
                if replayed is not None:
                    return dataclasses.replace(replayed, created=False)  # a retry of a step that succeeded
                raise FailedPrecondition(
                    f"{s.where}: cache {s.cache_id!r} holds {table.num_tokens} tokens but the request "
                    f"continues it at {s.expected_length}; the caller's handle is stale",
                    field=s.where, reason="STALE_CACHE_HANDLE", cache_id=s.cache_id, cache_length=table.num_tokens)
            cache_id = s.cache_id
            if s.adapter is not None and s.adapter != (adapter.name if adapter else None):
                bound = f"LoRA adapter {adapter.name!r}" if adapter else "no LoRA adapter"
                raise FailedPrecondition(
                    f"{s.where}: cache {s.cache_id!r} was created with {bound}; its K and V cannot continue "
                    f"under adapter {s.adapter!r}", field=f"{s.where}.metadata", reason="LORA_ADAPTER_MISMATCH",
                    cache_id=s.cache_id)
        elif s.cache_id is not None and not s.may_create:
            self.kv.get(s.cache_id)  # raises CacheNotFound, saying whether it was released
            raise AssertionError("unreachable")
        else:
            adapter = self._adapter(s.adapter, f"{s.where}.metadata")
            cache_id, table = self.kv.create(s.cache_id, namespace=adapter.key if adapter else "", avoid=named)
            created[cache_id] = self.caches.add(cache_id, identity, adapter)
        end = s.expected_length + len(s.tokens)
        if end > self.max_sequence_length:
            raise OutOfRange(
                f"{s.where}: {len(s.tokens)} tokens at position {s.expected_length} would reach {end}, "
                f"past max_sequence_length {self.max_sequence_length}", field=s.where)
        reused = None
        if not s.is_decode and s.rows is not Rows.ALL:
            # A prompt or chunk: take its leading full blocks from the prefix cache. The last
            # token is always computed, so that its logits (and its K and V) exist.
            reused = self.kv.match_prefix(cache_id, s.tokens, limit=len(s.tokens) - 1)
        skip = reused or 0
        return StepItem(cache_id, table, s.tokens[skip:], s.expected_length + skip, s.rows, reused, adapter)

    def _adapter(self, name: str | None, where: str) -> LoraAdapter | None:
        if name is None:
            return None
        if self.loras is None:
            raise NotFound(f"{where}: no LoRA adapter named {name!r} is loaded: the {self.name} executor has no "
                           "LoRA support", field=where, reason="LORA_ADAPTER_NOT_FOUND", adapter=name)
        return self.loras.get(name, where)

    def _outputs(self, work: list[tuple[ItemSpec, StepItem]], step: StepLogits) -> list[list[LogitsResult] | None]:
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
        results = apply_policies(step.logits, policies, positions, self.policy_kernels)
        return [None if span is None else results[span[0]:span[0] + span[1]] for span in step.spans]

    def _finish(self, it: StepItem, outputs: list[LogitsResult] | None, serial: int | None) -> StepResult:
        """serial: the creation serial when this call created the cache, else None."""
        return StepResult(it.cache_id, outputs, self._handle(it.cache_id), serial is not None, serial or 0)

    def _handle(self, cache_id: str) -> KvCacheHandle:
        t, p = self.kv.get(cache_id), self.pool
        return KvCacheHandle(
            cache_id=cache_id,
            sequence_length=t.num_tokens,
            # Blocks the sliding windows left (FREED) are not the cache's any more: the held ones.
            block_ids=tuple(t.block_ids[t.freed_blocks:]),
            block_size=t.block_size,
            num_layers=p.num_layers,
            num_kv_heads=p.num_kv_heads,
            head_dim=p.head_dim,
            device=str(p.device),
        )

    def _forward_now(self, tokens: list[int], kind: ForwardKind, dtype: DType) -> HostTensor:
        out = self._forward_sequence(tokens, hidden=kind is ForwardKind.HIDDEN_STATES)
        if kind is ForwardKind.TOKEN_LOGPROBS:
            logprobs = torch.log_softmax(out[:-1].float(), dim=-1)
            picked = logprobs.gather(1, torch.tensor(tokens[1:], device=out.device).unsqueeze(1)).squeeze(1)
            return to_host_tensor(picked, DType.FLOAT32)
        return to_host_tensor(out, dtype)

    def _truncate_now(self, cache_id: str, new_length: int, identity: str | None) -> TruncateResult:
        self.kv.get(cache_id)  # NOT_FOUND before an ownership check
        self.caches.touch(cache_id, identity, "cache_id")
        before = self.kv.get(cache_id).num_tokens
        freed = self.kv.truncate(cache_id, new_length)
        if new_length < before:
            self.caches.forget_step(cache_id)  # the last step is undone: nothing to replay
        self.caches.claim(cache_id)
        return TruncateResult(kv_cache=self._handle(cache_id), freed_blocks=freed)

    def _release_now(self, cache_id: str, identity: str | None, expected_length: int | None) -> ReleaseResult:
        if cache_id in self.kv:
            self.caches.touch(cache_id, identity, "cache_id")
            length = self.kv.get(cache_id).num_tokens
            if expected_length is not None and expected_length != length:
                raise FailedPrecondition(
                    f"cache {cache_id!r} holds {length} tokens, not the expected_length {expected_length}: it was not "
                    "released", field="expected_length", reason="STALE_CACHE_HANDLE", cache_id=cache_id,
                    cache_length=length)
        freed = self.kv.release(cache_id)
        self.caches.remove(cache_id)
        return ReleaseResult(released=freed is not None, freed_blocks=freed or 0)

    def _undo_created(self, results: list[StepResult]) -> None:
        """The caller went away before it learned of these caches: release them, unless a
        later call has completed on one since (a retry that got it by replay owns it now),
        whichever order the worker ran the two in."""
        for r in results:
            if r.created and r.cache_id in self.kv and self.caches.unclaimed(r.cache_id, r.serial):
                self.kv.release(r.cache_id)
                self.caches.remove(r.cache_id)

    def _reap_now(self, ttl_s: float) -> list[str]:
        expired = self.caches.idle(ttl_s)
        for cache_id in expired:
            self.kv.release(cache_id)
            self.caches.remove(cache_id)
        self.caches.leases_expired += len(expired)
        return expired

    def _release_all_now(self) -> int:
        self.caches.clear()
        return self.kv.release_all()

    def _warmup_now(self) -> None:
        """One small prefill, decode and verify on a scratch cache, then back to an idle pool."""
        self.stats.state = ExecutorState.INITIALIZING
        cache_id, _ = self.kv.create(None)
        try:
            tokens = [t % self.vocab_size for t in range(1, min(9, self.max_sequence_length))]
            self.kv.extend(cache_id, len(tokens))
            self._forward_step([StepItem(cache_id, self.kv.get(cache_id), tokens, 0, Rows.LAST)])
            self._forward_sequence(tokens, hidden=False)
        finally:
            self.kv.release(cache_id)
            self.stats.state = ExecutorState.READY

    def _used_bytes(self) -> int:
        return self.parameter_bytes + self.kv.stats().used_blocks * self.pool.bytes_per_block


LORA_ADAPTER_KEY = "ferrum_lora_adapter"


def _adapter_name(metadata: dict | None, where: str) -> str | None:
    """The LoRA adapter a request names in its metadata, or None."""
    name = (metadata or {}).get(LORA_ADAPTER_KEY)
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise InvalidParameter(f"{where}.metadata[{LORA_ADAPTER_KEY!r}] must be a non-empty string, got {name!r}",
                               field=f"{where}.metadata.{LORA_ADAPTER_KEY}")
    return name
