"""`python -m bench.quantization`: what `--quantization int8` costs in accuracy and gives in
speed, on the embedded SmolLM2-135M, float32 and int8 executors side by side in one process.

- Accuracy, teacher-forced: a few English passages (and the chat template around a question)
  prefilled whole by both; at every position the int8 model's logits against float32's: the
  top-1 agreement, the largest |difference|, and the mean KL(float32 || int8) in nats.
  Then greedy generation of GREEDY_TOKENS tokens from each chat prompt: how many tokens the
  two produce alike before they part.
- Speed, in-process (no gRPC), ARGMAX: decode steps at batch 1, 8 and 32 after 128-token
  prompts, and a 128-token prefill; the two executors alternate round by round (the shared
  cores drift), medians of the rounds. Each decode step's bytes of weights streamed, over
  its time, is the achieved bandwidth (gpt-fast's habit): int8 streams 1.125 bytes a weight.

The embedded checkpoint was 4-bit (Q4_1) before it was dequantized to float32, so float32 is
the exact model and int8 requantizes it: the figures are what int8 costs that model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np
import torch

from bench.common import ARGMAX, MODEL_DIR, PROMPT_LEN, executor, machine, prompts
from executors.types import DecodeInput, DType, ForwardKind, PrefillInput

PASSAGES = (
    ("The river rose overnight, and by morning the low fields were a single sheet of brown water. "
     "Farmers stood at the edge of the road and counted what they had lost."),
    ("To compute the area of a circle, square its radius and multiply the result by pi. A circle of "
     "radius three has an area of about twenty-eight square units."),
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain.",
)
QUESTIONS = ("What is the boiling point of water?", "Write a haiku about autumn.",
             "Explain what a hash table is.", "Name three primary colors.")
GREEDY_TOKENS = 48
BATCHES = (1, 8, 32)
DECODE_STEPS = 16


def chat(tok, question: str) -> list[int]:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(text).ids


async def teacher_forced(ex, ids: list[int]) -> np.ndarray:
    """The logits at every position of ids [len, vocab]."""
    out = await ex.forward(ids, ForwardKind.LOGITS, DType.FLOAT32)
    return np.asarray(out.array, dtype=np.float64)


async def greedy(ex, ids: list[int], n: int) -> list[int]:
    out = await ex.prefill(PrefillInput(input_ids=ids, logits_policy=ARGMAX))
    tokens, handle = [out.logits.token_id], out.kv_cache
    for _ in range(n - 1):
        out = await ex.decode(DecodeInput(token_id=tokens[-1], kv_cache=handle, logits_policy=ARGMAX))
        tokens.append(out.logits.token_id)
        handle = out.kv_cache
    await ex.release_cache(handle.cache_id)
    return tokens


def accuracy(fp32, int8, tok) -> dict:
    loop = asyncio.new_event_loop()
    agree = positions = 0
    worst, kls = 0.0, []
    for ids in [tok.encode(text).ids for text in PASSAGES] + [chat(tok, q) for q in QUESTIONS]:
        a = loop.run_until_complete(teacher_forced(fp32, ids))
        b = loop.run_until_complete(teacher_forced(int8, ids))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += len(ids)
        worst = max(worst, float(np.abs(a - b).max()))
        pa, pb = _log_softmax(a), _log_softmax(b)
        kls.extend((np.exp(pa) * (pa - pb)).sum(-1).tolist())
    alike = []
    for q in QUESTIONS:
        ga = loop.run_until_complete(greedy(fp32, chat(tok, q), GREEDY_TOKENS))
        gb = loop.run_until_complete(greedy(int8, chat(tok, q), GREEDY_TOKENS))
        alike.append(next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), GREEDY_TOKENS))
    loop.close()
    return {"positions": positions, "top1_agreement": agree / positions, "max_abs_logit_diff": worst,
            "mean_kl_nats": float(np.mean(kls)), "greedy_tokens_alike": alike, "greedy_tokens": GREEDY_TOKENS}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


async def step_times(ex, batch: int, vocab: int, steps: int) -> tuple[float, float]:
    """(median decode step, the 128-token prefill of the first prompt) in seconds."""
    t0 = time.perf_counter()
    first = await ex.prefill(PrefillInput(input_ids=prompts(1, PROMPT_LEN, vocab)[0], logits_policy=ARGMAX))
    prefill = time.perf_counter() - t0
    await ex.release_cache(first.kv_cache.cache_id)
    outs = await ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX)
                                   for p in prompts(batch, PROMPT_LEN, vocab)])
    handles, times = [o.kv_cache for o in outs], []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = await ex.batch_decode([DecodeInput(token_id=5, kv_cache=h, logits_policy=ARGMAX) for h in handles])
        times.append(time.perf_counter() - t0)
        handles = [o.kv_cache for o in outs]
    for h in handles:
        await ex.release_cache(h.cache_id)
    return statistics.median(times), prefill


def speed(executors: dict, rounds: int) -> dict:
    loop = asyncio.new_event_loop()
    vocab = next(iter(executors.values())).model_config.vocab_size
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in executors}
    for ex in executors.values():
        loop.run_until_complete(step_times(ex, 1, vocab, 2))  # warm-up
    for index in range(rounds):
        order = list(executors) if index % 2 == 0 else list(executors)[::-1]
        for name in order:
            for b in BATCHES:
                step, prefill = loop.run_until_complete(step_times(executors[name], b, vocab, DECODE_STEPS))
                runs[name].setdefault(f"decode_ms_b{b}", []).append(step * 1e3)
                if b == 1:
                    runs[name].setdefault("prefill_ms", []).append(prefill * 1e3)
    loop.close()
    out = {}
    for name, ex in executors.items():
        row = {key: statistics.median(values) for key, values in runs[name].items()}
        row["weight_bytes"] = ex.parameter_bytes
        row["weights_gb_s_b1"] = ex.parameter_bytes / (row["decode_ms_b1"] / 1e3) / 1e9
        for b in BATCHES:
            row[f"tok_s_b{b}"] = b / (row[f"decode_ms_b{b}"] / 1e3)
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quantization", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="speed rounds, the executors alternating (default 3)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    executors = {"float32": executor("float32", num_blocks=1024),
                 "int8": executor("float32", num_blocks=1024, quantization="int8")}
    # One worker thread for both, so one OpenMP pool in the process: a second one would slow
    # every step of both (executors/omp_pool.py). The int8 one's own worker never started.
    executors["int8"].worker = executors["float32"].worker
    report = {"machine": machine(), "model": MODEL_DIR.name, "accuracy": accuracy(executors["float32"],
                                                                                  executors["int8"], tok),
              "speed": speed(executors, args.rounds)}
    executors["float32"].worker.close()
    acc, fast = report["accuracy"], report["speed"]
    print(f"accuracy over {acc['positions']} positions: top-1 agreement {100 * acc['top1_agreement']:.1f} %, "
          f"max |logit diff| {acc['max_abs_logit_diff']:.3f}, mean KL {acc['mean_kl_nats']:.5f} nats; greedy "
          f"tokens alike before parting (of {GREEDY_TOKENS}): {acc['greedy_tokens_alike']}")
    print(f"{'':8s} {'weights MB':>10s} {'b1 ms':>7s} {'b1 GB/s':>8s} {'b8 ms':>7s} {'b32 ms':>7s} {'b32 tok/s':>9s} "
          f"{'prefill ms':>10s}")
    for name, r in fast.items():
        print(f"{name:8s} {r['weight_bytes'] / 1e6:10.0f} {r['decode_ms_b1']:7.2f} {r['weights_gb_s_b1']:8.1f} "
              f"{r['decode_ms_b8']:7.2f} {r['decode_ms_b32']:7.2f} {r['tok_s_b32']:9.0f} {r['prefill_ms']:10.1f}")
    for b in BATCHES:
        print(f"int8 decode at batch {b}: {fast['float32'][f'decode_ms_b{b}'] / fast['int8'][f'decode_ms_b{b}']:.2f}x "
              "float32's speed")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
