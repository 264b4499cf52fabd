"""`python -m bench.mla`: DeepSeek's multi-head latent attention on a CPU, against transformers.

A random DeepSeek-V2-Lite-shaped model (hidden 2048, 16 heads; kv_lora_rank 512, rope 64,
non-rotary key 128 and value 128 a head; queries from q_proj) of `--layers` layers, its MLPs
and vocabulary shrunk (`--intermediate`, `--vocab`) so that a step is mostly attention,
float32, the same weights on both sides:

- `cache`: the KV bytes a token a layer at DeepSeek-V2-Lite's and V3's shapes: the latent
  rows as this executor caches them (once: the pool's V half is its K half), and every
  head's expanded key and value (transformers 4's cache, vLLM's before its MLA backends).
  Arithmetic, printed for the record.
- `kernel`: the CPU kernels' paged decode attention for one row over the latent rows (16
  query heads over one KV head of 576, its values the keys, as the pool holds them), float32,
  `--contexts` keys (median of 8 rounds of 20 calls), with the rows' bytes over the time.
- `decode`: ARGMAX decode steps at batch B over contexts of L tokens, this executor (the
  queries absorbed into the latent space, the CPU kernels over the cached rows) and
  transformers' DeepseekV2ForCausalLM with its DynamicCache (which caches the latents too and
  expands all of them through kv_b_proj at every step), in alternating rounds (median of
  each side's steps). The contexts grow by a token a round on both sides. Each of our steps
  that follows one of transformers' is slowed by its threads, which spin on both cores after
  its last op (bench/RESULTS.md run 23): ours is also timed alone first, `--rounds` steps in
  a row, and given as tokens/s and the bandwidth it achieved: the weights' bytes plus the
  cached rows' (every context token's row in every layer, once; the embedding's whole table
  counted, of which a step reads a row) over the step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from bench.common import alternating_decode_steps, release_all, weight_bytes
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.types import PrefillInput

# DeepSeek-V2-Lite's attention shape (and V3's: 128 heads, q_lora_rank 1536).
HEADS, HIDDEN, RANK, ROPE, NOPE, VALUE = 16, 2048, 512, 64, 128, 128


def cache_bytes() -> None:
    for name, layers, heads in (("DeepSeek-V2-Lite", 27, 16), ("DeepSeek-V3", 61, 128)):
        latent = (RANK + ROPE) * 2  # bfloat16
        expanded = heads * (NOPE + ROPE + VALUE) * 2
        print(f"cache, {name}: latent rows {latent} B a token a layer ({latent * layers / 1024:.1f} KiB a token), "
              f"expanded keys and values {expanded} B ({expanded / latent:.1f}x ours)", flush=True)


def kernel(args) -> None:
    from executors.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        print("kernel: the CPU kernels cannot be built here", flush=True)
        return
    g, bs, d = torch.Generator().manual_seed(0), 16, RANK + ROPE
    for context in args.contexts:
        blocks = -(-context // bs)
        rows = torch.randn(blocks, bs, 1, d, generator=g)  # keys and values both
        tables = torch.randperm(blocks, generator=g).to(torch.int32).view(1, -1)
        lo, hi = torch.zeros(1, dtype=torch.int32), torch.full((1,), context, dtype=torch.int32)
        q, out = torch.randn(1, HEADS, d, generator=g), torch.empty(1, HEADS * d)
        rounds = []
        for r in range(9):
            t0 = time.perf_counter()
            for _ in range(20):
                kernels.decode_attention(q, rows, rows, tables, lo, hi, 0.1, out)
            if r:  # round 0 warms up
                rounds.append((time.perf_counter() - t0) / 20)
        seconds = statistics.median(rounds)
        print(f"kernel, context {context:5d}: {seconds * 1e6:8.1f} us ({context * d * 4 / seconds / 1e9:4.1f} GB/s "
              f"of rows)", flush=True)


def transformers_model(args, directory: str):
    import transformers as tf

    config = tf.DeepseekV2Config(
        vocab_size=args.vocab, hidden_size=HIDDEN, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=RANK, q_lora_rank=None,
        qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE, first_k_dense_replace=args.layers,
        n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=max(args.contexts) + 256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.DeepseekV2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    model.eval().save_pretrained(directory)
    return model


class TransformersSteps:
    """transformers' decode steps over a DynamicCache, as an executor's batch_decode for the timing loop."""

    def __init__(self, model, batch: int, context: int, vocab: int) -> None:
        from transformers import DynamicCache

        self.model, self.cache = model, DynamicCache(config=model.config)
        gen = torch.Generator().manual_seed(2)
        with torch.inference_mode():
            model(input_ids=torch.randint(0, vocab, (batch, context), generator=gen), past_key_values=self.cache,
                  use_cache=True)
        self.batch, self.position = batch, context

    async def batch_decode(self, inputs):
        ids = torch.tensor([[d.token_id] for d in inputs])
        with torch.inference_mode():
            logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                                position_ids=torch.full((self.batch, 1), self.position)).logits
        logits[:, -1].argmax(-1)
        self.position += 1
        return inputs  # (their kv_cache handles, as the timing loop keeps them)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mla", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="cache,kernel,decode")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048, 8192])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if "cache" in parts:
        cache_bytes()
    if "kernel" in parts:
        kernel(args)
    if "decode" not in parts:
        return 0
    with tempfile.TemporaryDirectory() as directory:
        theirs = transformers_model(args, directory)
        longest = max(args.contexts) + 2 * args.rounds + 4  # ours decodes alone, then alternating
        blocks = max(args.batches) * -(-longest // 16) + 16
        ours = LlmExecutor(LlmExecutorConfig(model_dir=directory, num_blocks=blocks, block_size=16,
                                             prefix_caching=False))
    loop = asyncio.new_event_loop()
    gen = torch.Generator().manual_seed(1)
    try:
        for context in args.contexts:
            for batch in args.batches:
                prompts = [torch.randint(0, args.vocab, (context,), generator=gen).tolist() for _ in range(batch)]
                outs = loop.run_until_complete(ours.batch_prefill([PrefillInput(input_ids=q) for q in prompts]))
                t0 = time.perf_counter()
                steps = TransformersSteps(theirs, batch, context, args.vocab)
                prefill = time.perf_counter() - t0
                executors = {"ours": ours, "transformers": steps}
                handles = {"ours": [o.kv_cache for o in outs], "transformers": [o.kv_cache for o in outs]}
                solo_handles = {"ours": handles["ours"]}  # (updated in place: the caches grow)
                alone = alternating_decode_steps(loop, {"ours": ours}, solo_handles, args.rounds, args.vocab)["ours"]
                handles["ours"] = solo_handles["ours"]
                times = alternating_decode_steps(loop, executors, handles, args.rounds, args.vocab)
                release_all(loop, {"ours": ours}, {"ours": handles["ours"]})
                mine, them = (statistics.median(times[k]) * 1e3 for k in ("ours", "transformers"))
                solo = statistics.median(alone) * 1e3
                read = weight_bytes(ours) + batch * (context + args.rounds // 2) * args.layers * (RANK + ROPE) * 4
                print(f"decode, context {context:5d}, batch {batch:2d}: ours {mine:8.2f} ms, transformers {them:8.2f} ms "
                      f"({them / mine:.2f}x) alternating; ours alone {solo:6.2f} ms ({batch / solo * 1e3:4.0f} tokens/s, "
                      f"{read / solo / 1e6:4.1f} GB/s); transformers' prefill {prefill:.1f} s", flush=True)
    finally:
        ours.worker.close()
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
