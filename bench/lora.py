"""The suite's `lora` part (g): what adapters cost a decode step, with rows on no adapter, on one
rank-16 adapter, and mixed over four adapters and the base model (in-process); its random adapters."""

from __future__ import annotations

import json

import torch

from bench.common import ARGMAX, PROMPT_LEN, SEED, Loop, executor, prompts, timed
from executors.descriptions import LoraSource
from executors.llm import LlmExecutor
from executors.types import DecodeInput, PrefillInput

# -- (g) multi-LoRA: what adapters cost a decode step ----------------------------------------
LORA_RANK = 16
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_lora_source(ex: LlmExecutor, seed: int) -> LoraSource:
    """A rank-16 adapter on all seven projections of every layer, in PEFT's file layout."""
    from safetensors.torch import save

    from executors.lora import MODULE_PARENTS, TENSOR_PREFIX

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(ex.model_config.num_layers):
        for module, (fan_in, fan_out) in ex.loras.targets.shapes.items():
            path = f"{TENSOR_PREFIX}model.layers.{layer}.{MODULE_PARENTS[module]}.{module}"
            tensors[f"{path}.lora_A.weight"] = torch.randn(LORA_RANK, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{path}.lora_B.weight"] = torch.randn(fan_out, LORA_RANK, generator=gen) / LORA_RANK
    config = {"peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK, "target_modules": list(LORA_MODULES)}
    return LoraSource(config_json=json.dumps(config).encode(), safetensors=save(tensors))


def bench_lora(args, dtypes) -> list[dict]:
    """Decode steps of the same batch under three adapter mixes, interleaved, best of rounds."""
    rows = []
    batches = [1, 8] if args.quick else [1, 8, 32]
    steps = 3 if args.quick else 6
    mixes = ("base", "one adapter", "4 adapters + base")
    for dtype in dtypes:
        ex = executor(dtype)
        loop = Loop()
        loop.run(ex.warmup())
        names = [f"bench-{i}" for i in range(4)]
        for i, name in enumerate(names):
            loop.run(ex.load_lora_adapter(name, random_lora_source(ex, SEED + i)))

        def metadata(mix: str, row: int) -> dict | None:
            """The request metadata naming row's adapter under `mix`; None for the base model."""
            name = {"base": None, "one adapter": names[0]}.get(mix, (names + [None])[row % 5])
            return None if name is None else {"ferrum_lora_adapter": name}

        async def start(b: int, mix: str):
            outs = await ex.batch_prefill([
                PrefillInput(input_ids=p, logits_policy=ARGMAX, metadata=metadata(mix, i))
                for i, p in enumerate(prompts(b, PROMPT_LEN, ex.vocab_size))])
            return [o.kv_cache for o in outs]

        async def step(handles):
            outs = await ex.batch_decode([DecodeInput(token_id=7, kv_cache=h, logits_policy=ARGMAX) for h in handles])
            return [o.kv_cache for o in outs]

        for b in batches:
            handles = {mix: loop.run(start(b, mix)) for mix in mixes}
            best = dict.fromkeys(mixes, float("inf"))
            for _ in range(steps):  # interleaved: each round steps every mix once
                for mix in mixes:
                    elapsed, handles[mix] = timed(loop.run, step(handles[mix]))
                    best[mix] = min(best[mix], elapsed)
            for mix in mixes:
                for h in handles[mix]:
                    loop.run(ex.release_cache(h.cache_id))
                rows.append({"dtype": dtype, "batch": b, "mix": mix, "rank": LORA_RANK, "step_ms": 1e3 * best[mix],
                             "vs_base": best[mix] / best["base"]})
            print(f"  lora {dtype} batch {b}: " + ", ".join(f"{m} {1e3 * best[m]:.1f} ms" for m in mixes), flush=True)
        loop.close()
        ex.worker.close()
    return rows
