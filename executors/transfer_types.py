"""What moves when a KV cache moves between executors: fingerprint, description, chunks.

A chunk holds K and V of a run of positions inside one of the exporter's blocks, for a run
of layers, as raw little-endian bytes of the pool's dtype, with a CRC-32 of both. The
description comes first, so that an importer refuses another model, dtype or geometry
before any K or V is read.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from executors.types import DType, KvCacheHandle

DEFAULT_MAX_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class KvFingerprint:
    """Which K and V an executor computes for given tokens."""

    model_id: str
    weights_digest: str  # sha256 hex of the served parameters
    kv_dtype: DType
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device_type: str  # "cpu", "cuda": informational, not compared

    def mismatch(self, other: KvFingerprint) -> str | None:
        """The first field (other than device_type) in which `other` differs, described; or None."""
        # The layout first: it says more than two digests that differ.
        for name in ("kv_dtype", "num_layers", "num_kv_heads", "head_dim", "model_id", "weights_digest"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                show = (lambda v: v.name) if isinstance(mine, DType) else repr
                return f"{name} is {show(theirs)} in the stream but {show(mine)} here"
        return None

    @property
    def bytes_per_position_layer(self) -> int:
        """Bytes of K plus V for one position of one layer."""
        return 2 * self.num_kv_heads * self.head_dim * ELEMENT_BYTES[self.kv_dtype]


ELEMENT_BYTES = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2}


@dataclass(frozen=True, slots=True)
class KvChunk:
    position_start: int
    position_count: int
    layer_start: int
    layer_count: int
    key: bytes  # [layer_count, position_count, H, D] of the pool's dtype
    value: bytes
    crc32: int

    @staticmethod
    def checksum(key: bytes, value: bytes) -> int:
        return zlib.crc32(value, zlib.crc32(key))


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Where one chunk goes: positions [position_start, +position_count), layers [layer_start, +layer_count)."""

    position_start: int
    position_count: int
    layer_start: int
    layer_count: int


def plan_chunks(start: int, end: int, block_size: int, num_layers: int, bytes_per_position_layer: int,
                max_chunk_bytes: int) -> list[ChunkSpan]:
    """The chunks of positions [start, end), in stream order: runs of positions inside one
    block of the exporter, each run's layers in runs, all keeping key + value under
    max_chunk_bytes (one layer of one position at least)."""
    spans: list[ChunkSpan] = []
    p = start
    while p < end:
        n = min(end, (p // block_size + 1) * block_size, p + max(1, max_chunk_bytes // bytes_per_position_layer)) - p
        per_run = max(1, min(num_layers, max_chunk_bytes // (n * bytes_per_position_layer)))
        for layer in range(0, num_layers, per_run):
            spans.append(ChunkSpan(p, n, layer, min(per_run, num_layers - layer)))
        p += n
    return spans


@dataclass(frozen=True, slots=True)
class KvExportDescription:
    fingerprint: KvFingerprint
    cache_id: str
    block_size: int
    start_position: int
    end_position: int
    cache_length: int
    token_ids: tuple[int, ...]  # positions [0, end_position)
    lora_adapter: str | None
    num_chunks: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class ImportResult:
    kv_cache: KvCacheHandle
    imported_tokens: int
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class CacheInfo:
    cache_id: str
    sequence_length: int
    lora_adapter: str | None
    idle_seconds: float
    num_blocks: int
