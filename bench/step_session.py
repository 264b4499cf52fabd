"""`python -m bench.step_session`: unified steps as unary UnifiedDecode calls vs one StepSession stream.

Same server, same steps (a batch of sequences decoding greedily), over a unix socket and
TCP loopback; reports the mean wall time per step and the stream's saving per step.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from client import AsyncExecutorClient, LogitsPolicy, UnifiedBatchItem
from service.config import ServeConfig
from tests.conftest import start_server


async def run(target: str, batch: int, steps: int, streamed: bool) -> float:
    policy = LogitsPolicy.argmax()
    async with AsyncExecutorClient(target) as c:
        ids = [f"bench-{streamed}-{i}" for i in range(batch)]
        first = await c.unified_decode([UnifiedBatchItem(i, [1, 2, 3, 4], 0, True, logits_policy=policy) for i in ids])
        tokens = [r.logits.token_id for r in first]
        session = c.step_session() if streamed else None
        started = time.perf_counter()
        for k in range(steps):
            items = [UnifiedBatchItem(i, [t], 4 + k, True, logits_policy=policy) for i, t in zip(ids, tokens)]
            results = await (session.step(items) if session else c.unified_decode(items))
            tokens = [r.logits.token_id for r in results]
        elapsed = (time.perf_counter() - started) / steps
        if session:
            await session.close()
        for i in ids:
            await c.release_cache(i)
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, action="append", help="sequences per step (repeatable)")
    args = parser.parse_args()
    batches = args.batch or [1, 8]
    with tempfile.TemporaryDirectory() as tmp:
        servers = {"unix": start_server(ServeConfig(executor="paged", unix_socket=f"{tmp}/s.sock", num_blocks=4096)),
                   "tcp": start_server(ServeConfig(executor="paged", port=0, num_blocks=4096))}
        try:
            print(f"paged executor, {args.steps} greedy steps; mean ms per step")
            print(f"{'transport':9} {'batch':>5} {'unary':>9} {'stream':>9} {'saved':>9}")
            for name, running in servers.items():
                target = f"unix://{running.address[5:]}" if name == "unix" else running.address
                for b in batches:
                    asyncio.run(run(target, b, 20, False))  # warm the channel and the executor
                    unary = asyncio.run(run(target, b, args.steps, False))
                    stream = asyncio.run(run(target, b, args.steps, True))
                    print(f"{name:9} {b:5d} {unary * 1e3:9.3f} {stream * 1e3:9.3f} {(unary - stream) * 1e3:9.3f}")
        finally:
            for running in servers.values():
                running.stop()


if __name__ == "__main__":
    main()
