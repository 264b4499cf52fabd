"""The floor of gRPC in Python: a bare grpc.aio echo server, for bench part (c).

The server answers a unary method and a bidirectional stream with a fixed payload of the
size our decode response has, doing nothing else; the client (`python -m bench.echo`, a
process of its own, as bench/grpc_client.py is) sends payloads of our request's size and
times each round trip. Our gRPC overhead at batch 1 (a step's wall time at the client minus
the executor time the server reports) is compared with these round trips, for unary calls
and for steps on a stream.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

UNARY = "/echo.Echo/Unary"
STREAM = "/echo.Echo/Stream"


def _handler(response: bytes) -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context) -> bytes:
        return response

    async def stream(requests, context):
        async for _ in requests:
            yield response

    return grpc.method_handlers_generic_handler("echo.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
    })


async def start_server(address: str, response_bytes: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(b"x" * response_bytes),))
    server.add_insecure_port(address)
    await server.start()
    return server


def echo_round_trips(loop, request_bytes: int, response_bytes: int, rounds: int) -> dict[str, float]:
    """Median round trip (s) of each method, the server on `loop` (a bench.suite.Loop, so that
    it shares its process with nothing but an event loop thread, as ours does), over a unix socket."""
    address = "unix:" + tempfile.mktemp(prefix="modelexec-echo-", suffix=".sock")
    server = loop.run(start_server(address, response_bytes))
    try:
        done = subprocess.run([sys.executable, "-m", "bench.echo", "--address", address, "--request-bytes",
                               str(request_bytes), "--rounds", str(rounds)],
                              capture_output=True, text=True, timeout=600, check=True)
        walls = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        loop.run(server.stop(0))
    return {name: statistics.median(samples) for name, samples in walls.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.echo", description="time round trips to an echo server")
    p.add_argument("--address", required=True)
    p.add_argument("--request-bytes", type=int, required=True)
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args(argv)
    payload = b"y" * args.request_bytes
    walls: dict[str, list[float]] = {"unary": [], "stream": []}
    with grpc.insecure_channel(args.address) as channel:
        unary = channel.unary_unary(UNARY)
        for r in range(args.rounds + 10):
            t0 = time.perf_counter()
            unary(payload, timeout=30)
            if r >= 10:  # the first calls warm up
                walls["unary"].append(time.perf_counter() - t0)
        # A stream as StepSession is driven: one request, wait for its answer, the next.
        stream = channel.stream_stream(STREAM)
        import queue

        requests: queue.Queue = queue.Queue()
        responses = stream(iter(requests.get, None), timeout=600)
        for r in range(args.rounds + 10):
            t0 = time.perf_counter()
            requests.put(payload)
            next(responses)
            if r >= 10:
                walls["stream"].append(time.perf_counter() - t0)
        requests.put(None)
    print(json.dumps(walls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
