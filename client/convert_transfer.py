"""KV transfer messages: the ExportKv request, an ExportKv stream's messages as ImportKv ones, its result.

Apart from the step path: a transfer forwards megabytes of chunks, passed through without
re-encoding where possible (a serialized chunk is already the import's message).
client.convert re-exports these.
"""

from __future__ import annotations

from ._proto import executor_pb2 as pb
from .convert_common import cache_id_of, handle_from_proto, timing_from_proto
from .types import ImportResult, KvCacheHandle


def export_kv_request(cache: KvCacheHandle | str, start: int | None = None, end: int | None = None,
                      max_chunk_bytes: int = 0) -> pb.ExportKvRequest:
    msg = pb.ExportKvRequest(cache_id=cache_id_of(cache), max_chunk_bytes=int(max_chunk_bytes))
    if start is not None:
        msg.start_position = int(start)
    if end is not None:
        msg.end_position = int(end)
    return msg


def import_kv_request(export: pb.ExportKvResponse | bytes,
                      cache_id: str | None = None) -> pb.ImportKvRequest | bytes:
    """One message of an ExportKv stream as the ImportKv message that forwards it: the
    description becomes the start (naming the cache to create, or none for a server-chosen
    id), a chunk stays a chunk. A serialized chunk stays serialized: ExportKvResponse and
    ImportKvRequest both carry it as field 2, so its bytes are already the import's message."""
    if isinstance(export, bytes):
        parsed = pb.ExportKvResponse.FromString(export) if export[:1] != _CHUNK_TAG else None
        if parsed is None:
            return export
        export = parsed
    if export.WhichOneof("item") == "description":
        return pb.ImportKvRequest(start=pb.ImportKvStart(description=export.description, cache_id=cache_id or ""))
    out = pb.ImportKvRequest()
    out.chunk.CopyFrom(export.chunk)  # not ImportKvRequest(chunk=...): that serialises ~7x slower (upb)
    return out


_CHUNK_TAG = bytes([2 << 3 | 2])  # field 2, length-delimited: the oneof's chunk


def serialize_import_kv_request(message: pb.ImportKvRequest | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def import_kv_response(resp: pb.ImportKvResponse) -> ImportResult:
    return ImportResult(kv_cache=handle_from_proto(resp.kv_cache), imported_tokens=resp.imported_tokens,
                        replayed=resp.replayed, timing=timing_from_proto(resp.timing))
