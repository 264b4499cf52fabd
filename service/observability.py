"""Metrics, request ids and one structured log line per RPC.

- Prometheus (`--metrics-port N`, on --host; 0 is off): a registry of the server's own
  (never the process-global one), served by a small asyncio HTTP endpoint at /metrics on
  the server's event loop. Series:

    modelexec_rpc_requests_total{method,code}        RPCs finished, by method and status code
    modelexec_rpc_duration_seconds{method,code}      latency histogram (_bucket, _sum, _count)
    modelexec_rpc_in_flight                          RPCs being handled now
    modelexec_tokens_processed_total{kind}           tokens of successful calls; kind is
                                                     prefill, decode, verify or forward
                                                     (tokens/s: rate() of it)
    modelexec_batch_items{method}                    items per BatchPrefill/BatchDecode/UnifiedDecode
    modelexec_kv_blocks_used / _free / _total        KV pool, read from executor.status() per scrape
    modelexec_kv_active_caches                       caches held, likewise
    modelexec_kv_leases_expired_total                caches reclaimed after their lease ran out
    modelexec_rank_memory_bytes{rank,kind}           memory per tensor-parallel rank, from
                                                     executor.status().ranks per scrape; kind is
                                                     parameters, kv_pool, lora, device_allocated
                                                     or device_peak (absent for one process)

- Request ids: the caller's `x-request-id` metadata (1-128 visible ASCII characters), else a
  fresh uuid4 hex, sent back first thing in the response's initial metadata, so a caller
  reads it from `call.initial_metadata()` whether the call succeeds or fails.
- Logs: one line per RPC on the logger "modelexec.rpc" (method, code, duration_ms,
  request_id, identity, peer); `--log-format json` writes every log record as one JSON
  object per line.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from executors.base import ModelExecutor
from executors.identity import current_identity

REQUEST_ID = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
SERVICE_PREFIX = "/modelexec.v1.ModelExecutorService/"
# Streams of steps: each request is booked like one call of this unary method.
STREAMED_STEPS = {"StepSession": "UnifiedDecode"}
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
rpc_log = logging.getLogger("modelexec.rpc")
log = logging.getLogger(__name__)


# -- metrics ---------------------------------------------------------------------------------
class EventCount:
    """A thread-safe count with `inc()`, for events the executor side reports (see leases_expired)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def inc(self, amount: int = 1) -> None:
        with self._lock:
            self._value += amount

    @property
    def value(self) -> int:
        return self._value


# modelexec_rank_memory_bytes{kind}: the RankMemory field each kind reads.
RANK_MEMORY_KINDS = (
    ("parameters", "parameter_bytes"),
    ("kv_pool", "kv_pool_bytes"),
    ("lora", "lora_bytes"),
    ("device_allocated", "device_allocated_bytes"),
    ("device_peak", "device_peak_bytes"),
)


class _ExecutorCollector(Collector):
    """Gauges read from executor.status() when Prometheus scrapes."""

    def __init__(self, executor: ModelExecutor, leases_expired: EventCount) -> None:
        self.executor = executor
        self.leases_expired = leases_expired

    def collect(self) -> Iterable[Any]:
        try:
            status = self.executor.status()
        except Exception:  # a scrape must not fail because the executor did
            log.exception("executor.status() failed during a metrics scrape")
            return
        kv = status.kv_pool
        for name, doc, value in (
            ("modelexec_kv_blocks_used", "KV cache blocks in use.", kv.used_blocks),
            ("modelexec_kv_blocks_free", "KV cache blocks free.", kv.free_blocks),
            ("modelexec_kv_blocks_total", "KV cache blocks in the pool.", kv.total_blocks),
            ("modelexec_kv_active_caches", "KV caches held.", kv.active_caches),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("modelexec_kv_leases_expired", "KV caches released because their lease expired.",
                                  value=self.leases_expired.value)
        if status.ranks:  # tensor parallelism only: a single process reports no ranks
            ranks = GaugeMetricFamily("modelexec_rank_memory_bytes",
                                      "Memory of each tensor-parallel rank in bytes, by rank and kind (parameters, "
                                      "kv_pool, lora, device_allocated, device_peak).", labels=["rank", "kind"])
            for m in status.ranks:
                for kind, attr in RANK_MEMORY_KINDS:
                    ranks.add_metric([str(m.rank), kind], getattr(m, attr))
            yield ranks


class ServiceMetrics:
    """The server's Prometheus series, in a registry of its own."""

    def __init__(self, executor: ModelExecutor) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("modelexec_rpc_requests", "RPCs finished, by method and status code.",
                                ["method", "code"], registry=r)
        self.latency = Histogram("modelexec_rpc_duration_seconds", "RPC latency in seconds, by method and status code.",
                                 ["method", "code"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("modelexec_rpc_in_flight", "RPCs being handled.", registry=r)
        self.tokens = Counter("modelexec_tokens_processed", "Tokens processed by successful calls, by kind "
                              "(prefill, decode, verify, forward).", ["kind"], registry=r)
        self.batch_items = Histogram("modelexec_batch_items", "Items per batch call.", ["method"],
                                     buckets=BATCH_BUCKETS, registry=r)
        # The hook for lease expiry: ExecutorServer.on_leases_expired(n) calls
        # `self.metrics.leases_expired.inc(n)` (thread-safe, callable from any thread);
        # exported as modelexec_kv_leases_expired_total.
        self.leases_expired = EventCount()
        r.register(_ExecutorCollector(executor, self.leases_expired))
        self._tokens: dict[str, Any] = {}  # label children, bound at first use
        self._batch_items: dict[str, Any] = {}

    def record_rpc(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method, code).inc()
        self.latency.labels(method, code).observe(seconds)

    def record_work(self, name: str, request: Any, batch_label: str | None = None) -> None:
        """Tokens and batch size of a successful ModelExecutorService call (or stream step)."""
        count = WORK.get(name)
        if count is None or not isinstance(request, Message):
            return
        tokens, batch = count(request)
        for kind, n in tokens:
            if n:
                counter = self._tokens.get(kind)
                if counter is None:
                    counter = self._tokens[kind] = self.tokens.labels(kind)
                counter.inc(n)
        if batch is not None:
            label = batch_label or name
            histogram = self._batch_items.get(label)
            if histogram is None:
                histogram = self._batch_items[label] = self.batch_items.labels(label)
            histogram.observe(batch)


# The work of each ModelExecutorService method: ((kind, tokens), ...) and its batch size.
def _unified_work(request: Any) -> tuple[tuple[tuple[str, int], ...], int]:
    # A one-token item continuing a cache is a decode step; anything else a prefill chunk.
    items = request.batch.items
    decode = sum(1 for i in items if len(i.q_tokens) == 1 and i.pos_offset > 0)
    return (("decode", decode), ("prefill", sum(len(i.q_tokens) for i in items) - decode)), len(items)


WORK: dict[str, Callable[[Any], tuple[tuple[tuple[str, int], ...], int | None]]] = {
    "Prefill": lambda r: ((("prefill", len(r.input.input_ids)),), None),
    "BatchPrefill": lambda r: ((("prefill", sum(len(i.input_ids) for i in r.inputs)),), len(r.inputs)),
    "Decode": lambda r: ((("decode", 1),), None),
    "BatchDecode": lambda r: ((("decode", len(r.inputs)),), len(r.inputs)),
    "UnifiedDecode": _unified_work,
    "ForwardVerify": lambda r: ((("verify", len(r.tokens)),), None),
    "Forward": lambda r: ((("forward", len(r.input_ids)),), None),
}


class MetricsHttpServer:
    """GET /metrics on an asyncio server: scrapes run on the server's event loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split()
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
            method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
            elif path not in ("/metrics", "/"):
                status, ctype, body = "404 Not Found", "text/plain", b"metrics are at /metrics\n"
            else:
                encoder, ctype = choose_encoder(headers.get("accept", ""))
                status, body = "200 OK", encoder(self.registry)
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode("latin-1"))
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


# -- request ids and the per-RPC log line ------------------------------------------------------
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


# -- log format ------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, and an RPC's fields when present."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
        }
        rpc = getattr(record, "rpc", None)
        if isinstance(rpc, dict):
            out.update(rpc)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Log to stderr, as text lines or as one JSON object per line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Every RPC in JSON logs; only the failed ones in text logs.
    rpc_log.setLevel(logging.DEBUG if log_format == "json" else logging.NOTSET)
