"""ExecutorServer: the grpc.aio server around one executor, with health and reflection."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from executors.base import ModelExecutor
from executors.coalescer import DecodeCoalescer
from executors.errors import ExecutorError
from generated.modelexec.v1 import executor_pb2 as pb
from generated.modelexec.v1 import executor_pb2_grpc as pb_grpc
from kvcache.errors import KvCacheError, KvCacheExhausted
from service.auth import Authenticator, server_credentials
from service.config import ServeConfig
from service.handlers import CallWrapper, Registrar
from service.listen import StartupError, claim_unix_socket, os_problem, tcp_bind_problem
from service.metrics import MetricsHttpServer, ServiceMetrics
from service.observability import RpcObservability
from service.servicer import ModelExecutorServicer

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelExecutorService"].full_name


def llm_config(config: ServeConfig):
    from executors.llm import LlmExecutorConfig

    return LlmExecutorConfig(
        model_dir=config.model, dtype=config.dtype, device=config.device, num_blocks=config.num_blocks,
        kv_memory_fraction=config.kv_memory_fraction, attention_backend=config.attention_backend,
        cuda_graphs=config.cuda_graphs, step_overlap=config.step_overlap, triton_fused_ops=config.triton_fused_ops,
        triton_gemv=config.triton_gemv, cpu_kernels=config.cpu_kernels,
        quantization=config.quantization,
        block_size=config.block_size, max_batch_size=config.max_batch_size, prefix_caching=config.prefix_caching,
        lora_dir=config.lora_dir, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank)


def build_executor(config: ServeConfig, world=None) -> ModelExecutor:
    """`world`: the tensor-parallel world this process is rank 0 of (executors/parallel/launch.py)."""
    if config.executor == "paged":
        from executors.paged import PagedAttentionExecutor, PagedExecutorConfig

        # The weight-free reference has no device memory to size from: unset keeps its default.
        blocks = {} if config.num_blocks is None else {"num_blocks": config.num_blocks}
        return PagedAttentionExecutor(PagedExecutorConfig(
            block_size=config.block_size, max_batch_size=config.max_batch_size,
            prefix_caching=config.prefix_caching, **blocks))
    if world is not None:
        from executors.parallel.executor import TensorParallelExecutor

        return TensorParallelExecutor(llm_config(config), world.group, launcher=world.spec.launcher,
                                      children=world.children)
    from executors.llm import LlmExecutor

    return LlmExecutor(llm_config(config))


def grpc_options(config: ServeConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # A long forward sends no frames: let clients keep the connection alive with pings
        # instead of being sent GOAWAY "too_many_pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        # Two servers must not share a port silently.
        ("grpc.so_reuseport", 0),
    ]


class ExecutorServer:
    def __init__(self, config: ServeConfig, executor: ModelExecutor | None = None, world=None) -> None:
        self.config = config
        self.executor = executor or build_executor(config, world)
        self.health = health.aio.HealthServicer()
        self.stopped = asyncio.Event()
        self.stopping = False  # a stop has begun: health is NOT_SERVING, calls in flight drain
        self._server: grpc.aio.Server | None = None
        self._reaper: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # the loop keeps only weak references
        self.address = ""
        # Read once, here: TLS files and bearer tokens (a bad one fails before anything binds).
        self.credentials = server_credentials(config)
        self.auth = Authenticator.from_config(config)
        self.metrics = ServiceMetrics(self.executor)
        self._metrics_http: MetricsHttpServer | None = None
        self.metrics_port = 0  # the bound Prometheus port once started; 0 when off

    async def start(self) -> str:
        """Bind, start serving and (unless disabled) warm up; returns the bound address.

        Raises StartupError when it cannot (the address, the metrics port, the warm-up); a
        failed or interrupted start stops what it started first."""
        cfg = self.config
        server = grpc.aio.server(options=grpc_options(cfg), maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
        try:
            await self._start(server)
        except BaseException:
            # Stopped here, on its loop: left to its __del__, the gRPC server would be stopped
            # on a loop that asyncio.run has closed by then ("Event loop is closed" noise).
            self._server = None
            await server.stop(None)
            if self._metrics_http is not None:
                await self._metrics_http.stop()
            raise
        if cfg.cache_ttl_seconds > 0 and hasattr(self.executor, "reap_idle"):
            self._reaper = asyncio.get_running_loop().create_task(self._reap_leases(cfg.cache_ttl_seconds))
        return self.address

    async def _start(self, server: grpc.aio.Server) -> None:
        cfg = self.config
        # Every method runs in one wrapper built here, once (service/handlers.py): request id,
        # metrics and log line see every outcome, auth refusals included; auth sets the
        # identity before the request is parsed and errors are mapped.
        registrar = Registrar(server, CallWrapper(RpcObservability(self.metrics), self.auth))
        # --coalesce-window-ms: RPCs see the executor through a DecodeCoalescer (decode batched).
        self.coalescer = DecodeCoalescer(
            self.executor, cfg.coalesce_window_ms / 1000,
            min(cfg.max_batch_size, self.executor.capabilities().max_batch_size)) if cfg.coalesce_window_ms > 0 else None
        servicer = ModelExecutorServicer(self.coalescer or self.executor, cfg, self._serving, self._shutdown_requested)
        pb_grpc.add_ModelExecutorServiceServicer_to_server(servicer, registrar)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registrar)
        if cfg.reflection_mode != "off":  # reflection.enable_server_reflection(..., registrar), for grpc.aio
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)), registrar)
        if cfg.unix_socket:  # right before the bind: gRPC would take a live server's socket over
            claim_unix_socket(cfg.unix_socket)
        try:
            if self.credentials is not None:
                port = server.add_secure_port(cfg.address, self.credentials)
            else:
                port = server.add_insecure_port(cfg.address)
        except RuntimeError as e:  # gRPC says "Failed to bind", not why
            why = None if cfg.unix_socket else tcp_bind_problem(cfg.host, cfg.port)
            raise StartupError(f"cannot listen on {cfg.address}: "
                               f"{why or 'gRPC cannot bind it (GRPC_VERBOSITY=debug says why)'}") from e
        self.address = cfg.address if cfg.unix_socket else f"{cfg.host}:{port}"
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if hasattr(self.executor, "add_failure_listener"):  # tensor parallelism: a rank can be lost
            loop = asyncio.get_running_loop()
            self.executor.add_failure_listener(lambda why: loop.call_soon_threadsafe(self._on_executor_failure, why))
        await server.start()
        self._server = server
        if cfg.metrics_port:
            self._metrics_http = MetricsHttpServer(self.metrics.registry)
            try:
                self.metrics_port = await self._metrics_http.start(cfg.host, cfg.metrics_port)
            except OSError as e:
                raise StartupError(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port}: {os_problem(e)}") from e
            log.info("Prometheus metrics on http://%s:%d/metrics", cfg.host, self.metrics_port)
        log.info("listening on %s (executor %s)", self.address, self.executor.name)
        if cfg.warmup_on_start:
            try:
                await self.executor.warmup()
            except (ExecutorError, KvCacheError) as e:
                raise StartupError(f"warm-up failed: {_warmup_problem(e)}") from e
            await self._serving()

    async def _reap_leases(self, ttl: float) -> None:
        # Release caches whose idle lease ran out: their clients are gone or have forgotten them.
        interval = min(max(ttl / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            try:
                expired = await self.executor.reap_idle(ttl)
            except Exception:  # a failing pass must not end the reaper
                log.exception("lease reaper")
                continue
            if expired:
                log.info("released %d caches whose %.0f s lease ran out: %s", len(expired), ttl,
                         ", ".join(expired[:10]))
                self.on_leases_expired(len(expired))

    def on_leases_expired(self, count: int) -> None:
        # Hook for metrics: called with the number of caches one reaper pass released.
        self.metrics.leases_expired.inc(count)

    async def _set_health(self, status: int) -> None:
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def _serving(self) -> None:
        if getattr(self.executor, "failure", None) is None:  # a broken executor never serves again
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def _on_executor_failure(self, why: str) -> None:
        log.error("health NOT_SERVING: %s", why)
        task = asyncio.get_running_loop().create_task(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _shutdown_requested(self, grace: float) -> None:
        log.info("Shutdown RPC: stopping with %.1f s grace", grace)
        await self.stop(grace)

    async def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING at once, refuse new calls (UNAVAILABLE), give calls in flight
        `grace` seconds, then cancel what is left and stop.

        Called again while a stop is draining (a second SIGTERM), it cancels the calls still
        in flight at once; the first call then completes the stop."""
        if self._server is None or self.stopped.is_set():
            return
        if self.stopping:
            log.info("stopping now: cancelling the calls still in flight")
            await self._server.stop(None)
            return
        self.stopping = True
        # NOT_SERVING for every service, and no later set() (a Warmup in flight) can undo it.
        await self.health.enter_graceful_shutdown()
        if self._reaper is not None:
            self._reaper.cancel()
        await self._server.stop(self.config.grace_seconds if grace is None else grace)
        if self._metrics_http is not None:
            await self._metrics_http.stop()
        if hasattr(self.executor, "close"):  # its background work (and, tensor-parallel, the other ranks)
            await asyncio.to_thread(self.executor.close)
        self.stopped.set()

    async def wait(self) -> None:
        await self.stopped.wait()


def _warmup_problem(e: Exception) -> str:
    if isinstance(e, KvCacheExhausted):  # its own text advises a client to release caches
        return (f"its prompt needs {e.blocks_needed} KV blocks and the pool has {e.total_blocks} "
                f"(--num-blocks, --block-size)")
    return str(e)


async def serve(config: ServeConfig, world=None, executor: ModelExecutor | None = None) -> None:
    """Serve until SIGTERM or SIGINT (or a Shutdown call) has stopped the server.
    `executor`: one built already (`python -m service` loads the model before the loop runs)."""
    server = ExecutorServer(config, executor, world=world)
    address = await server.start()
    print(f"modelexec: serving the {server.executor.name} executor on {address}", flush=True)
    loop = asyncio.get_running_loop()
    stops: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    def on_signal(sig: signal.Signals) -> None:
        if server.stopped.is_set():
            return
        # The first signal drains calls in flight for the grace period; a second ends it now.
        log.info("%s: %s", sig.name, "again" if server.stopping else
                 f"stopping, {config.grace_seconds:.1f} s grace for calls in flight (a second signal ends it)")
        task = loop.create_task(server.stop())
        stops.add(task)
        task.add_done_callback(stops.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await server.wait()
    # Stopped: a later signal has nothing left to stop. Ignored from here on, it cannot
    # interrupt the way out either (once the loop's handler is gone, Ctrl-C would raise
    # KeyboardInterrupt wherever the main thread is, asyncio.run's clean-up or the exit).
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    print("modelexec: stopped", flush=True)
