"""`transfer` part: moving one KV cache between two servers, against recomputing it.

Two `python -m service` processes, each on a process (and port or socket) of its own: the
source and the target, on loopback TCP and then on unix sockets. This process is the mover
between them (client.transfer.move_cache: ExportKv streamed into ImportKv, the source
released), so every byte crosses two connections. For caches of 1k and 8k tokens it
reports, gpt-fast style, a move's seconds, tokens/s and GB/s (K and V bytes over seconds)
for two max_chunk_bytes; the prefill of the same prompt on the source, so a move can be
weighed against recomputing (prefill s / move s); and a plain memory copy of as many bytes
in this process, measured in the same run, as the ceiling (move GB/s / copy GB/s).

Moves go back and forth (source to target, then back), interleaving the chunk sizes, so
each server holds one copy at a time. Each figure is checked: the cache is last copied
with the source kept, both copies must export the same K and V bytes, and a decode step on
each must give the same argmax token (whether the logits are bitwise equal is reported:
the two processes' kernels need not round alike), or the part fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import time

import numpy as np

from bench.service_process import cpu_seconds, launch, stop, wait_ready

# At the service's default 16 tokens a block, a chunk never crosses a block: SmolLM2's
# 16 x 30 layers x 3 KV heads x 64 x fp32 x (K + V) = 720 KiB is the largest, so 1 MiB and
# 4 MiB would stream the same chunks. At 64 a block is 2.8 MiB: 1 MiB chunks carry 10 of
# its 30 layers, 4 MiB chunks the whole block.
BLOCK_SIZE = 64
# 8191: the model's 8192 positions less the decode step that checks the move.
SIZES = (1024, 8191)
QUICK_SIZES = (1024,)
CHUNKS = (1 << 20, 4 << 20)  # 1 MiB is the server's default
TRANSPORTS = ("tcp", "unix")
SEED = 1234


def server_args(sizes, block_size: int = BLOCK_SIZE) -> list[str]:
    """The real model in float32 on the CPU, with blocks for two copies of the largest cache."""
    per_cache = -(-(max(sizes) + 1) // block_size)
    return ["--dtype", "float32", "--device", "cpu", "--block-size", str(block_size),
            "--num-blocks", str(2 * per_cache + 8), "--no-prefix-caching", "--cache-ttl-seconds", "0"]


def memcpy_gb_s(nbytes: int, reps: int = 5) -> float:
    """A plain copy of nbytes in this process (numpy, both buffers touched first): best of reps."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


async def _kv_digest(client, handle) -> str:
    """SHA-256 over the K and V bytes an export of the whole cache streams."""
    h = hashlib.sha256()
    async for message in client.export_kv(handle):
        if message.WhichOneof("item") == "chunk":
            h.update(message.chunk.key)
            h.update(message.chunk.value)
    return h.hexdigest()


async def _check(clients, where: int, handle, token: int) -> dict:
    """Copy the cache over with the source kept: both copies must export the same K and V
    bytes, and one decode step on each must give the same argmax token."""
    from client import DecodeInput, LogitsPolicy
    from client.transfer import move_cache

    src, dst = clients[where], clients[1 - where]
    moved = await move_cache(src, dst, handle, target_id=f"{handle.cache_id}-check", release_source=False)
    kv_equal = await _kv_digest(src, handle) == await _kv_digest(dst, moved.kv_cache)
    if not kv_equal:
        raise AssertionError("the moved cache holds other K and V bytes than the source's")
    full = LogitsPolicy.full()
    a = await src.decode(DecodeInput(token, handle, logits_policy=full))
    b = await dst.decode(DecodeInput(token, moved.kv_cache, logits_policy=full))
    await src.release_cache(a.kv_cache)
    await dst.release_cache(b.kv_cache)
    la, lb = np.asarray(a.logits.logits), np.asarray(b.logits.logits)
    check = {"kv_equal": kv_equal, "argmax_source": int(la.argmax()), "argmax_moved": int(lb.argmax()),
             "logits_equal": bool(np.array_equal(la, lb)), "max_abs_diff": float(np.abs(la - lb).max())}
    if check["argmax_source"] != check["argmax_moved"]:
        raise AssertionError(f"the moved cache decodes another token than the source's: {check}")
    return check


async def _legs(clients, where: int, handle, chunk: int, rounds: int) -> dict:
    """Each half of a move alone, best of rounds: ExportKv read and dropped by the mover, and
    ImportKv fed from the messages already in the mover's memory."""
    src, dst = clients[where], clients[1 - where]
    export_s = import_s = float("inf")
    for _ in range(max(1, rounds // 2)):
        t0 = time.perf_counter()
        messages = [m async for m in src.export_kv(handle, max_chunk_bytes=chunk)]
        export_s = min(export_s, time.perf_counter() - t0)
        t0 = time.perf_counter()
        done = await dst.import_kv(messages, f"{handle.cache_id}-import")
        import_s = min(import_s, time.perf_counter() - t0)
        await dst.release_cache(done.kv_cache)
        del messages
    return {"export_only_s": export_s, "import_only_s": import_s}


async def _move(clients, pids, where: int, handle, chunk: int):
    """One move from clients[where] to the other, with the CPU seconds each of the three processes spent on it."""
    from client.transfer import move_cache

    before = [cpu_seconds(pids[where]), cpu_seconds(), cpu_seconds(pids[1 - where])]
    moved = await move_cache(clients[where], clients[1 - where], handle, max_chunk_bytes=chunk)
    after = [cpu_seconds(pids[where]), cpu_seconds(), cpu_seconds(pids[1 - where])]
    return moved, [b - a for a, b in zip(before, after)]


async def _one_size(clients, pids, transport: str, n: int, rounds: int, prefills: int, chunks, info,
                    block_size: int) -> list[dict]:
    from client import LogitsPolicy, PrefillInput
    from client.transfer import move_cache
    from executors.transfer_types import plan_chunks

    prompt = np.random.default_rng(SEED + n).integers(0, info.vocab_size, size=n).tolist()
    source = clients[0]
    times = []
    for i in range(prefills):  # best of; the last cache is kept
        t0 = time.perf_counter()
        out = await source.prefill(PrefillInput(prompt, logits_policy=LogitsPolicy.argmax()))
        times.append(time.perf_counter() - t0)
        if i + 1 < prefills:
            await source.release_cache(out.kv_cache)
    prefill_s = min(times)
    handle, where = out.kv_cache, 0
    for _ in range(2):  # warm-up: there and back
        handle, where = (await move_cache(clients[where], clients[1 - where], handle)).kv_cache, 1 - where
    samples: dict[int, list] = {c: [] for c in chunks}
    for _ in range(rounds):
        for c in chunks:  # interleaved, so a change of load on the machine touches each alike
            moved, cpu = await _move(clients, pids, where, handle, c)
            if moved.kv_cache.sequence_length != n or moved.rounds != 1:
                raise AssertionError(f"moved {moved.kv_cache.sequence_length} of {n} tokens in {moved.rounds} rounds")
            samples[c].append((moved, cpu))
            handle, where = moved.kv_cache, 1 - where
    legs = await _legs(clients, where, handle, chunks[0], rounds)
    check = await _check(clients, where, handle, out.logits.token_id)
    await clients[where].release_cache(handle)
    nbytes = samples[chunks[0]][0][0].bytes_moved
    copy = memcpy_gb_s(nbytes)
    rows = []
    for c in chunks:
        secs = [m.seconds for m, _ in samples[c]]
        cpu = [statistics.median(x[k] for _, x in samples[c]) for k in range(3)]
        move_s = statistics.median(secs)
        gb_s = nbytes / move_s / 1e9
        spans = plan_chunks(0, n, block_size, info.num_layers, nbytes // (n * info.num_layers), c)
        rows.append({"transport": transport, "tokens": n, "max_chunk_bytes": c, "bytes": nbytes,
                     "moves": len(secs), "move_s": move_s, "best_move_s": min(secs), "move_tok_s": n / move_s,
                     "gb_s": gb_s, "prefill_s": prefill_s, "prefill_tok_s": n / prefill_s,
                     "prefill_over_move": prefill_s / move_s, "memcpy_gb_s": copy, "vs_memcpy": gb_s / copy,
                     **legs, "cpu_source_s": cpu[0], "cpu_mover_s": cpu[1], "cpu_target_s": cpu[2],
                     "check": check, "loadavg": list(os.getloadavg()), "chunks_planned": len(spans)})
        print(f"  transfer {transport:4s} {n:5d} tokens, chunks <= {_size(c)}B: move {move_s * 1e3:8.1f} ms "
              f"({n / move_s:8.0f} tok/s, {gb_s:5.2f} GB/s, {100 * gb_s / copy:4.1f}% of a {copy:.1f} GB/s copy); "
              f"prefill {prefill_s * 1e3:8.1f} ms: {prefill_s / move_s:5.1f}x the move", flush=True)
    return rows


async def _pair(transport: str, servers, sizes, rounds, prefills, chunks) -> list[dict]:
    from client import AsyncExecutorClient

    clients = [AsyncExecutorClient(s.address, timeout=1800) for s in servers]
    try:
        info = await clients[0].info()
        block_size = (await clients[0].status()).kv_pool.block_size
        pids = [x.proc.pid for x in servers]
        rows = []
        for n in sizes:
            rows += await _one_size(clients, pids, transport, n, rounds, prefills(n), chunks, info, block_size)
        return rows
    finally:
        for c in clients:
            await c.close()


def run(sizes=SIZES, transports=TRANSPORTS, args: list[str] | None = None, rounds: int = 5, prefills=None,
        chunks=CHUNKS) -> list[dict]:
    """Start a source and a target per transport, measure every size on each pair in turn, stop them."""
    args = server_args(sizes) if args is None else args
    prefills = prefills or (lambda n: 1 if n > 2048 else 3)
    rows = []
    pairs = {t: [launch(t, args) for _ in range(2)] for t in transports}  # started together: idle once warm
    try:
        for servers in pairs.values():
            for s in servers:
                wait_ready(s)
        for transport, servers in pairs.items():
            rows += asyncio.run(_pair(transport, servers, sizes, rounds, prefills, chunks))
    finally:
        for servers in pairs.values():
            for s in servers:
                stop(s)
    return rows


def bench_transfer(args) -> list[dict]:
    if args.quick:
        return run(QUICK_SIZES, rounds=2, prefills=lambda n: 1)
    return run(SIZES, rounds=5)


def _size(n: int) -> str:
    return f"{n >> 20}Mi" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10}Ki" if n >= 1024 else f"{n}B"


def table_lines(rows: list[dict]) -> list[str]:
    out = [("(i) moving one KV cache between two servers (move_cache: ExportKv into ImportKv through this process, "
            "source released; medians) vs prefilling it on the source")]
    out.append(f"    {'transport':9s} {'tokens':>6s} {'chunk':>5s} {'chunks':>6s} {'MB':>6s} {'move ms':>8s} "
               f"{'tok/s':>7s} {'GB/s':>5s} {'% copy':>6s} {'prefill ms':>10s} {'prefill/move':>12s} "
               f"{'CPU s src/mover/dst':>19s}  check")
    for x in rows:
        ok = ("same KV, " if x["check"].get("kv_equal") else "") + ("same logits" if x["check"]["logits_equal"]
                            else f"same argmax (|diff| <= {x['check']['max_abs_diff']:.0e})")
        cpu = f"{x['cpu_source_s']:.2f}/{x['cpu_mover_s']:.2f}/{x['cpu_target_s']:.2f}"
        out.append(f"    {x['transport']:9s} {x['tokens']:6d} {_size(x['max_chunk_bytes']):>5s} "
                   f"{x['chunks_planned']:6d} {x['bytes'] / 1e6:6.1f} {x['move_s'] * 1e3:8.1f} {x['move_tok_s']:7.0f} {x['gb_s']:5.2f} "
                   f"{100 * x['vs_memcpy']:5.1f}% {x['prefill_s'] * 1e3:10.1f} {x['prefill_over_move']:11.1f}x "
                   f"{cpu:>19s}  {ok}")
    legs: dict = {}
    for x in rows:
        legs.setdefault((x["transport"], x["tokens"]), x)
    for (transport, n), x in legs.items():
        out.append(f"    {transport} {n} tokens, each half alone ({_size(x['max_chunk_bytes'])}B chunks, best): "
                   f"ExportKv read and dropped {x['export_only_s'] * 1e3:.1f} ms, ImportKv from memory "
                   f"{x['import_only_s'] * 1e3:.1f} ms; a plain copy here {x['memcpy_gb_s']:.1f} GB/s")
    return out
