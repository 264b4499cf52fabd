"""The asyncio client's calls that move a cache between servers: ExportKv's stream out of one,
ImportKv's upload into another (client.transfer and client.drain build moves and drains on
them). AsyncExecutorClient inherits them; they use its channel, stub and config.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import grpc

from . import convert
from ._common import USE_DEFAULT, Timeout
from ._proto import executor_pb2 as pb
from .errors import AbortedError, ExecutorError, from_rpc_error
from .types import ImportResult, KvCacheHandle

_EXPORT_KV = "/modelexec.v1.ModelExecutorService/ExportKv"
_IMPORT_KV = "/modelexec.v1.ModelExecutorService/ImportKv"


class KvMoveCalls:
    """ExportKv and ImportKv on an AsyncExecutorClient (self.channel, self.stub, self._config)."""

    async def export_kv(
        self, cache: KvCacheHandle | str, start: int | None = None, end: int | None = None, *,
        max_chunk_bytes: int = 0, raw: bool = False, timeout: Timeout = USE_DEFAULT,
    ) -> AsyncIterator[pb.ExportKvResponse | bytes]:
        """The ExportKv stream of positions [start, end) of a cache: its description, then
        its chunks. Read it to the end (or pass it to import_kv) to release the snapshot.
        raw=True yields each message still serialized, for import_kv to forward unparsed."""
        method = (self.channel.unary_stream(_EXPORT_KV, request_serializer=pb.ExportKvRequest.SerializeToString,
                                            response_deserializer=None) if raw else self.stub.ExportKv)
        call = method(convert.export_kv_request(cache, start, end, max_chunk_bytes),
                      timeout=self._config.deadline(timeout), metadata=self._config.metadata)
        try:
            async for message in call:
                yield message
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def import_kv(
        self, export: AsyncIterable[pb.ExportKvResponse | bytes] | Iterable[pb.ExportKvResponse | bytes],
        cache_id: str | None = None, *, timeout: Timeout = USE_DEFAULT,
    ) -> ImportResult:
        """Create a cache (named cache_id, or server-chosen when None) from an ExportKv stream
        (this client's `export_kv` on another server, or its messages in a list); a stream
        starting past position 0 extends cache_id. Serialized messages (export_kv(raw=True))
        are forwarded as they are: a chunk's bytes are the same in both RPCs' messages."""
        first: list[pb.ImportKvRequest] = []
        failed: list[Exception] = []  # what the stream fed in raised (an export's error, say)
        messages = export if isinstance(export, AsyncIterable) else _aiter(export)

        async def requests() -> AsyncIterator[pb.ImportKvRequest]:
            try:
                async for message in messages:
                    request = convert.import_kv_request(message, cache_id)
                    if not first:
                        first.append(request)
                    yield request
            except Exception as e:
                failed.append(e)  # grpc.aio only cancels the call: re-raised below
                raise

        upload = requests()
        method = self.channel.stream_unary(_IMPORT_KV, request_serializer=convert.serialize_import_kv_request,
                                           response_deserializer=pb.ImportKvResponse.FromString)
        call = method(upload, timeout=self._config.deadline(timeout), metadata=self._config.metadata)
        try:
            resp = await call
        except grpc.RpcError as e:
            if failed:
                raise failed[0] from e
            if e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL) and first:
                raise await self._why_import_ended(first[0], timeout) from e
            raise from_rpc_error(e) from e
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # our own caller cancelled us
            if failed:
                raise failed[0] from None
            if not first:
                raise
            raise await self._why_import_ended(first[0], timeout) from None
        finally:
            # An import that ended early leaves the export stream open (its server holding a
            # snapshot, its call a slot) until collected: close both now.
            await _close(upload, messages)
        return convert.import_kv_response(resp)

    async def _why_import_ended(self, start: pb.ImportKvRequest, timeout: Timeout) -> ExecutorError:
        """A server that refuses an import after its first message ends the call while the
        upload goes on, and grpc.aio then reports the interrupted upload (CANCELLED, or
        INTERNAL) instead of the server's status. Asking again with check_only (one message,
        nothing kept) gets that status; if the start is accepted now, the stream failed
        later: ABORTED, worth a retry."""
        check = pb.ImportKvRequest()
        check.CopyFrom(start)
        check.start.check_only = True
        try:
            await self.stub.ImportKv(iter([check]), timeout=self._config.deadline(timeout),
                                     metadata=self._config.metadata)
        except grpc.RpcError as e:
            return from_rpc_error(e)
        return AbortedError("the target ended the import before it had read the whole stream, and would accept "
                            "its start now: retry the move", reason="KV_IMPORT_INTERRUPTED")


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def _close(*generators: Any) -> None:
    """aclose() each async generator; one grpc.aio's request poller is still iterating stops
    at its next write, so it is retried for a while (~1 s)."""
    for gen in generators:
        aclose = getattr(gen, "aclose", None)
        for _ in range(100):
            if aclose is None:
                break
            try:
                await aclose()
                break
            except RuntimeError:  # "asynchronous generator is already running"
                await asyncio.sleep(0.01)
