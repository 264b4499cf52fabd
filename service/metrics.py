"""The server's Prometheus series, in a registry of its own (never the process-global one),
served by a small asyncio HTTP endpoint at /metrics on the server's event loop
(`--metrics-port N`, on --host; 0 is off). Series:

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

What each RPC books is decided per call by service/observability.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from executors.base import ModelExecutor
from service.convert import item_tokens

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
log = logging.getLogger(__name__)


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
    decode = sum(1 for i in items if item_tokens(i) == 1 and i.pos_offset > 0)
    tokens = sum(map(item_tokens, items))
    return (("decode", decode), ("prefill", tokens - decode)), len(items)


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
