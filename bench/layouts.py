"""`python -m bench.layouts`: float32 decode steps through four CPU paths, side by side.

- `row-major`: torch's ops with every weight row-major (F.linear's natural layout);
- `layouts`: torch's ops with the weight layouts timed at load (executors/models/cpu_layout.py),
  what a machine without the CPU kernels runs (`--no-cpu-kernels`);
- `kernels`: executors/cpu_kernels called op by op: matmuls over the weights stored as
  6-column panels (the weights' one copy with the kernels), norms, rotations and the gated
  activation, K/V stores and decode attention read from the pool;
- `fused`: the default, the same kernels with a decode step of up to 64 rows as one call
  (executors/models/fused_decode.py).

Each variant runs in a process of its own (an executor's worker thread owns an OpenMP thread
pool that keeps spinning for a while after each step, which would slow whichever variant ran
next in the same process), on the embedded SmolLM2-135M, batch_decode steps with ARGMAX at
context ~128; the variants take turns, twice, and each keeps its better median step, reported
with the rate its weights were read at.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

VARIANTS = ("row-major", "layouts", "kernels", "fused")


def measure(variant: str, batches: list[int], steps: int) -> dict[str, float]:
    """Median in-process step (ms) at each batch size, in this process."""
    from bench.common import ARGMAX, MODEL_DIR, PROMPT_LEN, prompts
    from executors.llm import LlmExecutor, LlmExecutorConfig
    from executors.models import cpu_layout, fused_decode
    from executors.types import DecodeInput, PrefillInput

    if variant == "row-major":
        cpu_layout.wanted = lambda model: False
    fused_decode.FUSED_DECODE = variant == "fused"
    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(MODEL_DIR), num_blocks=1024, prefix_caching=False,
                                       cpu_kernels=variant in ("kernels", "fused")))
    loop = asyncio.new_event_loop()
    out = {"weight_bytes": ex._param_bytes}
    for b in batches:
        outs = loop.run_until_complete(ex.batch_prefill(
            [PrefillInput(input_ids=q, logits_policy=ARGMAX) for q in prompts(b, PROMPT_LEN, ex.vocab_size)]))
        handles, times = [o.kv_cache for o in outs], []
        for r in range(steps + 2):
            t0 = time.perf_counter()
            res = loop.run_until_complete(ex.batch_decode(
                [DecodeInput(token_id=5, kv_cache=h, logits_policy=ARGMAX) for h in handles]))
            if r >= 2:  # two warm-up steps
                times.append(time.perf_counter() - t0)
            handles = [s.kv_cache for s in res]
        for h in handles:
            loop.run_until_complete(ex.release_cache(h.cache_id))
        out[str(b)] = statistics.median(times) * 1e3
    ex.worker.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4,8,32")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--variant", choices=VARIANTS, help="measure this one variant here and print JSON")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    if args.variant:
        print(json.dumps(measure(args.variant, batches, args.steps)))
        return 0
    best: dict[str, dict[str, float]] = {}
    for _ in range(2):
        for variant in VARIANTS:
            done = subprocess.run([sys.executable, "-m", "bench.layouts", "--variant", variant, "--batches",
                                   args.batches, "--steps", str(args.steps)], capture_output=True, text=True,
                                  check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            kept = best.setdefault(variant, row)
            for b in batches:
                kept[str(b)] = min(kept[str(b)], row[str(b)])
    weight_bytes = best["fused"]["weight_bytes"]
    for b in batches:
        ms = {v: best[v][str(b)] for v in VARIANTS}
        shown = ", ".join(f"{v} {t:6.1f} ms ({weight_bytes / t / 1e6:4.1f} GB/s)" for v, t in ms.items())
        print(f"batch {b:2d}: {shown}; kernels {ms['layouts'] / ms['kernels']:.2f}x the timed layouts, fused "
              f"{ms['kernels'] / ms['fused']:.2f}x kernels", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
