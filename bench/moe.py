"""`python -m bench.moe`: a decode step of a small random mixture of experts against a dense
model with the same active parameters.

Both are Mixtral-shaped random models built in process (no checkpoint): the MoE has
`--experts` experts of intermediate size I per layer and routes each token to `--top-k` of
them; the dense model has one MLP of intermediate size top_k * I, so a token runs the
same number of multiply-adds through either. At batch 1 both read the same weight bytes per
step; at larger batches the MoE's rows spread over more experts, and it reads more of its
(experts / top_k times larger) weights. Decode steps (ARGMAX, context ~64) alternate
between the two executors; each reports its median step in-process, and the MoE's experts
touched per layer and step. `--architecture granitemoe` builds the MoE as Granite MoE's
stacked experts (one [E, 2I, hidden] tensor a layer) instead of Mixtral's module per expert;
`--quantization int8` serves both models' weights as int8 panels.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import torch

from bench.common import ARGMAX, alternating_decode_steps, release_all
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models.config import DecoderConfig
from executors.models.decoder import DecoderLM
from executors.types import PrefillInput


def model(experts: int, top_k: int, args, device: str) -> DecoderLM:
    cfg = dict(architectures=["MixtralForCausalLM"], vocab_size=args.vocab, hidden_size=args.hidden,
               num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4,
               max_position_embeddings=4096, intermediate_size=args.expert_size, num_local_experts=experts,
               num_experts_per_tok=top_k, sliding_window=None)  # full attention, as the MoE side
    if experts == 0:  # dense: a Mistral-shaped model with one MLP as wide as the active experts
        cfg.update(architectures=["MistralForCausalLM"], intermediate_size=args.expert_size * top_k)
    elif args.architecture == "granitemoe":  # stacked experts; Granite's multipliers at 1
        cfg.update(architectures=["GraniteMoeForCausalLM"])
        cfg.pop("sliding_window")
    torch.manual_seed(0)
    with torch.device(device):
        m = DecoderLM(DecoderConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in m.named_parameters():
            # Norms at 1 (not random around 0), so that the router sees the hidden states' spread.
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    m.quantize_weights = args.quantization == "int8"  # (the executor's config must say int8 too)
    return m.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--expert-size", type=int, default=1024, help="intermediate size of one expert")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--architecture", choices=("mixtral", "granitemoe"), default="mixtral")
    p.add_argument("--quantization", choices=("none", "int8"), default="none")
    args = p.parse_args(argv)
    executors = {}
    for name, experts in (("dense", 0), ("moe", args.experts)):
        m = model(experts, args.top_k, args, args.device)
        cfg = LlmExecutorConfig(model_dir=f"/bench/{name}", device=args.device, dtype=args.dtype, num_blocks=1024,
                                prefix_caching=False, quantization=args.quantization)
        executors[name] = LlmExecutor(cfg, m.to(cfg.torch_dtype))
        total = sum(t.numel() for t in m.parameters())
        print(f"{name}: {total / 1e6:.1f} M parameters, {m.config.moe or 'dense MLPs'}", flush=True)
    loop = asyncio.new_event_loop()
    gen = torch.Generator().manual_seed(1)
    load = executors["moe"].model.expert_load
    before_step = []  # the expert load before the MoE step
    touched: list[float] = []  # experts with rows, per layer, in each MoE step of a batch size

    def before(name: str) -> None:
        if name == "moe":
            before_step[:] = [load.clone()]

    def after(name: str) -> None:
        if name == "moe":
            touched.append(((load - before_step[0]) > 0).sum(1).float().mean().item())

    for b in (int(x) for x in args.batches.split(",")):
        handles = {}
        for name, ex in executors.items():
            prompts = [torch.randint(0, args.vocab, (args.context,), generator=gen).tolist() for _ in range(b)]
            outs = loop.run_until_complete(ex.batch_prefill([PrefillInput(input_ids=q, logits_policy=ARGMAX)
                                                             for q in prompts]))
            handles[name] = [o.kv_cache for o in outs]
        touched.clear()
        times = alternating_decode_steps(loop, executors, handles, args.rounds, args.vocab, before, after)
        release_all(loop, executors, handles)
        dense, sparse = (statistics.median(times[n]) * 1e3 for n in ("dense", "moe"))
        print(f"batch {b:2d}: dense {dense:6.1f} ms, moe {sparse:6.1f} ms ({sparse / dense:.2f}x); "
              f"experts with rows per layer and step: {statistics.mean(touched):.1f} of {args.experts}",
              flush=True)
    for ex in executors.values():
        ex.worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
