"""`python -m bench.softcap`: what Gemma 2's soft-capped attention scores cost a step.

SDPA and flash do not cap scores. A float32 CPU step's decode rows and whole fresh prompts
of a soft-capped layer go through the CPU attention kernels, which do (their `softcap`);
everything else takes the plain path of attention_reference.py (each sequence's context
gathered, the scores written out, capped, masked and soft-maxed). This times the prefill of
one prompt of each context and decode steps (ARGMAX) at each batch size, against the same
random weights with the cap off (`attn_logit_softcapping: null`), the two executors in
alternating rounds, median in-process. Decode steps take the one-call CPU step on both
sides (it caps too); before it took Gemma's layers (RESULTS.md run 27) they ran op by op. Gemma-2-2B's layout, scaled down by
--hidden and --layers (head_dim 256 as Gemma 2's, every other layer sliding over 4096).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from bench.common import ARGMAX, alternating_decode_steps, release_all
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models.config import DecoderConfig
from executors.models.decoder import DecoderLM
from executors.types import PrefillInput


def model(softcap: float | None, args) -> DecoderLM:
    cfg = dict(architectures=["Gemma2ForCausalLM"], vocab_size=args.vocab, hidden_size=args.hidden,
               intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, attn_logit_softcapping=softcap)
    torch.manual_seed(0)
    m = DecoderLM(DecoderConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.zero_() if "norm" in name else p.normal_(0, 0.02)  # Gemma's norms multiply by 1 + w
    return m.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.softcap", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1152)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args(argv)
    executors = {}
    for name, cap in (("capped", 50.0), ("uncapped", None)):
        m = model(cap, args)
        executors[name] = LlmExecutor(LlmExecutorConfig(model_dir=f"/bench/{name}", num_blocks=2048,
                                                        prefix_caching=False), m)
    print(f"{sum(t.numel() for t in m.parameters()) / 1e6:.1f} M parameters, float32, "
          f"one-call CPU decode step: capped {executors['capped'].model.fused_decode is not None}, "
          f"uncapped {executors['uncapped'].model.fused_decode is not None}", flush=True)
    loop = asyncio.new_event_loop()
    gen = torch.Generator().manual_seed(1)
    for context in (int(x) for x in args.contexts.split(",")):
        prompt = torch.randint(0, args.vocab, (context,), generator=gen).tolist()
        prefills: dict[str, list[float]] = {name: [] for name in executors}
        for r in range(args.rounds + 1):  # a prompt's prefill: its attention takes the prefill kernel
            for name, ex in executors.items():
                t0 = time.perf_counter()
                out = loop.run_until_complete(ex.prefill(PrefillInput(input_ids=prompt, logits_policy=ARGMAX)))
                if r:
                    prefills[name].append(time.perf_counter() - t0)
                loop.run_until_complete(ex.release_cache(out.kv_cache.cache_id))
        capped, uncapped = (statistics.median(prefills[n]) * 1e3 for n in ("capped", "uncapped"))
        print(f"context {context:5d}, prefill: capped {capped:7.1f} ms, uncapped {uncapped:7.1f} ms "
              f"({capped / uncapped:.2f}x)", flush=True)
        for b in (int(x) for x in args.batches.split(",")):
            prompts = [torch.randint(0, args.vocab, (context,), generator=gen).tolist() for _ in range(b)]
            handles = {}
            for name, ex in executors.items():
                outs = loop.run_until_complete(ex.batch_prefill([PrefillInput(input_ids=q, logits_policy=ARGMAX)
                                                                 for q in prompts]))
                handles[name] = [o.kv_cache for o in outs]
            times = alternating_decode_steps(loop, executors, handles, args.rounds, args.vocab)
            release_all(loop, executors, handles)
            capped, uncapped = (statistics.median(times[n]) * 1e3 for n in ("capped", "uncapped"))
            print(f"context {context:5d}, batch {b:2d}: capped {capped:7.1f} ms, uncapped {uncapped:7.1f} ms "
                  f"({capped / uncapped:.2f}x)", flush=True)
    for ex in executors.values():
        ex.worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
