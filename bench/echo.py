"""The floor of gRPC in Python: a bare grpc.aio echo server, for bench part (c).

The server answers a unary method and a bidirectional stream with a fixed payload of the
size our decode response has, doing nothing else; the client (`python -m bench.echo`, a
process of its own, as bench/grpc_client.py is) sends payloads of our request's size and
times each round trip. Our gRPC overhead at batch 1 (a step's wall time at the client minus
the executor time the server reports) is compared with these round trips, for unary calls
and for steps on a stream.

With `step_s`, two more methods answer only after waiting that long on a worker thread (as
our executor's step runs on its own), the response's first 8 bytes holding the nanoseconds
from the worker's start of the job to the event loop's resumption (the span of our
executor time), which the client subtracts as it subtracts our executor time: a round trip that idled for a model step costs far more than
one answered at once (the event loop, gRPC's threads and the client all go to sleep, their
caches go cold), and that part of our overhead is gRPC's and the machine's, not our code's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

UNARY = "/echo.Echo/Unary"
STREAM = "/echo.Echo/Stream"
UNARY_AFTER = "/echo.Echo/UnaryAfterStep"
STREAM_AFTER = "/echo.Echo/StreamAfterStep"


def _handler(response: bytes, step_s: float, worker: ThreadPoolExecutor) -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context) -> bytes:
        return response

    async def stream(requests, context):
        async for _ in requests:
            yield response

    async def after_step() -> bytes:
        # The response, its first 8 bytes the time from the worker's start of the job to the
        # loop's resumption: the span our executor_ns covers (executors/worker.py), so that
        # both sides subtract the same part and the hand-off to the worker counts on both.
        started: list[int] = []

        def step() -> None:
            started.append(time.perf_counter_ns())
            time.sleep(step_s)

        await asyncio.wrap_future(worker.submit(step))
        return struct.pack("<q", time.perf_counter_ns() - started[0]) + response[8:]

    async def unary_after(request: bytes, context) -> bytes:
        return await after_step()

    async def stream_after(requests, context):
        async for _ in requests:
            yield await after_step()

    return grpc.method_handlers_generic_handler("echo.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
        "UnaryAfterStep": grpc.unary_unary_rpc_method_handler(unary_after),
        "StreamAfterStep": grpc.stream_stream_rpc_method_handler(stream_after),
    })


async def start_server(address: str, response_bytes: int, step_s: float = 0.0) -> grpc.aio.Server:
    server = grpc.aio.server()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="echo-step")
    server.add_generic_rpc_handlers((_handler(b"x" * max(response_bytes, 8), step_s, worker),))
    server.add_insecure_port(address)
    await server.start()
    return server


def echo_round_trips(loop, request_bytes: int, response_bytes: int, rounds: int, step_s: float = 0.0,
                     step_rounds: int = 40) -> dict[str, float]:
    """Median round trip (s) of each method, the server on `loop` (a bench.suite.Loop, so that
    it shares its process with nothing but an event loop thread, as ours does), over a unix
    socket: "unary" and "stream"; with `step_s`, also "unary after step" and "stream after
    step" (`step_rounds` each), the wait on the worker thread subtracted."""
    address = "unix:" + tempfile.mktemp(prefix="modelexec-echo-", suffix=".sock")
    server = loop.run(start_server(address, response_bytes, step_s))
    try:
        done = subprocess.run([sys.executable, "-m", "bench.echo", "--address", address, "--request-bytes",
                               str(request_bytes), "--rounds", str(rounds)]
                              + (["--step-rounds", str(step_rounds)] if step_s > 0 else []),
                              capture_output=True, text=True, timeout=600, check=True)
        walls = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        loop.run(server.stop(0))
    return {name: statistics.median(samples) for name, samples in walls.items()}


def _round_trips(channel: grpc.Channel, payload: bytes, unary_method: str, stream_method: str, rounds: int,
                 after_step: bool) -> tuple[list[float], list[float]]:
    def wall(t0: float, response: bytes) -> float:
        w = time.perf_counter() - t0
        return w - struct.unpack("<q", response[:8])[0] / 1e9 if after_step else w

    unary_walls, stream_walls = [], []
    unary = channel.unary_unary(unary_method)
    for r in range(rounds + 10):
        t0 = time.perf_counter()
        w = wall(t0, unary(payload, timeout=30))
        if r >= 10:  # the first calls warm up
            unary_walls.append(w)
    # A stream as StepSession is driven: one request, wait for its answer, the next.
    requests: queue.Queue = queue.Queue()
    responses = channel.stream_stream(stream_method)(iter(requests.get, None), timeout=600)
    for r in range(rounds + 10):
        t0 = time.perf_counter()
        requests.put(payload)
        w = wall(t0, next(responses))
        if r >= 10:
            stream_walls.append(w)
    requests.put(None)
    return unary_walls, stream_walls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.echo", description="time round trips to an echo server")
    p.add_argument("--address", required=True)
    p.add_argument("--request-bytes", type=int, required=True)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--step-rounds", type=int, default=0, help="also time the methods answering after a step")
    args = p.parse_args(argv)
    payload = b"y" * args.request_bytes
    walls: dict[str, list[float]] = {}
    with grpc.insecure_channel(args.address) as channel:
        walls["unary"], walls["stream"] = _round_trips(channel, payload, UNARY, STREAM, args.rounds, False)
        if args.step_rounds:
            walls["unary after step"], walls["stream after step"] = _round_trips(
                channel, payload, UNARY_AFTER, STREAM_AFTER, args.step_rounds, True)
    print(json.dumps(walls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
