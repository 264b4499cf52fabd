"""`python -m bench.gpu_gemv`: the few-row Triton matmul against torch's at a model's shapes.

Decode at batch 1-8 reads each weight once per step; run 20 (bench/RESULTS.md) found
cuBLAS doing so at ~1 TB/s of an H100's ~3. This times executors/models/triton_gemv.py over
a few block sizes against F.linear, for each matmul of the Qwen3-0.6B shape at 1, 4 and 8
rows, and prints the device time, the bandwidth and the best configuration, so a GPU
session can decide where the kernel belongs on the serving path.

Each variant runs as one CUDA graph of calls over enough copies of the weight to overflow
the L2 cache (a step's layers each read their own weights), replayed and timed with CUDA
events: device time, back to back, as in a captured decode step. `--device cpu` is a dry
run of this code on tiny shapes in Triton's interpreter (no timing worth reading).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.gpu import QWEN3_06B

# (block_n, block_k, warps, split): run 24's winner (4x512), the long tiles and the split-K shapes
# that few_row_matmuls.py tries, and two wide tiles for comparison.
CONFIGS = ((4, 512, 4, 1), (4, 1024, 4, 1), (4, 2048, 8, 1), (8, 1024, 8, 1), (8, 256, 4, 4), (8, 512, 4, 4),
           (16, 256, 4, 8), (16, 256, 4, 1), (32, 512, 8, 1))
L2_FLUSH_BYTES = 256 << 20


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of the step's matmuls: q/k/v fused, o, gate/up fused, down, the lm_head."""
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (cfg["vocab_size"], h)}


def time_calls(fn, copies: int, cuda: bool) -> float:
    """Microseconds per call: one graph of `copies` calls, replayed (wall time on a CPU)."""
    if not cuda:
        t0 = time.perf_counter()
        for c in range(copies):
            fn(c)
        return (time.perf_counter() - t0) / copies * 1e6
    for c in range(copies):  # compile and warm up outside the capture
        fn(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(copies):
            fn(c)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times[2:])


def bench(device: str, cfg: dict, rows: tuple[int, ...], configs) -> list[dict]:
    from executors.models.triton_gemv import gemv

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    results = []
    for name, (n, k) in shapes(cfg).items():
        nbytes = n * k * (2 if cuda else 4)
        copies = max(2, -(-L2_FLUSH_BYTES // nbytes)) if cuda else 2
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            want = torch.nn.functional.linear(x, weights[0]).float()
            torch_us = time_calls(lambda c, x=x, ws=weights: torch.nn.functional.linear(x, ws[c]), copies, cuda)
            row = {"matmul": name, "n": n, "k": k, "rows": m, "weight_mb": nbytes / 1e6, "torch_us": torch_us,
                   "torch_gb_s": nbytes / torch_us / 1e3, "triton": {}}
            for block_n, block_k, warps, split in configs:
                key = f"{block_n}x{block_k}/{warps}" + (f" split {split}" if split > 1 else "")
                try:
                    got = gemv(x, weights[0], block_n=block_n, block_k=block_k, num_warps=warps, split=split).float()
                    err = ((got - want).norm() / want.norm()).item()
                    us = time_calls(lambda c, x=x, ws=weights, bn=block_n, bk=block_k, w=warps, s=split:
                                    gemv(x, ws[c], block_n=bn, block_k=bk, num_warps=w, split=s), copies, cuda)
                    row["triton"][key] = {"us": us, "gb_s": nbytes / us / 1e3, "rel_err": err}
                except Exception as e:  # noqa: BLE001 - a configuration that cannot build is a result too
                    row["triton"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
            timed = {c: r for c, r in row["triton"].items() if "us" in r}
            if timed:
                best = min(timed, key=lambda c: timed[c]["us"])
                row["best"] = best
                row["speedup"] = torch_us / timed[best]["us"]
                print(f"  {name:8s} {n:6d}x{k:<5d} rows {m}: torch {torch_us:7.2f} us ({row['torch_gb_s']:5.0f} GB/s), "
                      f"triton {best} {timed[best]['us']:7.2f} us ({timed[best]['gb_s']:5.0f} GB/s, err "
                      f"{timed[best]['rel_err']:.1e}): {row['speedup']:.2f}x", flush=True)
            results.append(row)
        del weights
        if cuda:
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("skipped: no GPU (--device cpu runs this code on tiny shapes)")
        return 0
    if cuda:
        cfg, rows, configs = QWEN3_06B, (1, 4, 8), CONFIGS
    else:
        cfg = {"hidden_size": 64, "head_dim": 16, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 80}
        rows, configs = (1, 3), ((16, 32, 4, 1), (8, 32, 4, 3))
    results = bench(args.device, cfg, rows, configs)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
