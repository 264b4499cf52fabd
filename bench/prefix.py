"""The suite's `prefix` part (f): prefill of a long shared system prompt + a question, with and
without a prefix-cache hit (in-process)."""

from __future__ import annotations

from bench.common import ARGMAX, SEED, Loop, executor, prompts, timed
from executors.types import PrefillInput

SYSTEM_PROMPT_LEN = 1024
QUESTION_LEN = 32


# -- (f) prefix caching: a long shared system prompt ----------------------------------------
def bench_prefix(args, dtypes) -> list[dict]:
    """Prefill system prompt + question: cold (prefix cache emptied first) vs a hit on the
    system prompt cached by an earlier request. Same executor, interleaved, best of rounds."""
    rows = []
    rounds = 2 if args.quick else 4
    for dtype in dtypes:
        ex = executor(dtype, prefix_caching=True)
        loop = Loop()
        loop.run(ex.warmup())
        system = prompts(1, SYSTEM_PROMPT_LEN, ex.vocab_size)[0]
        questions = prompts(2 * rounds, QUESTION_LEN, ex.vocab_size, seed=SEED + 1)

        async def prefill(tokens):
            out = await ex.prefill(PrefillInput(input_ids=tokens, logits_policy=ARGMAX))
            await ex.release_cache(out.kv_cache.cache_id)

        cold, warm = [], []
        for r in range(rounds):
            loop.run(ex.worker.run(ex.kv.clear_prefix_cache))
            cold.append(timed(loop.run, prefill(system + questions[2 * r]))[0])
            saved = ex.kv.prefix_stats().saved_tokens
            warm.append(timed(loop.run, prefill(system + questions[2 * r + 1]))[0])
            reused = ex.kv.prefix_stats().saved_tokens - saved
        best_cold, best_warm = min(cold), min(warm)
        total = SYSTEM_PROMPT_LEN + QUESTION_LEN
        rows.append({"dtype": dtype, "system_len": SYSTEM_PROMPT_LEN, "question_len": QUESTION_LEN,
                     "reused_tokens": reused, "cold_ms": 1e3 * best_cold, "hit_ms": 1e3 * best_warm,
                     "cold_tok_s": total / best_cold, "speedup": best_cold / best_warm})
        loop.close()
        ex.worker.close()
        print(f"  prefix {dtype}: cold {1e3 * best_cold:.1f} ms, hit {1e3 * best_warm:.1f} ms "
              f"({reused} of {total} tokens reused), {best_cold / best_warm:.1f}x", flush=True)
    return rows
