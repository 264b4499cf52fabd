"""Bench part `offline`, on a CUDA device: nano-vllm's offline throughput benchmark.

256 requests with prompt and output lengths drawn uniformly from 100..1024 (seeded), random
token ids, each generating exactly its output length (end-of-sequence ignored), on the
Qwen3-0.6B-shaped random model in bfloat16 (bench/gpu.py).

- Ours: `python -m service --device cuda` in a process of its own (unix socket, KV pool
  sized from device memory, batch limit 256), driven by the reference scheduler
  (client/scheduler.py) in this process, every request submitted at once. Throughput is
  generated tokens over the wall time from the first submit to the last token.
- transformers on the same weights: `generate` over the same requests in one batch (left
  padding, its static cache, eager), running to the longest output; only the tokens each
  request asked for count.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import SEED
from bench.gpu import QWEN3_06B, SHAPES, random_transformers, run_dtype, sync
from bench.gpu_report import RowSink

REQUESTS = 256
LENGTHS = (100, 1024)
# All 256 requests in one generate: the fewest decode steps transformers can take for this
# workload (its static cache for 256 x ~2048 positions of the 0.6B shape is ~30 GB). Run 20's
# two batches of 128 took 178 s of an H100 for 2036 eager steps.
HF_BATCH = 256


def workload(n: int, vocab: int, lengths: tuple[int, int], seed: int = SEED) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of n requests, lengths uniform in [lo, hi]."""
    rng = np.random.default_rng(seed)
    lo, hi = lengths
    return [(rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1))).tolist(), int(rng.integers(lo, hi + 1)))
            for _ in range(n)]


async def _schedule(target: str, requests: list[tuple[list[int], int]]) -> tuple[float, int, dict]:
    from client.aio import AsyncExecutorClient
    from client.scheduler import Scheduler

    async with AsyncExecutorClient(target, timeout=600) as client:
        sched = Scheduler(client, max_num_seqs=REQUESTS, max_num_batched_tokens=8192, eos_token_ids=())
        async with sched:
            await sched.start()
            t0 = time.perf_counter()
            done = await asyncio.gather(*(sched.generate(p, max_tokens=n, ignore_eos=True) for p, n in requests))
            elapsed = time.perf_counter() - t0
            stats = {"steps": sched.stats.steps, "max_items_per_step": sched.stats.max_items_per_step,
                     "preemptions": sched.stats.preemptions}
    generated = sum(len(c.token_ids) for c in done)
    failed = [c for c in done if c.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0].error}")
    return elapsed, generated, stats


def ours(model_dir: Path, requests, device: str) -> dict:
    from bench import service_process

    server = service_process.launch("unix", [
        "--executor", "llm", "--model", str(model_dir), "--device", device,
        "--dtype", str(run_dtype(device)).removeprefix("torch."), "--max-batch-size", str(REQUESTS),
        "--cache-ttl-seconds", "0"])
    try:
        service_process.wait_ready(server, timeout=600)
        elapsed, generated, stats = asyncio.run(_schedule(server.target, requests))
    finally:
        log = server.output()
        service_process.stop(server, graceful=False)
    pool = next((line.split("KV pool: ", 1)[1] for line in log.splitlines() if "KV pool: " in line), "")
    return {"elapsed_s": elapsed, "generated": generated, "tok_s": generated / elapsed, "pool": pool, **stats}


def transformers_run(hf, requests, device: str) -> dict:
    order = sorted(range(len(requests)), key=lambda i: len(requests[i][0]))
    wanted = sum(n for _, n in requests)
    steps = 0
    sync(device)
    t0 = time.perf_counter()
    for lo in range(0, len(order), HF_BATCH):
        batch = [requests[i] for i in order[lo:lo + HF_BATCH]]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                        min_new_tokens=longest, do_sample=False, pad_token_id=0, cache_implementation="static",
                        disable_compile=True)
        steps += longest
    sync(device)
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "generated": wanted, "tok_s": wanted / elapsed, "batch": HF_BATCH,
            "decode_steps": steps}


def bench_offline(args) -> list[dict]:
    device = getattr(args, "device", "cuda")
    rows = RowSink(getattr(args, "rows_jsonl", None))
    if device.startswith("cuda") and not torch.cuda.is_available():
        rows.append({"skipped": "no GPU"})
        return rows
    shape_name = getattr(args, "shape", "qwen3-0.6b")
    shape = SHAPES[shape_name]
    n = 32 if args.quick else REQUESTS
    lengths = (10, 40) if shape is not QWEN3_06B else LENGTHS
    requests = workload(n, shape["vocab_size"], lengths)
    hf = random_transformers(shape, device, run_dtype(device))  # the server loads what it saves
    with tempfile.TemporaryDirectory(prefix="modelexec-offline-") as tmp:
        hf.save_pretrained(tmp)
        hf.to("cpu")  # its GPU memory goes to the server's pool meanwhile
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        mine = ours(Path(tmp), requests, device)
    prompt_tokens = sum(len(p) for p, _ in requests)
    rows.append({"what": "offline throughput", "engine": "ours (gRPC + reference scheduler)", "requests": n,
                 "prompt_tokens": prompt_tokens, **mine})
    print(f"  offline {n} requests ({prompt_tokens} prompt tokens): ours {mine['generated']} tokens in "
          f"{mine['elapsed_s']:.1f} s = {mine['tok_s']:.0f} tok/s ({mine['steps']} steps, up to "
          f"{mine['max_items_per_step']} sequences a step, {mine['preemptions']} preemptions)", flush=True)
    hf.to(device)
    theirs = transformers_run(hf, requests, device)
    rows.append({"what": "offline throughput", "engine": "transformers generate (static cache, eager)", "requests": n,
                 "prompt_tokens": prompt_tokens, **theirs})
    print(f"  offline: transformers {theirs['generated']} tokens in {theirs['elapsed_s']:.1f} s = "
          f"{theirs['tok_s']:.0f} tok/s; ours {mine['tok_s'] / theirs['tok_s']:.1f}x", flush=True)
    return rows

