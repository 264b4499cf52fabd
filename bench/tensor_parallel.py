"""`tp` part: decode and prefill at tensor-parallel sizes 1 and 2, through gRPC.

A random Llama of SmolLM2's size class (hidden 1024, 8 layers, 8 heads, 4 KV heads, tied
32k vocabulary, float32, ~126M parameters; SmolLM2-135M itself has 9 heads, which two ranks
cannot split) is written to a temporary directory and served by `python -m service` with
`--tensor-parallel-size` 1 and 2 (the service spawns its second rank). For each size: the
median decode step at batch 1 and 8, the prefill of 128 tokens, and gpt-fast's achieved
bandwidth of the batch-1 step (parameter bytes read per step over the step's time, over all
ranks). On a 2-core CPU each rank gets one core, so size 2 runs the same arithmetic on the
same two cores plus two all-reduces per layer over loopback TCP: it is not expected to win
here; the figures say by how much it loses. On a host with N GPUs, the same part with
--tp-device cuda reports the scaling from 1 to N (sizes 1, 2, 4, 8 up to the device count).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.service_process import launch, stop, wait_ready

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000)
DECODE_STEPS = 32
PREFILL_TOKENS = 128


def write_model(where: Path) -> Path:
    """A random float32 Llama under where/model (config.json + model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    from executors.models.config import DecoderConfig
    from executors.models.decoder import DecoderLM

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
           "torch_dtype": "float32", "hidden_act": "silu"}
    out = where / "model"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.from_dict(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return out


def measure(address: str, quick: bool) -> dict:
    from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput

    rng = np.random.default_rng(5)
    argmax = LogitsPolicy.argmax()
    with ExecutorClient(address, timeout=600) as c:
        info = c.info()
        steps = DECODE_STEPS // (4 if quick else 1)
        prefill = []
        for _ in range(2 if quick else 5):
            started = time.perf_counter()
            h = c.prefill(PrefillInput(rng.integers(0, SHAPE["vocab_size"], PREFILL_TOKENS).tolist(),
                                       logits_policy=argmax)).kv_cache
            prefill.append(time.perf_counter() - started)
            c.release_cache(h)
        decode = {}
        for batch in (1, 8):
            outs = c.batch_prefill([PrefillInput(rng.integers(0, SHAPE["vocab_size"], 16).tolist(),
                                                 logits_policy=argmax) for _ in range(batch)])
            handles = [o.kv_cache for o in outs]
            times = []
            for _ in range(steps):
                started = time.perf_counter()
                outs = c.batch_decode([DecodeInput(1, h, logits_policy=argmax) for h in handles])
                times.append(time.perf_counter() - started)
                handles = [o.kv_cache for o in outs]
            decode[batch] = statistics.median(times[2:])
            for h in handles:
                c.release_cache(h)
        ranks = [r.parameter_bytes for r in c.status().ranks]
        if not ranks:  # one process: its weights (and packed copies) are what it allocated less the pool
            caps = c.capabilities()
            pool = caps.memory_requirements.kv_cache_memory_per_token * caps.kv_total_blocks * caps.kv_block_size
            ranks = [c.status().memory_usage.allocated_bytes - pool]
    return {"prefill_s": statistics.median(prefill), "decode_b1_s": decode[1], "decode_b8_s": decode[8],
            "num_parameters": info.num_parameters, "parameter_bytes": info.num_parameters * 4,
            "rank_parameter_bytes": ranks, "ranks": len(info.parallel.ranks) or 1}


def bench_tp(args) -> list[dict]:
    device = getattr(args, "tp_device", "cpu")
    sizes = [1, 2]
    if device == "cuda":
        import torch

        sizes = [n for n in (1, 2, 4, 8) if n <= torch.cuda.device_count()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mx-tp-") as tmp:
        model = write_model(Path(tmp))
        for n in sizes:
            server = launch("tcp", ["--model", str(model), "--device", device, "--dtype", "float32",
                                    "--num-blocks", "256", "--no-prefix-caching", "--tensor-parallel-size", str(n)])
            try:
                wait_ready(server, 600)
                row = {"tensor_parallel_size": n, "device": device, **measure(server.address, args.quick)}
            finally:
                stop(server)
            row["decode_b1_gb_s"] = row["parameter_bytes"] / row["decode_b1_s"] / 1e9
            row["decode_b8_tok_s"] = 8 / row["decode_b8_s"]
            row["prefill_tok_s"] = PREFILL_TOKENS / row["prefill_s"]
            rows.append(row)
            print(f"  tp {n}: decode b1 {row['decode_b1_s'] * 1e3:.1f} ms, b8 {row['decode_b8_s'] * 1e3:.1f} ms, "
                  f"prefill {PREFILL_TOKENS} {row['prefill_s'] * 1e3:.0f} ms", flush=True)
    base = rows[0]
    for r in rows:
        r["decode_b1_speedup"] = base["decode_b1_s"] / r["decode_b1_s"]
        r["prefill_speedup"] = base["prefill_s"] / r["prefill_s"]
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    out = ["(j) tensor parallelism: a random 126M Llama (hidden 1024, 8 layers, 8 heads / 4 KV heads, fp32) through "
           "gRPC at each size (medians)"]
    out.append(f"    {'size':>4s} {'device':6s} {'decode b1 ms':>12s} {'GB/s':>5s} {'b1 vs 1':>7s} "
               f"{'decode b8 ms':>12s} {'b8 tok/s':>8s} {'prefill 128 ms':>14s} {'vs 1':>5s} {'MB per rank':>12s}")
    for r in rows:
        per_rank = "/".join(f"{b / 1e6:.0f}" for b in r["rank_parameter_bytes"])
        out.append(f"    {r['tensor_parallel_size']:4d} {r['device']:6s} {r['decode_b1_s'] * 1e3:12.1f} "
                   f"{r['decode_b1_gb_s']:5.1f} {r['decode_b1_speedup']:6.2f}x {r['decode_b8_s'] * 1e3:12.1f} "
                   f"{r['decode_b8_tok_s']:8.0f} {r['prefill_s'] * 1e3:14.0f} {r['prefill_speedup']:4.2f}x "
                   f"{per_rank:>12s}")
    return out
