"""KvMoves: the executor methods that move caches between executors (ExportKv, ImportKv,
ListCaches), for KvCacheExecutor; the export snapshot and the import session are in
kv_transfer.py.

The fingerprint that an importer compares is computed once, on first use, off the worker:
hashing the weights of a large model takes seconds and must not stall steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from executors.errors import FailedPrecondition, InvalidParameter, OutOfRange, Unsupported
from executors.identity import current_identity
from executors.kv_transfer import KvExport, KvImport, check_description, export_description
from executors.lora_calls import named_adapter
from executors.omp_pool import off_worker
from executors.transfer_types import DEFAULT_MAX_CHUNK_BYTES, CacheInfo, KvExportDescription, KvFingerprint
from executors.types import DType
from kvcache.manager import CACHE_ID_PATTERN


class KvMoves:
    """Mixed into KvCacheExecutor: uses its kv, pool, caches, loras, worker and _run."""

    async def kv_fingerprint(self) -> KvFingerprint:
        """This executor's model and KV layout; the weights' digest is computed once, off the worker."""
        if self._fingerprint is None:
            async with self._fingerprint_lock:
                if self._fingerprint is None:
                    digest = await off_worker(self._weights_digest)
                    p = self.pool
                    self._fingerprint = KvFingerprint(self.model_id, digest,
                                                      DType(str(p.dtype).removeprefix("torch.")), p.num_layers,
                                                      self._moved_kv_heads, p.head_dim, p.device.type)
        return self._fingerprint

    @property
    def _moved_kv_heads(self) -> int:
        """The KV heads a chunk carries: every head of the model (a tensor-parallel rank's pool holds a share)."""
        return self.pool.num_kv_heads

    def _read_kv(self, layer_start: int, layer_count: int, first_slot: int,
                 count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([layer_count, count, _moved_kv_heads, head_dim]) of consecutive slots: views here."""
        return self.pool.view_layers(layer_start, layer_count, first_slot, count)

    def _write_kv(self, layer_start: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V ([layers, n, _moved_kv_heads, head_dim]) at the given slots of layers layer_start..."""
        self.pool.write_layers(layer_start, slots, k.to(self.pool.device), v.to(self.pool.device))

    model_id = ""  # ModelInfo.model_id; executors that move caches name their model

    def _weights_digest(self) -> str:
        raise Unsupported(f"the {self.name} executor cannot name its weights, so it cannot move KV caches")

    async def export_kv(self, cache_id: str, start: int | None = None, end: int | None = None,
                        max_chunk_bytes: int = 0) -> KvExport:
        fingerprint = await self.kv_fingerprint()
        return await self._run(self._export_now, cache_id, start, end, max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES,
                               fingerprint, current_identity.get(), on_abandon=KvExport.close)

    async def import_kv(self, description: KvExportDescription, cache_id: str | None) -> KvImport:
        check_description(description, await self.kv_fingerprint(), self.vocab_size, self.max_sequence_length,
                          cache_id)
        adapter = named_adapter(self.loras, description.lora_adapter, "start.description.lora_adapter", self.name)
        session = KvImport(self, description, cache_id, current_identity.get(), adapter)
        try:
            await self._run(session.begin_now, on_abandon=lambda _: session.abort())
        except BaseException:
            session.abort()
            raise
        return session

    async def list_caches(self, cache_ids: Sequence[str] = ()) -> list[CacheInfo]:
        for i, cid in enumerate(cache_ids):  # a malformed id names no cache: a mistake, not "none of them"
            if not CACHE_ID_PATTERN.fullmatch(cid):
                raise InvalidParameter(f"cache_ids[{i}] {cid[:140]!r} is not a cache id: use 1 to 128 characters "
                                       "from [A-Za-z0-9._:-]", field=f"cache_ids[{i}]")
        return await self._run(self._list_now, frozenset(cache_ids), current_identity.get())

    def _export_now(self, cache_id: str, start: int | None, end: int | None, max_chunk_bytes: int,
                    fingerprint: KvFingerprint, identity: str | None) -> KvExport:
        table = self.kv.get(cache_id)
        state = self.caches.touch(cache_id, identity, "cache_id")
        length, start = table.num_tokens, start or 0
        end = length if end is None else end
        if end > length:
            raise OutOfRange(f"end_position {end} is past the end of cache {cache_id!r} ({length} tokens)",
                             field="end_position", cache_length=length)
        if start >= end:
            raise InvalidParameter(f"positions [{start}, {end}) of cache {cache_id!r} are empty",
                                   field="start_position", cache_length=length)
        if start < table.freed_blocks * table.block_size:
            raise FailedPrecondition(
                f"cache {cache_id!r}: positions before {table.freed_blocks * table.block_size} have left the sliding "
                f"window and their K and V were freed; export from there on (start_position)",
                field="start_position", reason="KV_LEFT_WINDOW", cache_length=length)
        if len(table.tokens) < end:
            raise FailedPrecondition(f"cache {cache_id!r}: the tokens of its positions are not all known (its prefix "
                                     "entries were cleared), so an importer could not name them",
                                     field="cache_id", reason="KV_TOKENS_UNKNOWN")
        hold = self.kv.pin(cache_id, start, end)
        adapter = state.adapter.name if state.adapter else None
        description = export_description(self, cache_id, start, end, table.tokens, length, adapter,
                                          fingerprint, max_chunk_bytes)
        return KvExport(self, hold, description, max_chunk_bytes)

    def _list_now(self, wanted: frozenset[str], identity: str | None) -> list[CacheInfo]:
        now, out = time.monotonic(), []
        for cid, state in self.caches.items():
            if state.owner == identity and (not wanted or cid in wanted) and cid in self.kv:
                table = self.kv.get(cid)
                # Blocks a sliding window left went back to the pool (FREED): the held ones.
                out.append(CacheInfo(cid, table.num_tokens, state.adapter.name if state.adapter else None,
                                     now - state.last_used, len(table.block_ids) - table.freed_blocks))
        return out
