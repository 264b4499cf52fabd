"""Graceful shutdown: NOT_SERVING at once, calls in flight drain, new calls are refused, exit 0.

No accepted call is lost silently: each completes, or its caller gets UNAVAILABLE, CANCELLED
or DEADLINE_EXCEEDED; never UNKNOWN, never a hang. A second SIGTERM ends the grace at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import AsyncExecutorClient, ExecutorClient, ExecutorError, PrefillInput
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig
from service.config import ServeConfig
from tests.conftest import REPO, start_server
from tests.server_process import ServerProcess, serve_paged

# Asserts wall-clock bounds or orders events by sleeping: `make test` runs it alone (tests/conftest.py).
pytestmark = pytest.mark.alone

C = grpc.StatusCode
CLEAR = {C.UNAVAILABLE, C.CANCELLED, C.DEADLINE_EXCEEDED}  # what a call cut off by shutdown may get
LONG_PROMPT = 500  # tokens: ~30 ms per prefill, so 16 clients keep ~0.5 s of work queued
CLIENTS, CHANNELS = 16, 4
CALL_TIMEOUT = 20.0


@dataclass
class Outcome:
    started: float
    ended: float
    code: C  # C.OK for success


@dataclass
class Record:
    t0: float = field(default_factory=time.monotonic)
    calls: list[Outcome] = field(default_factory=list)
    health: list[tuple[float, int]] = field(default_factory=list)
    watch_end: C | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the clients may stop knocking

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def call(self, coro) -> object | None:
        started = self.now()
        try:
            out = await coro
        except ExecutorError as e:
            self.calls.append(Outcome(started, self.now(), e.code))
            return None
        self.calls.append(Outcome(started, self.now(), C.OK))
        return out

    def first_health(self, status: int) -> float:
        return next(t for t, s in self.health if s == status)


async def load(record: Record, c: AsyncExecutorClient, index: int, until: float) -> None:
    """Prefill long prompts and release them until refused; then keep knocking until done
    (or `until` seconds, whatever happens)."""
    refused = False
    while record.now() < until and not record.done.is_set():
        if refused:  # the server is going or gone: every new call must be refused cleanly
            await asyncio.sleep(0.1)
        out = await record.call(c.prefill(PrefillInput([(index + i) % 256 for i in range(LONG_PROMPT)]),
                                          timeout=CALL_TIMEOUT))
        if out is None:
            refused = True
            continue
        await record.call(c.release_cache(out.kv_cache, timeout=CALL_TIMEOUT))


async def watch_health(record: Record, target: str, *, hold: bool = False) -> None:
    """Record health changes; unless `hold`, hang up once NOT_SERVING is seen (an open Watch
    is a call in flight, and the server's drain waits for it until the grace runs out)."""
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            async for r in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120):
                record.health.append((record.now(), r.status))
                if r.status == health_pb2.HealthCheckResponse.NOT_SERVING and not hold:
                    return
        except grpc.RpcError as e:
            record.watch_end = e.code()


async def wait_exit(server: ServerProcess, timeout: float) -> int:
    return await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, timeout)


def assert_every_call_clear(record: Record) -> None:
    codes = {o.code for o in record.calls}
    assert codes <= {C.OK} | CLEAR, f"unclear outcomes: {codes - {C.OK} - CLEAR}"


async def drive_sigterm_under_load(server: ServerProcess, grace: float) -> tuple[Record, float, float, int]:
    record = Record()
    clients = [AsyncExecutorClient(server.target) for _ in range(CHANNELS)]
    watcher = asyncio.create_task(watch_health(record, server.target))
    until = 1.5 + grace + 8
    workers = [asyncio.create_task(load(record, clients[i % CHANNELS], i, until)) for i in range(CLIENTS)]
    await asyncio.sleep(1.5)  # well under way
    assert sum(o.code == C.OK for o in record.calls) > 0, "the load never got going"
    signalled = record.now()
    server.proc.send_signal(signal.SIGTERM)
    rc = await wait_exit(server, grace + 10)
    exited = record.now()
    await asyncio.sleep(1.0)  # knocking on the closed door
    record.done.set()
    await asyncio.wait_for(asyncio.gather(*workers, watcher), until + CALL_TIMEOUT)  # nothing hangs
    for c in clients:
        await c.close()
    return record, signalled, exited, rc


def test_sigterm_under_load_drains_refuses_new_calls_and_exits_0():
    grace = 10.0
    with serve_paged("--grace-seconds", str(grace), "--num-blocks", "1024") as server:
        record, signalled, exited, rc = asyncio.run(drive_sigterm_under_load(server, grace))
        log = server.output()

    assert rc == 0, log[-3000:]
    assert "modelexec: stopped" in log
    # Without a call held open, the server exits once the calls in flight are done.
    assert exited - signalled < grace, f"exited {exited - signalled:.1f} s after SIGTERM"
    assert_every_call_clear(record)
    # Health: SERVING, then NOT_SERVING as soon as the signal arrived.
    assert record.health[0][1] == health_pb2.HealthCheckResponse.SERVING
    not_serving = record.first_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    assert 0 <= not_serving - signalled < 2.0, (signalled, record.health)
    # Calls in flight at the signal drained: they completed after it, successfully.
    drained = [o for o in record.calls if o.started < signalled < o.ended and o.code == C.OK]
    assert drained, "no call in flight at SIGTERM completed"
    # Once NOT_SERVING was visible, new calls were refused with UNAVAILABLE, never served.
    late = [o for o in record.calls if o.started > not_serving + 0.5]
    assert late and all(o.code == C.UNAVAILABLE for o in late), {o.code for o in late}


async def drive_two_sigterms(server: ServerProcess) -> tuple[Record, float, float, int]:
    record = Record()
    clients = [AsyncExecutorClient(server.target) for _ in range(CHANNELS)]
    # An open Watch stream is a call in flight that never ends by itself: it holds the drain.
    watcher = asyncio.create_task(watch_health(record, server.target, hold=True))
    workers = [asyncio.create_task(load(record, clients[i % CHANNELS], i, 12.0)) for i in range(CLIENTS)]
    await asyncio.sleep(1.5)
    server.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.5)
    assert server.proc.poll() is None, "the server did not wait for the open Watch during its grace"
    second = record.now()
    server.proc.send_signal(signal.SIGTERM)
    rc = await wait_exit(server, 20)
    exited = record.now()
    record.done.set()
    await asyncio.wait_for(asyncio.gather(*workers, watcher), 12.0 + CALL_TIMEOUT)
    for c in clients:
        await c.close()
    return record, second, exited, rc


def test_a_second_sigterm_during_the_grace_stops_at_once():
    with serve_paged("--grace-seconds", "120") as server:
        record, second, exited, rc = asyncio.run(drive_two_sigterms(server))
        log = server.output()
    assert rc == 0, log[-3000:]
    assert exited - second < 5.0, f"exited {exited - second:.1f} s after the second SIGTERM"
    assert_every_call_clear(record)
    assert record.watch_end in CLEAR, record.watch_end  # the held call got a clear status too
    assert record.health[-1][1] == health_pb2.HealthCheckResponse.NOT_SERVING


class SlowPagedExecutor(PagedAttentionExecutor):
    """A quarter second per forward, so that several calls are queued when the stop comes."""

    def _forward_step(self, items):
        time.sleep(0.25)
        return super()._forward_step(items)


@pytest.mark.parametrize("grace, all_drain", [(10.0, True), (0.6, False)], ids=["drains", "grace_runs_out"])
def test_in_process_stop_drains_or_cancels_without_leaking(make_server, grace, all_drain):
    running = make_server(instance=SlowPagedExecutor(PagedExecutorConfig(block_size=4, num_blocks=64)))
    calls = 6

    async def drive() -> tuple[Record, list]:
        record = Record()
        watcher = asyncio.create_task(watch_health(record, running.address))
        async with AsyncExecutorClient(running.address) as c:
            await asyncio.sleep(0.3)  # the Watch is open
            prefills = [asyncio.create_task(record.call(c.prefill(PrefillInput([1, 2, 3, i]), timeout=CALL_TIMEOUT)))
                        for i in range(calls)]
            await asyncio.sleep(0.1)  # all sent, the first running
            stopping = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(running.server.stop(grace), running.loop))
            stopped_at = record.now()
            while not record.health or record.health[-1][1] != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert record.now() - stopped_at < 1.0, record.health  # at once, while the prefills run
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            refused = await record.call(c.prefill(PrefillInput([9]), timeout=CALL_TIMEOUT))
            assert refused is None and record.calls[-1].code == C.UNAVAILABLE
            outs = await asyncio.wait_for(asyncio.gather(*prefills), CALL_TIMEOUT)
            await asyncio.wait_for(stopping, grace + 10)
        await asyncio.wait_for(watcher, 10)
        return record, outs

    record, outs = asyncio.run(drive())
    assert running.server.stopped.is_set()
    assert_every_call_clear(record)
    served = [o for o in outs if o is not None]
    if all_drain:
        assert len(served) == calls
    else:
        assert 0 < len(served) < calls
    # No accepted call is lost silently, and none leaks: the caches that exist are exactly
    # those of the prefills whose callers got an answer (calls cut off clean up after
    # themselves on the executor's worker once their forward is done).
    executor = running.executor

    def live() -> set[str]:
        executor.kv.check_invariants()
        return set(executor.kv.cache_ids())

    deadline = time.monotonic() + 10
    while (ids := running.call(executor.worker.run(live))) != {o.kv_cache.cache_id for o in served}:
        assert time.monotonic() < deadline, (ids, [o.kv_cache.cache_id for o in served])
        time.sleep(0.1)


def test_a_stopped_server_lets_go_of_its_executor(smollm2_dir):
    """A process that goes on after stopping a server (tests, an application embedding one)
    gets the model's memory back: the weights' digest that warm-up starts in the background,
    still pending at the stop, used to keep the executor, its weights and its KV pool alive
    for good (~2 GB a server for the embedded model)."""
    running = start_server(ServeConfig(port=0, executor="llm", model=str(smollm2_dir), num_blocks=64))
    gone = weakref.ref(running.executor)
    running.stop()
    del running
    deadline = time.monotonic() + 60  # the digest already running finishes first (seconds)
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.2)
    assert gone() is None, "the stopped server's executor is still referenced"


class SlowForward(PagedAttentionExecutor):
    def __init__(self) -> None:
        super().__init__(PagedExecutorConfig(block_size=4, num_blocks=64))

    def _forward_step(self, items):
        time.sleep(0.6)  # long enough for Shutdown, then another Prefill, to queue behind it
        return super()._forward_step(items)


def test_a_call_queued_behind_shutdown_is_refused_and_leaves_the_executor_shut_down(make_server):
    """Shutdown releases every cache on the executor's worker; a call already queued behind it
    must find the executor shut down when its turn comes, not create a cache afterwards."""
    import threading

    from client import ExecutorClient, KvCacheHandle
    from executors.descriptions import ExecutorState

    executor = SlowForward()
    running = make_server(instance=executor, allow_shutdown=True, grace_seconds=5.0)
    outcomes: dict[str, object] = {}

    def call(name, fn, *args):
        with ExecutorClient(running.address, timeout=30) as c:
            try:
                outcomes[name] = getattr(c, fn)(*args)
            except ExecutorError as e:
                outcomes[name] = e

    first = threading.Thread(target=call, args=("first", "prefill", PrefillInput([1, 2, 3], KvCacheHandle("a", 0))))
    first.start()
    time.sleep(0.2)  # its forward runs
    stop = threading.Thread(target=call, args=("shutdown", "shutdown"))
    stop.start()
    time.sleep(0.2)  # queued behind the forward
    call("late", "prefill", PrefillInput([4, 5, 6], KvCacheHandle("b", 0)))
    first.join()
    stop.join()
    assert outcomes["first"].kv_cache.sequence_length == 3
    assert outcomes["shutdown"].released_caches == 1
    late = outcomes["late"]
    assert isinstance(late, ExecutorError) and late.code == C.UNAVAILABLE, late
    assert executor.stats.state is ExecutorState.SHUTDOWN and executor.kv.cache_ids() == []


def test_the_clean_up_of_a_forward_that_outlives_its_worker_is_dropped(caplog):
    """A call cut off while its forward runs queues its clean-up when the forward ends: after
    the worker closed (the server stopped, the interpreter exits), there is none to queue, and
    no "cannot schedule new futures" error either."""
    from executors.worker import SerialWorker

    worker = SerialWorker("test-abandoned")
    release = threading.Event()
    cleaned: list[object] = []

    async def cut_off() -> None:
        call = asyncio.ensure_future(worker.run(release.wait, 10, on_abandon=cleaned.append))
        await asyncio.sleep(0.1)  # running on the worker
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(cut_off())
    threading.Timer(0.2, release.set).start()  # the forward ends while close() waits for it
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        worker.close()
    assert cleaned == [] and not caplog.records, [r.getMessage() for r in caplog.records]


# `python -m service` whose forwards of more than 100 tokens take a minute (the warm-up's are short).
SLOW_SERVICE = """
import sys, time
import service.server
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig

class SlowPrompts(PagedAttentionExecutor):
    def _forward_step(self, items):
        if any(len(item.tokens) > 100 for item in items):
            time.sleep(60)
        return super()._forward_step(items)

service.server.build_executor = lambda config, world=None: SlowPrompts(PagedExecutorConfig())
sys.argv[0] = "service"
from service.__main__ import main
main()
"""


@pytest.mark.parametrize("second_signal", [False, True], ids=["sigterm", "sigterm_then_ctrl_c"])
def test_a_stopped_server_exits_at_once_while_a_forward_cut_off_still_runs(tmp_path, second_signal):
    """The grace runs out on a forward that goes on (nothing interrupts it): the process exits
    0 once stopped, not when the forward ends, without a traceback; a Ctrl-C right after
    "stopped" changes nothing."""
    sock = tmp_path / "s.sock"
    proc = subprocess.Popen([sys.executable, "-u", "-c", SLOW_SERVICE, "--executor", "paged", "--unix-socket",
                             str(sock), "--grace-seconds", "0.5"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    seen = {"modelexec: serving": threading.Event(), "modelexec: stopped": threading.Event()}

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            for what, event in seen.items():
                if what in line:
                    event.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    outcome: list[object] = []

    def long_prefill() -> None:
        with ExecutorClient(f"unix://{sock}", timeout=30) as c:
            try:
                outcome.append(c.prefill(PrefillInput(list(range(200)))))
            except ExecutorError as e:
                outcome.append(e.code)

    try:
        assert seen["modelexec: serving"].wait(60), "".join(lines)
        caller = threading.Thread(target=long_prefill)
        caller.start()
        time.sleep(0.5)  # its forward runs
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert seen["modelexec: stopped"].wait(10), "".join(lines)
        if second_signal:
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(10)
        exited = time.monotonic() - signalled
        caller.join(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    reader.join(10)
    out = "".join(lines)
    assert rc == 0 and exited < 5, (rc, exited, out)
    assert "Traceback" not in out and "cannot schedule new futures" not in out, out
    assert outcome and outcome[0] in CLEAR, outcome
