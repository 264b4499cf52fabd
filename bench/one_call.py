"""`python -m bench.one_call`: a decode step in one CPU kernel call against op by op, per family.

The one-call step (executors/cpu_kernels/decode_step.c) runs every layer of a float32 CPU
decode step in one OpenMP region; the op-by-op path calls the same kernels from Python, a
few hundred calls a step. This times both on the same random weights (one model, two
executors with their own pools, the module switch fused_decode.FUSED_DECODE flipped
between their calls, alternating rounds, median in-process, ARGMAX) for layer shapes the
one call took on only recently: Gemma 2 (capped scores, norms around attention's and the
MLP's outputs), Gemma 3 (its sliding layers' own rotary table), OLMo 2 (no input norms,
q/k norms over every head), SmolLM3 (NoPE layers), Cohere (LayerNorms, attention and the MLP
in parallel), StableLM (LayerNorms with biases, a quarter of each head rotating) and
StarCoder2 (an ungated MLP, biases everywhere); Llama beside them as the reference point. Each line gives both times, their ratio, and the weights' bytes per
one-call step over its time (the rate its matmuls read them at).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import torch

from bench.common import ARGMAX, alternating_decode_steps, release_all
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import fused_decode
from executors.models.config import DecoderConfig
from executors.models.decoder import DecoderLM
from executors.types import PrefillInput

# Per family: config.json keys beside the shared shape (head_dim 64 unless the family's own).
FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "head_dim": 256, "num_attention_heads": 4,
               "num_key_value_heads": 2, "query_pre_attn_scalar": 256},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "head_dim": 256, "num_attention_heads": 4,
               "num_key_value_heads": 2, "query_pre_attn_scalar": 256},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"]},
    "smollm3": {"architectures": ["SmolLM3ForCausalLM"]},
    "cohere": {"architectures": ["CohereForCausalLM"]},
    "stablelm": {"architectures": ["StableLmForCausalLM"], "use_qkv_bias": True},
    "starcoder2": {"architectures": ["Starcoder2ForCausalLM"], "hidden_act": "gelu_pytorch_tanh"},
}


def model(family: str, args) -> DecoderLM:
    cfg = {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
           "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
           "num_key_value_heads": args.hidden // 256, "max_position_embeddings": 8192, **FAMILIES[family]}
    torch.manual_seed(0)
    m = DecoderLM(DecoderConfig.from_dict(cfg))
    offset = m.config.norm_offset
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.fill_(1.0 - offset) if "norm" in name and name.endswith("weight") else p.normal_(0, 0.02)
    return m.eval()


def time_family(family: str, args, loop: asyncio.AbstractEventLoop) -> None:
    m = model(family, args)
    config = LlmExecutorConfig(model_dir=f"/bench/{family}", num_blocks=1024, prefix_caching=False)
    one_call, op_by_op = LlmExecutor(config, m), LlmExecutor(config, m)
    # What a step reads: every matrix and norm, the lm_head, not the embedding's other rows.
    weight_bytes = sum(t.numel() * 4 for t in m.parameters())
    if not m.config.tie_word_embeddings:
        weight_bytes -= m.model.embed_tokens.weight.numel() * 4
    assert m.fused_decode is not None, fused_decode.unsupported(m)
    gen = torch.Generator().manual_seed(1)
    try:
        for b in (int(x) for x in args.batches.split(",")):
            prompts = [torch.randint(0, args.vocab, (args.context,), generator=gen).tolist() for _ in range(b)]
            executors, handles = {"one call": one_call, "op by op": op_by_op}, {}
            for name, ex in executors.items():
                outs = loop.run_until_complete(ex.batch_prefill([PrefillInput(input_ids=q, logits_policy=ARGMAX)
                                                                 for q in prompts]))
                handles[name] = [o.kv_cache for o in outs]

            def switch(name: str) -> None:
                fused_decode.FUSED_DECODE = name == "one call"

            times = alternating_decode_steps(loop, executors, handles, args.rounds, args.vocab, before=switch)
            fused_decode.FUSED_DECODE = True
            release_all(loop, executors, handles)
            fast, slow = (statistics.median(times[name]) * 1e3 for name in executors)
            print(f"{family:8s} batch {b:2d}, context {args.context}: one call {fast:6.2f} ms, op by op "
                  f"{slow:6.2f} ms ({slow / fast:.2f}x), weights at {weight_bytes / fast / 1e6:5.1f} GB/s",
                  flush=True)
    finally:
        fused_decode.FUSED_DECODE = True
        one_call.worker.close()
        op_by_op.worker.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.one_call", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args(argv)
    print(f"float32, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, "
          f"{torch.get_num_threads()} threads", flush=True)
    loop = asyncio.new_event_loop()
    for family in args.families.split(","):
        time_family(family, args, loop)
    loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
