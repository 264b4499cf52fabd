"""Export and import of KV caches for a KvCacheExecutor (see transfer_types.py for the format).

Export pins the blocks of the exported positions (kvcache Hold) in one worker job: a step
that writes into a pinned block copies it first, and a release or truncate leaves it
held, so the stream carries the snapshot of the moment the call started, however the
cache moves on. Chunks are then read one worker job each, interleaved with steps.

Import reserves every block it needs before reading any K or V (so a full pool is
refused up front with the number of blocks needed), writes each chunk as it arrives into
blocks no table points at, and adopts them into a cache only once the last chunk is in
and every checksum held: until then nothing exists, and an abort (a bad chunk, a short
stream, a cancelled call) just gives the reservation back. Chunks may come from an
executor with another block size: positions are mapped onto this pool's own blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import warnings
from collections.abc import AsyncIterator, Iterable, Sequence

import torch

from executors.errors import DataLoss, FailedPrecondition, InvalidParameter, OutOfRange
from executors.transfer_types import (
    ImportResult,
    KvChunk,
    KvExportDescription,
    KvFingerprint,
    plan_chunks,
)
from kvcache.errors import CacheAlreadyExists
from kvcache.manager import CACHE_ID_PATTERN, Hold

IMPORT_REQUEST = "import"  # a CacheRegistry step record's request for an import (never equal to a step's)


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over each tensor's name, dtype, shape and bytes (logical layout, any device)."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _replay_key(d: KvExportDescription) -> tuple:
    """What makes two imports the same import: the K and V they write (not how they were chunked)."""
    return IMPORT_REQUEST, d.fingerprint, d.start_position, d.end_position, d.token_ids, d.lora_adapter


def _slots(hold: Hold, block_size: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    ids = hold.block_ids
    return torch.tensor([ids[p // block_size - hold.first_block] * block_size + p % block_size
                         for p in range(start, start + count)], device=device)


def _to_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order: one copy on a CPU, straight from a strided
    view of the pool (NumPy's tobytes walks the strides)."""
    t = t.cpu()
    if t.element_size() == 2:  # bfloat16 has no NumPy dtype: its bits travel as int16
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor over the message's own bytes (no copy; the pool write copies)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)


class KvExport:
    """An export under way: `description`, then `chunks()`; the snapshot goes when they end."""

    def __init__(self, executor, hold: Hold, description: KvExportDescription, max_chunk_bytes: int) -> None:
        self._ex = executor
        self._hold: Hold | None = hold
        self.description = description
        fp = description.fingerprint
        self._spans = plan_chunks(description.start_position, description.end_position, description.block_size,
                                  fp.num_layers, fp.bytes_per_position_layer, max_chunk_bytes)

    async def chunks(self) -> AsyncIterator[KvChunk]:
        try:
            for span in self._spans:
                key, value = await self._ex._run(self._read_now, span)
                # The checksum off the worker (and off the event loop): steps do not wait for it.
                crc = await asyncio.to_thread(KvChunk.checksum, key, value)
                yield KvChunk(span.position_start, span.position_count, span.layer_start, span.layer_count, key,
                              value, crc)
        finally:
            self.close()

    def close(self) -> None:
        """Let the snapshot go (queued on the worker, so it also runs when the caller was cancelled)."""
        hold, self._hold = self._hold, None
        if hold is not None:
            self._ex.worker.submit(self._ex.kv.drop_hold, hold)

    def _read_now(self, span) -> tuple[bytes, bytes]:
        # A span lies inside one block (plan_chunks): its slots are a contiguous run, read as a view.
        first = _slots(self._hold, self._ex.pool.block_size, span.position_start, 1, "cpu")[0].item()
        k, v = self._ex._read_kv(span.layer_start, span.layer_count, first, span.position_count)
        return _to_bytes(k), _to_bytes(v)


class KvImport:
    """An import under way: `write` each chunk in order, then `finish`; `abort` on any failure."""

    def __init__(self, executor, description: KvExportDescription, cache_id: str | None, identity: str | None,
                 adapter) -> None:
        self._ex = executor
        self.description = description
        self.cache_id = cache_id
        self._identity = identity
        self._adapter = adapter
        self._hold: Hold | None = None
        self._extends = description.start_position > 0
        self._position = description.start_position  # next position expected
        self._layer = 0  # next layer expected at that position
        self._run_length = 0  # positions of the chunks now tiling the layers
        self._chunks = 0
        self._bytes = 0
        self.replayed: ImportResult | None = None
        self._serial = 0  # the creation of the cache an import extends, checked again at adopt
        # The cache an import extends is in use while the stream runs: not reaped meanwhile.
        self._in_use = [cache_id] if self._extends and cache_id is not None else []
        executor.caches.use(self._in_use)

    def _done_using(self) -> None:
        in_use, self._in_use = self._in_use, []
        self._ex.caches.done_using(in_use)

    # -- on the worker --------------------------------------------------------------------
    def begin_now(self) -> None:
        """Check the target, then reserve every block the import needs (or replay a finished one)."""
        ex, d = self._ex, self.description
        kv, start, end = ex.kv, d.start_position, d.end_position
        if self.cache_id is not None and self.cache_id in kv:
            state = ex.caches.touch(self.cache_id, self._identity, "start.cache_id")
            table = kv.get(self.cache_id)
            last = state.last_step
            if table.num_tokens == end and last is not None and last.request == _replay_key(d):
                self.replayed = dataclasses.replace(last.result, replayed=True, imported_tokens=0,
                                                    kv_cache=ex._handle(self.cache_id))
                ex.caches.claim(self.cache_id)  # the first attempt, if its caller went away, must not undo it now
                return
            if not self._extends:
                raise CacheAlreadyExists(self.cache_id)
            if table.num_tokens != start:
                raise FailedPrecondition(
                    f"start.cache_id: cache {self.cache_id!r} holds {table.num_tokens} tokens but the stream "
                    f"continues it at {start}", field="start.cache_id", reason="STALE_CACHE_HANDLE",
                    cache_id=self.cache_id, cache_length=table.num_tokens)
            if tuple(table.tokens) != d.token_ids[:start]:
                raise FailedPrecondition(f"start.cache_id: cache {self.cache_id!r} holds other tokens than the "
                                         "stream's first positions", field="start.cache_id",
                                         reason="KV_TOKENS_MISMATCH", cache_id=self.cache_id)
            bound = state.adapter.name if state.adapter else None
            if bound != d.lora_adapter:
                raise FailedPrecondition(f"start.cache_id: cache {self.cache_id!r} is bound to LoRA adapter "
                                         f"{bound!r}, the stream to {d.lora_adapter!r}", field="start.cache_id",
                                         reason="LORA_ADAPTER_MISMATCH", cache_id=self.cache_id)
            self._serial = ex.caches.mark(self.cache_id)[0]
            self._hold = kv.reserve(start, end, extend=self.cache_id)
            try:
                ex.pool.copy_blocks(list(self._hold.copies))
            except BaseException:  # the caller never gets this session to abort: give the blocks back
                kv.drop_hold(self._hold)
                self._hold = None
                raise
            return
        if self._extends:
            kv.get(self.cache_id)  # raises CacheNotFound
        self._hold = kv.reserve(0, end)

    def _write_now(self, start: int, layer_start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pool = self._ex.pool
        self._ex._write_kv(layer_start, _slots(self._hold, pool.block_size, start, k.shape[1], pool.device), k, v)

    def _adopt_now(self) -> tuple[ImportResult, tuple[int, int]]:
        ex, d, kv = self._ex, self.description, self._ex.kv
        start, end = d.start_position, d.end_position
        if self._adapter is not None and not ex.loras.holds(self._adapter):
            # Unloaded (and perhaps loaded again with other weights) while the stream ran:
            # the K and V were computed with weights this executor no longer serves.
            raise FailedPrecondition(f"start.description.lora_adapter: LoRA adapter {self._adapter.name!r} was "
                                     "unloaded while the import was streaming", field="start.description.lora_adapter",
                                     reason="LORA_ADAPTER_NOT_FOUND", adapter=self._adapter.name)
        if self._extends:
            table = kv.get(self.cache_id) if self.cache_id in kv else None
            # The same creation too: released and made again (by anyone) with the same tokens,
            # it is another cache, perhaps another identity's.
            if (table is None or table.num_tokens != start or tuple(table.tokens) != d.token_ids[:start]
                    or ex.caches.mark(self.cache_id)[0] != self._serial):
                raise FailedPrecondition(f"cache {self.cache_id!r} changed while the import was streaming",
                                         field="start.cache_id", reason="STALE_CACHE_HANDLE", cache_id=self.cache_id)
            cache_id = kv.adopt(self._hold, None, end, extend=self.cache_id)
            ex.caches.claim(cache_id)  # completed on a cache another call made
        else:
            namespace = self._adapter.key if self._adapter is not None else ""
            cache_id = kv.adopt(self._hold, self.cache_id, end, namespace=namespace)
            ex.caches.add(cache_id, self._identity, self._adapter)
        self._hold = None
        # Its full blocks join the prefix cache, unless callers are told apart: K and V named by
        # the stream's token ids, which its caller could have forged, must not reach others.
        kv.commit(cache_id, start, d.token_ids[start:end], share=self._identity is None)
        result = ImportResult(ex._handle(cache_id), end - start)
        ex.caches.record(cache_id, start, d.token_ids[start:end], _replay_key(d), result)
        return result, ex.caches.mark(cache_id)

    def _undo_now(self, adopted: tuple[ImportResult, tuple[int, int]]) -> None:
        """The caller went away before it learned the import completed: undo it, unless a
        later call (a replaying retry included) has completed on the cache since."""
        result, mark = adopted
        cid, kv, caches = result.kv_cache.cache_id, self._ex.kv, self._ex.caches
        if cid not in kv or caches.mark(cid) != mark:
            return
        if not self._extends:
            kv.release(cid)
            caches.remove(cid)
        elif kv.get(cid).num_tokens == self.description.end_position:
            kv.truncate(cid, self.description.start_position)
            caches.forget_step(cid)

    # -- on the event loop ----------------------------------------------------------------
    async def write(self, chunk: KvChunk) -> None:
        d, fp = self.description, self.description.fingerprint
        n, lc = chunk.position_count, chunk.layer_count
        where = f"chunk {self._chunks}"
        if chunk.position_start != self._position or chunk.layer_start != self._layer:
            raise DataLoss(f"{where} holds positions from {chunk.position_start}, layers from {chunk.layer_start}; "
                           f"expected position {self._position}, layer {self._layer}: chunks were lost or reordered",
                           reason="KV_CHUNK_OUT_OF_ORDER")
        if self._layer and n != self._run_length:
            raise InvalidParameter(f"{where} holds {n} positions; the chunks before it at position "
                                   f"{self._position} held {self._run_length}", field="chunk.position_count")
        if n < 1 or lc < 1 or self._position + n > d.end_position or self._layer + lc > fp.num_layers:
            raise InvalidParameter(f"{where}: positions [{chunk.position_start}, +{n}) and layers "
                                   f"[{chunk.layer_start}, +{lc}) are not inside [{d.start_position}, "
                                   f"{d.end_position}) and [0, {fp.num_layers})", field="chunk")
        size = n * lc * fp.bytes_per_position_layer // 2
        if len(chunk.key) != size or len(chunk.value) != size:
            raise DataLoss(f"{where} carries {len(chunk.key)} + {len(chunk.value)} bytes of K and V; its shape "
                           f"needs {size} each", reason="KV_CHUNK_SIZE")
        if await asyncio.to_thread(KvChunk.checksum, chunk.key, chunk.value) != chunk.crc32:  # off the event loop
            raise DataLoss(f"{where} (positions {chunk.position_start}..{chunk.position_start + n - 1}, layers "
                           f"{chunk.layer_start}..{chunk.layer_start + lc - 1}) fails its CRC-32",
                           reason="KV_CHUNK_CHECKSUM")
        pool = self._ex.pool
        shape = (lc, n, fp.num_kv_heads, fp.head_dim)
        k, v = _from_bytes(chunk.key, pool.dtype, shape), _from_bytes(chunk.value, pool.dtype, shape)
        await self._ex._run(self._write_now, self._position, self._layer, k, v)
        self._chunks += 1
        self._bytes += 2 * size
        self._run_length = n
        self._layer += lc
        if self._layer == fp.num_layers:
            self._position, self._layer = self._position + n, 0

    async def finish(self) -> ImportResult:
        d = self.description
        if self._position != d.end_position or self._layer:
            raise DataLoss(f"the stream ended after {self._chunks} of {d.num_chunks} chunks: positions from "
                           f"{self._position} (layer {self._layer}) to {d.end_position} are missing",
                           reason="KV_STREAM_SHORT", chunks_received=self._chunks, chunks_expected=d.num_chunks)
        if self._chunks != d.num_chunks or self._bytes != d.total_bytes:
            raise DataLoss(f"the stream carried {self._chunks} chunks and {self._bytes} bytes; its description "
                           f"announced {d.num_chunks} and {d.total_bytes}", reason="KV_STREAM_MISMATCH")
        try:
            result, _ = await self._ex._run(self._adopt_now, on_abandon=self._undo_now)
        finally:
            self._done_using()
        return result

    def abort(self) -> None:
        """Give the reservation back (queued on the worker; safe to call more than once)."""
        self._done_using()
        hold, self._hold = self._hold, None
        if hold is not None:
            self._ex.worker.submit(self._ex.kv.drop_hold, hold)


def check_description(d: KvExportDescription, mine: KvFingerprint, vocab_size: int, max_sequence_length: int,
                      cache_id: str | None) -> None:
    """Refuse a stream this executor cannot continue, before any of its K and V is read."""
    if (why := mine.mismatch(d.fingerprint)) is not None:
        raise FailedPrecondition(f"start.description.fingerprint: the stream comes from another model or KV layout: "
                                 f"{why}", field="start.description.fingerprint", reason="KV_FINGERPRINT_MISMATCH")
    if not 0 <= d.start_position < d.end_position:
        raise InvalidParameter(f"start.description: positions [{d.start_position}, {d.end_position}) are empty",
                               field="start.description.end_position")
    if d.end_position > max_sequence_length:
        raise OutOfRange(f"start.description.end_position {d.end_position} is past max_sequence_length "
                         f"{max_sequence_length}", field="start.description.end_position")
    if len(d.token_ids) != d.end_position:
        raise InvalidParameter(f"start.description.token_ids holds {len(d.token_ids)} ids; positions [0, "
                               f"{d.end_position}) need {d.end_position}", field="start.description.token_ids")
    bad = next((i for i, t in enumerate(d.token_ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParameter(f"start.description.token_ids[{bad}] = {d.token_ids[bad]} is outside the vocabulary "
                               f"[0, {vocab_size})", field=f"start.description.token_ids[{bad}]")
    if cache_id is not None and not CACHE_ID_PATTERN.fullmatch(cache_id):
        raise InvalidParameter(f"start.cache_id {cache_id[:64]!r} is invalid: use 1 to 128 characters from "
                               "[A-Za-z0-9._:-]", field="start.cache_id", reason="INVALID_CACHE_ID")
    if d.start_position > 0 and cache_id is None:
        raise InvalidParameter(f"start.cache_id is required: the stream starts at position {d.start_position}, so "
                               "it extends an existing cache", field="start.cache_id")


def export_description(ex, cache_id: str, start: int, end: int, tokens: Sequence[int], length: int,
                       adapter: str | None, fingerprint: KvFingerprint, max_chunk_bytes: int) -> KvExportDescription:
    spans = plan_chunks(start, end, ex.kv.block_size, fingerprint.num_layers, fingerprint.bytes_per_position_layer,
                        max_chunk_bytes)
    return KvExportDescription(fingerprint, cache_id, ex.kv.block_size, start, end, length, tuple(tokens[:end]),
                               adapter, len(spans), (end - start) * fingerprint.num_layers
                               * fingerprint.bytes_per_position_layer)
