"""Load: 64 concurrent clients, each prefill + 200 decode steps + release, against one server.

The server runs the paged executor in its own process on a unix socket; the clients are
asyncio tasks spread over several channels. Every call must succeed, every sequence must
be unaffected by the others (clients given the same prompt generate the same tokens), and
afterwards no KV block may be held: the pool is all free and no cache is active.
"""

from __future__ import annotations

import asyncio
import time

from client import AsyncExecutorClient, DecodeInput, LogitsPolicy, PrefillInput
from tests.server_process import serve_paged

CLIENTS = 64
CHANNELS = 8  # clients share channels 8 to one, as a scheduler's workers might
DECODE_STEPS = 200
PROMPTS = [[(7 * p + 3 * i) % 256 for i in range(12)] for p in range(4)]
CALL_TIMEOUT = 60.0  # one call, queued behind every other client's
TOTAL_TIMEOUT = 600.0  # the whole run stops by itself, whatever happens; its speed is bench/'s to measure


async def one_client(c: AsyncExecutorClient, index: int) -> list[int]:
    prompt = PROMPTS[index % len(PROMPTS)]
    greedy = LogitsPolicy.argmax()
    out = await c.prefill(PrefillInput(prompt, logits_policy=greedy))
    handle, token, tokens = out.kv_cache, out.logits.token_id, []
    for step in range(DECODE_STEPS):
        tokens.append(token)
        out = await c.decode(DecodeInput(token, handle, logits_policy=greedy))
        handle, token = out.kv_cache, out.logits.token_id
        assert handle.sequence_length == len(prompt) + step + 1
    released = await c.release_cache(handle)
    assert released.released and released.freed_blocks > 0
    return tokens


async def run_load(target: str) -> tuple[list[list[int]], float]:
    clients = [AsyncExecutorClient(target, timeout=CALL_TIMEOUT) for _ in range(CHANNELS)]
    try:
        started = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one_client(clients[i % CHANNELS], i) for i in range(CLIENTS))), TOTAL_TIMEOUT)
        return results, time.perf_counter() - started
    finally:
        for c in clients:
            await c.close()


def test_64_clients_200_decodes_each_no_errors_no_leaks():
    with serve_paged("--num-blocks", "1024", "--block-size", "16") as server:
        results, elapsed = asyncio.run(run_load(server.target))

        calls = CLIENTS * (DECODE_STEPS + 2)
        print(f"load: {CLIENTS} clients x {DECODE_STEPS} decodes on {CHANNELS} channels: {calls} calls in "
              f"{elapsed:.1f} s ({calls / elapsed:.0f} calls/s)")
        # Sequences do not disturb each other: the same prompt gives the same tokens.
        for i, tokens in enumerate(results):
            assert len(tokens) == DECODE_STEPS
            assert tokens == results[i % len(PROMPTS)], f"client {i} diverged from client {i % len(PROMPTS)}"

        async def final_status():
            async with AsyncExecutorClient(server.target) as c:
                return await c.status()

        status = asyncio.run(final_status())
        kv = status.kv_pool
        assert (kv.active_caches, kv.used_blocks, kv.free_blocks) == (0, 0, kv.total_blocks), kv
        assert status.decode_operations >= CLIENTS * DECODE_STEPS
