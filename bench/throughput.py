"""The suite's throughput parts on the embedded model: (a) `prefill`, one batch_prefill call vs
serial prefill calls; (b) `decode`, tokens/s and memory bandwidth over gRPC (unix socket); (d) `hf`,
ours vs transformers on the same weights."""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from bench.common import ARGMAX, MODEL_DIR, PROMPT_LEN, SEED, Loop, executor, prompts, serve, timed, weight_bytes
from executors.omp_pool import in_passing_thread
from executors.types import DecodeInput, PrefillInput


# -- (a) prefill: one batch_prefill call vs serial prefill calls -----------------------------
def bench_prefill(args, dtypes) -> list[dict]:
    rows = []
    n = 8 if args.quick else 32
    for dtype in dtypes:
        ex = executor(dtype)
        loop = Loop()
        batch = [PrefillInput(input_ids=p, logits_policy=ARGMAX) for p in prompts(n, PROMPT_LEN, ex.vocab_size)]

        async def one_call():
            outs = await ex.batch_prefill(batch)
            for o in outs:
                await ex.release_cache(o.kv_cache.cache_id)

        async def serial():
            for b in batch:
                o = await ex.prefill(b)
                await ex.release_cache(o.kv_cache.cache_id)

        loop.run(ex.warmup())
        best_b, best_s = float("inf"), float("inf")
        for _ in range(1 if args.quick else 2):  # interleaved, best of
            best_b = min(best_b, timed(loop.run, one_call())[0])
            best_s = min(best_s, timed(loop.run, serial())[0])
        tokens = n * PROMPT_LEN
        rows.append({"dtype": dtype, "prompts": n, "prompt_len": PROMPT_LEN, "batched_s": best_b, "serial_s": best_s,
                     "batched_tok_s": tokens / best_b, "serial_tok_s": tokens / best_s, "ratio": best_s / best_b})
        loop.close()
        ex.worker.close()
        print(f"  prefill {dtype}: batched {best_b:.2f} s, serial {best_s:.2f} s, ratio {best_s / best_b:.2f}x",
              flush=True)
    return rows


# -- (b) decode throughput over gRPC (unix socket) -------------------------------------------
def bench_decode(args, dtypes) -> list[dict]:
    from client import DecodeInput as CDecode
    from client import ExecutorClient, UnifiedBatchItem
    from client import LogitsPolicy as CPolicy
    from client import PrefillInput as CPrefill

    rows = []
    batches = [1, 8, 32] if args.quick else [1, 8, 32, 64]
    steps = 3 if args.quick else 8
    for dtype in dtypes:
        ex = executor(dtype)
        loop = Loop()
        sock = tempfile.mktemp(prefix="modelexec-bench-", suffix=".sock")
        server = serve(loop, ex, unix_socket=sock)
        policy = CPolicy.argmax()
        with ExecutorClient(server.address, timeout=600) as c:
            c.warmup()
            handles = []
            for chunk in range(0, max(batches), 32):
                k = min(32, max(batches) - chunk)
                outs = c.batch_prefill([CPrefill(p, logits_policy=policy)
                                        for p in prompts(k, PROMPT_LEN, ex.vocab_size, SEED + chunk)])
                handles += [o.kv_cache for o in outs]
            next_tok = [7] * len(handles)
            for b in batches:
                for rpc in ("BatchDecode", "UnifiedDecode"):
                    times = []
                    for s in range(steps + 1):
                        hs = handles[:b]
                        t0 = time.perf_counter()
                        if rpc == "BatchDecode":
                            outs = c.batch_decode([CDecode(t, h, logits_policy=policy) for t, h in zip(next_tok, hs)])
                            new = [o.kv_cache for o in outs]
                            toks = [o.logits.token_id for o in outs]
                        else:
                            items = [UnifiedBatchItem(h.cache_id, [t], h.sequence_length, True, logits_policy=policy)
                                     for t, h in zip(next_tok, hs)]
                            res = c.unified_decode(items)
                            new = [r.kv_cache for r in res]
                            toks = [r.logits.token_id for r in res]
                        elapsed = time.perf_counter() - t0
                        handles[:b] = new
                        next_tok[:b] = toks
                        if s:  # the first step warms this shape up
                            times.append(elapsed)
                    step = statistics.median(times)
                    context = statistics.mean(h.sequence_length for h in handles[:b])
                    moved = weight_bytes(ex) + b * context * ex.pool.bytes_per_token
                    rows.append({"dtype": dtype, "rpc": rpc, "batch": b, "context": context, "step_ms": step * 1e3,
                                 "best_step_ms": min(times) * 1e3, "tok_s": b / step,
                                 "bandwidth_gb_s": moved / step / 1e9, "bytes_per_step": moved})
                    print(f"  decode {dtype} {rpc:13s} batch {b:2d}: {step * 1e3:8.1f} ms/step  {b / step:8.1f} tok/s"
                          f"  {moved / step / 1e9:5.1f} GB/s", flush=True)
        loop.run(server.stop(0))
        loop.close()
        ex.worker.close()
    return rows


# -- (d) ours vs transformers ----------------------------------------------------------------
def bench_hf(args, dtypes) -> list[dict]:
    try:
        import transformers
    except ImportError:
        return [{"skipped": "transformers is not installed (pip install -r requirements-test.txt)"}]
    transformers.logging.set_verbosity_error()
    rows = []
    new_tokens = 8 if args.quick else 24
    reps = 2 if args.quick else 3
    for dtype in dtypes:
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        # transformers loads on a thread that ends and generates on the executor's worker: a
        # second OpenMP pool would slow both sides (omp_pool.py).
        hf = in_passing_thread(lambda: transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR),
                                                                                       dtype=tdt).eval())
        hf.generation_config.eos_token_id = None
        ex = executor(dtype)
        loop = Loop()
        loop.run(ex.warmup())
        for b in (1, 32):
            ps = prompts(b, PROMPT_LEN, ex.vocab_size, SEED + b)
            ids = torch.tensor(ps)
            mask = torch.ones_like(ids)

            def generate(n):
                with torch.inference_mode():
                    return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                       pad_token_id=0, cache_implementation="static")

            def gen(n):
                return ex.worker.schedule(generate, n).result()

            gen(2)  # warm-up
            # generate(1) is the prefill; generate(1 + n) - generate(1), paired, is n decode steps.
            pairs = [(timed(gen, 1)[0], timed(gen, 1 + new_tokens)[0]) for _ in range(reps)]
            t_pre = min(p for p, _ in pairs)
            t_dec = statistics.median(a - p for p, a in pairs)
            hf_prefill = b * PROMPT_LEN / t_pre
            hf_decode = b * new_tokens / t_dec if t_dec > 0 else float("nan")

            async def ours():
                t0 = time.perf_counter()
                outs = await ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX) for p in ps])
                t1 = time.perf_counter()
                hs = [o.kv_cache for o in outs]
                toks = [o.logits.token_id for o in outs]
                for _ in range(new_tokens):
                    steps = await ex.batch_decode([DecodeInput(token_id=t, kv_cache=h, logits_policy=ARGMAX)
                                                   for t, h in zip(toks, hs)])
                    hs, toks = [s.kv_cache for s in steps], [s.logits.token_id for s in steps]
                t2 = time.perf_counter()
                for h in hs:
                    await ex.release_cache(h.cache_id)
                return t1 - t0, t2 - t1

            loop.run(ours())  # warm-up
            pre, dec = zip(*(loop.run(ours()) for _ in range(reps)))
            our_prefill, our_decode = b * PROMPT_LEN / min(pre), b * new_tokens / statistics.median(dec)
            rows.append({"dtype": dtype, "batch": b, "prompt_len": PROMPT_LEN, "new_tokens": new_tokens,
                         "hf_prefill_tok_s": hf_prefill, "ours_prefill_tok_s": our_prefill,
                         "prefill_ratio": our_prefill / hf_prefill,
                         "hf_decode_tok_s": hf_decode, "ours_decode_tok_s": our_decode,
                         "decode_ratio": our_decode / hf_decode})
            print(f"  vs transformers {dtype} batch {b:2d}: prefill {our_prefill:7.0f} vs {hf_prefill:7.0f} tok/s "
                  f"({our_prefill / hf_prefill:.2f}x), decode {our_decode:6.1f} vs {hf_decode:6.1f} tok/s "
                  f"({our_decode / hf_decode:.2f}x)", flush=True)
        loop.close()
        ex.worker.close()
        del hf
    return rows
