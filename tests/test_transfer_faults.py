"""Faults around moving caches, against a server in a process of its own (a crash there
must fail the test, not take pytest down): callers that give up on ExportKv streams, and
an import refused while its upload is still going."""

from __future__ import annotations

import asyncio

from client import AsyncExecutorClient, ExecutorClient, PrefillInput, ResourceExhaustedError
from client.transfer import move_cache
from tests.server_process import serve_paged

PROMPT = list(range(1, 200))


def test_streams_abandoned_by_their_callers_leave_the_server_up_and_its_pool_clean():
    with serve_paged("--block-size", "16", "--num-blocks", "64") as server:
        async def drive() -> None:
            async with AsyncExecutorClient(server.target, timeout=30) as c:
                h = (await c.prefill(PrefillInput(PROMPT))).kv_cache
                for i in range(12):
                    stream = c.export_kv(h, max_chunk_bytes=256)
                    for _ in range(1 + i % 3):
                        await anext(stream)
                    await stream.aclose()  # the caller gives up mid-stream
                await c.release_cache(h)

        asyncio.run(drive())
        assert server.proc.poll() is None, server.output()[-3000:]
        with ExecutorClient(server.target) as c:
            kv = c.status().kv_pool
            assert (kv.used_blocks, kv.active_caches) == (0, 0), kv


def test_an_import_refused_mid_upload_reports_the_refusal_every_time():
    with serve_paged("--block-size", "16", "--num-blocks", "64") as src, \
            serve_paged("--block-size", "16", "--num-blocks", "4") as dst:
        async def drive() -> list[str]:
            async with AsyncExecutorClient(src.target, timeout=30) as a, \
                    AsyncExecutorClient(dst.target, timeout=30) as b:
                h = (await a.prefill(PrefillInput(PROMPT))).kv_cache
                seen = []
                for i in range(10):
                    try:
                        await move_cache(a, b, h, release_source=False, max_chunk_bytes=64 if i % 2 else 0)
                    except ResourceExhaustedError as e:
                        seen.append(e.metadata["blocks_needed"])
                await a.release_cache(h)
                return seen

        assert asyncio.run(drive()) == ["13"] * 10
        assert src.proc.poll() is None and dst.proc.poll() is None
        for server in (src, dst):
            with ExecutorClient(server.target) as c:
                assert c.status().kv_pool.used_blocks == 0
