"""`python -m bench.layouts`: float32 decode steps with the weight layouts chosen at load
(executors/models/cpu_layout.py) against every weight row-major, side by side.

Two LlmExecutors on the embedded SmolLM2-135M in one process, one built with the layout
choice switched off; the same batch_decode steps (ARGMAX, context ~128) alternate between
them, and each reports its median step in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.suite import ARGMAX, MODEL_DIR, PROMPT_LEN, prompts
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import cpu_layout
from executors.types import DecodeInput, PrefillInput


def build(choose_layouts: bool) -> LlmExecutor:
    config = LlmExecutorConfig(model_dir=str(MODEL_DIR), num_blocks=1024, prefix_caching=False)
    if choose_layouts:
        return LlmExecutor(config)
    wanted = cpu_layout.wanted
    cpu_layout.wanted = lambda model: False
    try:
        return LlmExecutor(config)
    finally:
        cpu_layout.wanted = wanted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    executors = {"row-major": build(False), "chosen": build(True)}
    loop = asyncio.new_event_loop()
    for b in (int(x) for x in args.batches.split(",")):
        handles = {}
        for name, ex in executors.items():
            outs = loop.run_until_complete(ex.batch_prefill(
                [PrefillInput(input_ids=q, logits_policy=ARGMAX) for q in prompts(b, PROMPT_LEN, ex.vocab_size)]))
            handles[name] = [o.kv_cache for o in outs]
        times: dict[str, list[float]] = {name: [] for name in executors}
        for r in range(args.rounds + 1):
            for name, ex in executors.items():
                t0 = time.perf_counter()
                steps = loop.run_until_complete(ex.batch_decode(
                    [DecodeInput(token_id=5, kv_cache=h, logits_policy=ARGMAX) for h in handles[name]]))
                if r:
                    times[name].append(time.perf_counter() - t0)
                handles[name] = [s.kv_cache for s in steps]
        for name, ex in executors.items():
            for h in handles[name]:
                loop.run_until_complete(ex.release_cache(h.cache_id))
        old, new = (statistics.median(times[n]) * 1e3 for n in ("row-major", "chosen"))
        print(f"batch {b:2d}: every weight row-major {old:6.1f} ms, chosen layouts {new:6.1f} ms: {old / new:.2f}x",
              flush=True)
    for ex in executors.values():
        ex.worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
