"""Request ids and one structured log line per RPC, and the metrics each RPC books.

- Request ids: the caller's `x-request-id` metadata (1-128 visible ASCII characters), else a
  fresh uuid4 hex, sent back first thing in the response's initial metadata, so a caller
  reads it from `call.initial_metadata()` whether the call succeeds or fails.
- Logs: one line per RPC on the logger "modelexec.rpc" (method, code, duration_ms,
  request_id, identity, peer); service/logs.py formats them.
- Metrics: each RPC's count, latency and work, in the series of service/metrics.py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
import uuid
from collections.abc import Iterable
from typing import Any

import grpc

from executors.identity import current_identity
from service.logs import rpc_log
from service.metrics import WORK, ServiceMetrics

REQUEST_ID = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
SERVICE_PREFIX = "/modelexec.v1.ModelExecutorService/"
# Streams of steps: each request is booked like one call of this unary method.
STREAMED_STEPS = {"StepSession": "UnifiedDecode"}


async def remembered(requests: Any, pending: collections.deque[Any]) -> Any:
    """The request stream, each request also appended to `pending` (to book its step)."""
    async for request in requests:
        pending.append(request)
        yield request


def request_id(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The caller's x-request-id when it is sane, else a new uuid4 hex."""
    for key, value in metadata or ():
        if key == REQUEST_ID and isinstance(value, str) and _VALID_REQUEST_ID.fullmatch(value):
            return value
    return uuid.uuid4().hex


def _code_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    # A stream closed by its caller ends here as CancelledError, or as GeneratorExit when
    # grpc closes the handler's generator later; the call may be gone by then, and its
    # context must not be read (grpc.aio crashes the process on context.peer() there).
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    code = context.code()
    if code is None:
        return "OK" if error is None else "UNKNOWN"
    if isinstance(code, grpc.StatusCode):
        return code.name
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


class RpcObservability:
    """Request id, metrics and the log line of every RPC: the outermost part of the wrapper
    every method runs in (service.handlers), which asks for one MethodObserver per method."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def observer(self, method: str, streams_responses: bool) -> MethodObserver:
        return MethodObserver(self.metrics, method, streams_responses)


class MethodObserver:
    """One method's bookkeeping, its metric children bound once: begin(), then end() with
    the outcome; work(request) books a successful call's tokens, step(request) a step's."""

    __slots__ = ("_ok", "metrics", "name", "step_name", "work_name")

    def __init__(self, metrics: ServiceMetrics, method: str, streams_responses: bool) -> None:
        self.metrics = metrics
        self.name = method.lstrip("/")
        self.work_name = method.removeprefix(SERVICE_PREFIX) if method.startswith(SERVICE_PREFIX) else None
        # Streams of steps: each request is booked like one call of this unary method.
        self.step_name = STREAMED_STEPS.get(self.work_name) if streams_responses else None
        self._ok: tuple[Any, Any] | None = None  # (requests, latency) children for code OK

    def begin(self) -> float:
        self.metrics.in_flight.inc()
        return time.perf_counter()

    def work(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Book the tokens of a call that succeeded (its handler may also have set a code)."""
        if self.work_name in WORK and context.code() in (None, grpc.StatusCode.OK):
            self.metrics.record_work(self.work_name, request)

    def step(self, request: Any) -> None:
        self.metrics.record_work(self.step_name, request, batch_label=self.work_name)

    def end(self, rid: str, peer: str, context: grpc.aio.ServicerContext, started: float,
            error: BaseException | None) -> None:
        seconds = time.perf_counter() - started
        metrics = self.metrics
        metrics.in_flight.dec()
        code = _code_name(context, error)
        if code == "OK":
            if self._ok is None:
                self._ok = (metrics.requests.labels(self.name, code), metrics.latency.labels(self.name, code))
            self._ok[0].inc()
            self._ok[1].observe(seconds)
        else:
            metrics.record_rpc(self.name, code, seconds)
        # Successful calls log at DEBUG: a text console at decode rates would drown in them.
        # configure_logging lets them through for JSON logs, which machines read.
        level = logging.DEBUG if code == "OK" else logging.INFO
        if rpc_log.isEnabledFor(level):
            fields = {"method": self.name, "code": code, "duration_ms": round(seconds * 1e3, 3), "request_id": rid,
                      "identity": current_identity.get(), "peer": peer}
            rpc_log.log(level, "%s %s %.3f ms request_id=%s identity=%s peer=%s", self.name, code,
                        fields["duration_ms"], rid, fields["identity"], fields["peer"], extra={"rpc": fields})
