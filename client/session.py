"""Step sessions: many unified steps over one bidirectional StepSession stream.

A scheduler that runs step after step saves a call set-up per step this way. Steps run
in the order sent; a step that fails raises the same typed error UnifiedDecode would have,
and the session stays usable.

`step()` sends a step and waits for its result. `send()` and `receive()` keep steps in
flight: a decode step whose items set `feed_sampled_token` runs the token its cache's
previous step sampled, so it can be sent before that step's result is read, and the server
reads it, checks it and queues it while the step before still runs. The next step's
request and the last one's result then cross the network while the device works, instead of
between its steps. A sequence that stopped (an end-of-sequence token in a result read late)
has had one step too many: truncate it (TruncateKv) or release it.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Sequence
from typing import Any, Self

import grpc

from . import convert
from ._proto import executor_pb2 as pb
from .errors import ExecutorError, UnavailableError, error_class, from_rpc_error, from_status
from .types import UnifiedBatch, UnifiedBatchItem, UnifiedItemResult

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_END = object()


def step_error(err: pb.StepError) -> ExecutorError:
    code = _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
    return error_class(code)(err.message, code=code, reason=err.reason or None, metadata=dict(err.metadata),
                             domain="modelexec.v1")


def _request(step_id: int, batch: UnifiedBatch | Sequence[UnifiedBatchItem], compact: bool) -> pb.StepSessionRequest:
    request = convert.unified_decode_request(batch, compact)
    return pb.StepSessionRequest(step_id=step_id, batch=request.batch, handle_detail=request.handle_detail)


def _check_answered(unanswered: int) -> None:
    if unanswered:
        raise RuntimeError(f"step() with {unanswered} sent step(s) unanswered: receive() their results first")


def _results(resp: Any) -> list[UnifiedItemResult]:
    if resp.HasField("error"):
        raise step_error(resp.error)
    return convert.unified_decode_response(resp)


class AsyncStepSession:
    """`async with client.step_session() as s: results = await s.step(items)`."""

    def __init__(self, stub: Any, metadata: Any, timeout: float | None, compact: bool = False) -> None:
        self._call = stub.StepSession(metadata=metadata, timeout=timeout)
        self._compact = compact  # every step's handles without block ids (HANDLE_DETAIL_COMPACT)
        self._step_id = 0
        self._unanswered = 0  # steps sent whose results are not read yet
        self._lock = asyncio.Lock()  # responses match requests: one write or read at a time

    async def step(self, batch: UnifiedBatch | Sequence[UnifiedBatchItem]) -> list[UnifiedItemResult]:
        async with self._lock:
            _check_answered(self._unanswered)
            await self._write(batch)
            return await self._read()

    async def send(self, batch: UnifiedBatch | Sequence[UnifiedBatchItem]) -> int:
        """Send a step without waiting for its result (receive() reads results in the order
        sent); its step id."""
        async with self._lock:
            return await self._write(batch)

    async def receive(self) -> list[UnifiedItemResult]:
        """The result of the oldest step sent and not yet received (raising its error)."""
        async with self._lock:
            if not self._unanswered:
                raise RuntimeError("receive() with no step sent and unanswered")
            return await self._read()

    async def _write(self, batch: UnifiedBatch | Sequence[UnifiedBatchItem]) -> int:
        self._step_id += 1
        try:
            await self._call.write(_request(self._step_id, batch, self._compact))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        except asyncio.InvalidStateError:  # the call had ended: a step cancelled, a deadline, the server
            raise await self._ended() from None
        self._unanswered += 1
        return self._step_id

    async def _read(self) -> list[UnifiedItemResult]:
        self._unanswered -= 1
        try:
            resp = await self._call.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        except asyncio.InvalidStateError:
            raise await self._ended() from None
        if resp is grpc.aio.EOF:
            raise await self._ended()
        return _results(resp)

    async def _ended(self) -> ExecutorError:
        """Why the call ended, as the typed error a step raises from then on."""
        code = await self._call.code()
        if code is grpc.StatusCode.OK:
            return UnavailableError("the step session ended", code=grpc.StatusCode.UNAVAILABLE)
        return from_status(code, f"the step session ended: {await self._call.details()}",
                           await self._call.trailing_metadata())

    async def close(self) -> None:
        try:
            await self._call.done_writing()
            await self._call.code()  # the server ends the stream once our side is done
        except grpc.RpcError:
            pass  # the session is over either way

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class StepSession:
    """The blocking twin: `with client.step_session() as s: results = s.step(items)`."""

    def __init__(self, stub: Any, metadata: Any, timeout: float | None, compact: bool = False) -> None:
        self._compact = compact  # every step's handles without block ids (HANDLE_DETAIL_COMPACT)
        self._requests: queue.Queue[Any] = queue.Queue()
        self._responses = stub.StepSession(iter(self._requests.get, _END), metadata=metadata, timeout=timeout)
        self._step_id = 0
        self._unanswered = 0  # steps sent whose results are not read yet

    def step(self, batch: UnifiedBatch | Sequence[UnifiedBatchItem]) -> list[UnifiedItemResult]:
        _check_answered(self._unanswered)
        self.send(batch)
        return self.receive()

    def send(self, batch: UnifiedBatch | Sequence[UnifiedBatchItem]) -> int:
        """Send a step without waiting for its result (receive() reads results in the order
        sent); its step id."""
        self._step_id += 1
        self._requests.put(_request(self._step_id, batch, self._compact))
        self._unanswered += 1
        return self._step_id

    def receive(self) -> list[UnifiedItemResult]:
        """The result of the oldest step sent and not yet received (raising its error)."""
        if not self._unanswered:
            raise RuntimeError("receive() with no step sent and unanswered")
        self._unanswered -= 1
        try:
            resp = next(self._responses)
        except StopIteration:
            raise UnavailableError("the step session ended", code=grpc.StatusCode.UNAVAILABLE) from None
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return _results(resp)

    def close(self) -> None:
        self._requests.put(_END)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
