"""`python -m bench.handles`: what a step's KV handles cost on the wire, full against compact.

A handle lists its cache's block ids, which grow with the context: 2048 of them for 32K
tokens in 16-token blocks. Asked for with HANDLE_DETAIL_COMPACT (`compact_handles=True`), a
stepping call returns its handles without them. This runs a batch of ARGMAX decode steps on a
server over TCP loopback, the client in the same process, with the handles asked both ways
in alternating rounds, at growing numbers of ids per handle.

The model is the tiny random Qwen3 of bench/gpu.py (2 layers, hidden 64) so that a step is
mostly the service's own work, and its pool has 1-token blocks so that a handle of N ids
needs a context of N tokens, not 16 N (2048 ids: 2048 tokens here, as many as 32K tokens in
the default 16-token blocks). Reported per step: the median wall time of each form, the
executor's own time (CallTiming.executor_ns) of each, and the response's bytes. The one-step
`UnifiedDecode` is timed, and `StepSession` steps, one at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import ARGMAX, Loop, machine, prompts, serve
from bench.gpu import TINY, random_pair
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.types import PrefillInput


def executor(longest: int, batch: int) -> LlmExecutor:
    _, model = random_pair({**TINY, "max_position_embeddings": longest + 64}, "cpu", torch.float32)
    return LlmExecutor(LlmExecutorConfig(model_dir="tiny-qwen3-random", dtype="float32", device="cpu", block_size=1,
                                         num_blocks=batch * (longest + 64) + 64, max_batch_size=batch,
                                         max_sequence_length=longest + 64, prefix_caching=False), model)


def step_rows(client, ex: LlmExecutor, loop: Loop, batch: int, ids: int, rounds: int) -> list[dict]:
    """Alternating full and compact steps over `batch` caches of `ids` tokens (as many block ids)."""
    from client import LogitsPolicy, UnifiedBatchItem
    from client import convert as cconvert

    outs = loop.run(ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX)
                                      for p in prompts(batch, ids, ex.vocab_size)]))
    lengths = {o.kv_cache.cache_id: o.kv_cache.sequence_length for o in outs}
    policy = LogitsPolicy.argmax()
    times: dict[tuple[str, bool], list[float]] = {}
    executor_ms: dict[tuple[str, bool], list[float]] = {}
    sizes: dict[bool, int] = {}
    with client.step_session(compact_handles=False) as full_session, \
            client.step_session(compact_handles=True) as compact_session:
        sessions = {False: full_session, True: compact_session}
        for r in range(rounds + 1):
            for compact in (False, True) if r % 2 else (True, False):
                for call in ("UnifiedDecode", "StepSession"):
                    items = [UnifiedBatchItem(cid, [5], n, True, logits_policy=policy) for cid, n in lengths.items()]
                    request = cconvert.unified_decode_request(items, compact)
                    t0 = time.perf_counter()
                    if call == "UnifiedDecode":
                        response = client.stub.UnifiedDecode(request, timeout=60)
                        results = cconvert.unified_decode_response(response)
                        sizes[compact] = response.ByteSize()
                        spent = response.timing.executor_ns
                    else:
                        results = sessions[compact].step(items)
                        spent = None
                    wall = time.perf_counter() - t0
                    for res in results:
                        lengths[res.seq_id] = res.kv_cache.sequence_length
                    if r:  # the first round warms both forms up
                        times.setdefault((call, compact), []).append(wall * 1e3)
                        if spent is not None:
                            executor_ms.setdefault((call, compact), []).append(spent / 1e6)
    for cid in lengths:
        loop.run(ex.release_cache(cid))
    rows = []
    for call in ("UnifiedDecode", "StepSession"):
        full, compact = (statistics.median(times[(call, c)]) for c in (False, True))
        row = {"call": call, "batch": batch, "block_ids_per_handle": ids, "full_ms": round(full, 3),
               "compact_ms": round(compact, 3), "saved_ms": round(full - compact, 3), "ratio": round(full / compact, 2)}
        if call == "UnifiedDecode":
            row |= {"full_executor_ms": round(statistics.median(executor_ms[(call, False)]), 3),
                    "compact_executor_ms": round(statistics.median(executor_ms[(call, True)]), 3),
                    "full_response_bytes": sizes[False], "compact_response_bytes": sizes[True]}
        rows.append(row)
        print(f"{call:13s} batch {batch:2d}, {ids:5d} block ids a handle: full {full:7.3f} ms, compact "
              f"{compact:7.3f} ms ({full / compact:4.2f}x, {full - compact:6.3f} ms less)"
              + (f"; executor {row['full_executor_ms']:.3f} / {row['compact_executor_ms']:.3f} ms; response "
                 f"{sizes[False]} / {sizes[True]} bytes" if call == "UnifiedDecode" else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.handles", description=__doc__.split("\n\n")[0])
    p.add_argument("--ids", type=lambda s: [int(x) for x in s.split(",")], default=[16, 256, 2048],
                   help="block ids a handle (the context in 1-token blocks)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", type=Path, help="also write the rows here as JSON")
    args = p.parse_args(argv)
    from client import ExecutorClient

    torch.manual_seed(0)
    ex = executor(max(args.ids) + 4 * (args.rounds + 1) + 8, args.batch)  # four steps a round
    loop = Loop()
    server = serve(loop, ex, host="127.0.0.1", port=0)
    rows = []
    try:
        with ExecutorClient(server.address, timeout=600) as client:
            for ids in args.ids:
                rows += step_rows(client, ex, loop, args.batch, ids, args.rounds)
    finally:
        loop.run(server.stop(0))
        loop.close()
        ex.worker.close()
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
