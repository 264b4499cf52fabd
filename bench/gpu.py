"""Bench part (e), on a CUDA device: a Qwen3-0.6B-shaped random model in bfloat16.

Two ceilings are measured first, in the same run: a device-to-device copy (bytes read plus
written, the bandwidth floor of a decode step) and a large bf16 matmul (the compute ceiling
of a prefill). Then, on the same weights built once by transformers:
- decode steps at batch 1, 32 and 64 through SDPA, the Triton kernels and the Triton kernels
  replayed from CUDA graphs: wall time per step (what a caller waits) against the floor
  (weights + KV read per step / copy bandwidth), and the graph's own device time;
- batch_prefill of 32 prompts of 128 tokens against 32 prefills one after another;
- the gRPC cost at batch 32 with ARGMAX: the in-process step against BatchDecode,
  UnifiedDecode and StepSession from a client in a process of its own (bench/grpc_client.py);
- decode against transformers' generate with its static cache, eager and torch.compiled.

`--shape tiny` runs every section on a small model, and `--device cpu` on a CPU (SDPA only):
dry runs of this code, not measurements.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import ARGMAX, PROMPT_LEN, ROOT, SEED, Loop, inproc_batch_decode, pipelined_decode, prompts, serve
from bench.gpu_report import RowSink
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.types import DecodeInput, PrefillInput

QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
             "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "tie_word_embeddings": True, "dtype": "bfloat16"}
TINY = {**QWEN3_06B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
SHAPES = {"qwen3-0.6b": QWEN3_06B, "tiny": TINY}


@dataclass(frozen=True)
class Sizes:
    decode_batches: tuple[int, ...] = (1, 32, 64)
    max_seq: int = 4096
    prefill_prompts: int = 32
    grpc_batch: int = 32
    hf_batches: tuple[int, ...] = (1, 32)
    # (attention backend, CUDA graphs, the fused prologue and GLU kernels, the few-row matmuls of
    # few_row_matmuls.py); the last is the default fast path that the later sections use, the
    # ones before it the same without the fused kernels and with the few-row matmuls.
    variants: tuple[tuple[str, bool, bool, bool], ...] = (
        ("sdpa", False, False, False), ("triton", False, True, False), ("triton", True, False, False),
        ("triton", True, True, True), ("triton", True, True, False))


# A dry run of this code on a CPU (the tests run it): every section, small, SDPA only.
DRY_RUN = Sizes(decode_batches=(1, 4), max_seq=256, prefill_prompts=4, grpc_batch=4, hf_batches=(1, 4),
                variants=(("sdpa", False, False, False),))


def variant_name(backend: str, graphs: bool, prologue: bool = True, gemv: bool = False) -> str:
    return (backend + (" + graphs" if graphs else "") + ("" if prologue or backend != "triton" else ", unfused")
            + (" + gemv" if gemv else ""))


def sizes(args) -> Sizes:
    return Sizes() if args.device.startswith("cuda") else DRY_RUN


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_ms(fn: Callable[[], object], reps: int, device: str) -> float:
    """Median device time of fn in ms (CUDA events; wall time on a CPU), after one warm-up call."""
    fn()
    if not device.startswith("cuda"):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth(device: str) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read and written."""
    n = (1 << 28) if device.startswith("cuda") else (1 << 22)
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    ms = device_ms(lambda: y.copy_(x), 20, device)
    return 2 * x.numel() * 4 / (ms / 1e3) / 1e9


def matmul_tflops(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device.startswith("cuda") else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = device_ms(lambda: a @ b, 10, device)
    return 2 * n ** 3 / (ms / 1e3) / 1e12


def random_transformers(shape: dict, device: str, dtype: torch.dtype):
    """A random transformers Qwen3 of this shape (seeded), generating past end-of-sequence ids."""
    import transformers

    torch.manual_seed(SEED)
    with torch.device(device):
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).to(dtype).eval()
    hf.generation_config.eos_token_id = None
    return hf


def random_pair(shape: dict, device: str, dtype: torch.dtype):
    """A random transformers Qwen3 and our DecoderLM holding the same weights."""
    from executors.models.config import DecoderConfig
    from executors.models.decoder import DecoderLM
    from executors.models.layers import RotaryEmbedding

    hf = random_transformers(shape, device, dtype)
    cfg = DecoderConfig.from_dict(shape)
    with torch.device(device):
        model = DecoderLM(cfg).to(dtype)
    own = dict(model.named_parameters())
    model.load_state_dict({k: v for k, v in hf.state_dict().items() if k in own}, strict=True)
    model.rope = RotaryEmbedding(cfg).to(device)  # float32 tables, as the loader builds them
    return hf, model.eval().fuse()


def run_dtype(device: str) -> torch.dtype:
    """bfloat16; float32 in a CPU dry run, where Triton's interpreter cannot multiply bfloat16 tiles."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def new_executor(model, device: str, backend: str, graphs: bool, size: Sizes, prologue: bool = True,
                 gemv: bool = False) -> LlmExecutor:
    dtype = str(run_dtype(device)).removeprefix("torch.")
    return LlmExecutor(LlmExecutorConfig(model_dir="qwen3-0.6b-random", dtype=dtype, device=device, num_blocks=4096,
                                         max_batch_size=max(size.decode_batches), max_sequence_length=size.max_seq,
                                         prefix_caching=False,
                                         attention_backend=backend, cuda_graphs=graphs,
                                         triton_fused_ops=prologue, triton_gemv=gemv), model)


def decode_steps(loop: Loop, ex: LlmExecutor, batch: int, reps: int, vocab: int) -> tuple[float, int]:
    """Median wall ms of a batch_decode step at `batch` (context ~PROMPT_LEN) and the last context length."""
    outs = loop.run(ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX)
                                      for p in prompts(batch, PROMPT_LEN, vocab)]))
    hs = [o.kv_cache for o in outs]
    times = []
    for s in range(reps + 1):
        sync(ex.config.device)
        t0 = time.perf_counter()
        steps = loop.run(ex.batch_decode([DecodeInput(token_id=1, kv_cache=h, logits_policy=ARGMAX) for h in hs]))
        sync(ex.config.device)
        hs = [st.kv_cache for st in steps]
        if s:
            times.append((time.perf_counter() - t0) * 1e3)
    for h in hs:
        loop.run(ex.release_cache(h.cache_id))
    return statistics.median(times), hs[0].sequence_length


def decode_pipelined(loop: Loop, ex: LlmExecutor, batch: int, reps: int, vocab: int) -> float:
    """Median wall ms between two results of a scheduler keeping two fed ARGMAX steps in flight."""
    outs = loop.run(ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX)
                                      for p in prompts(batch, PROMPT_LEN, vocab)]))
    gaps, results = loop.run(pipelined_decode(ex, [o.kv_cache for o in outs], reps + 2))
    for r in results[-1]:
        loop.run(ex.release_cache(r.kv_cache.cache_id))
    return statistics.median(gaps) * 1e3


def graph_device_ms(ex: LlmExecutor, batch: int) -> float | None:
    """Device time of one replay of the bucket's graph (its buffers as the last step left them:
    the replay rewrites the same K and V into the same slots)."""
    if ex.graphs is None or not ex.graphs.captured:
        return None
    graph, _ = ex.graphs._graphs[ex.graphs.bucket(batch)]
    return device_ms(graph.replay, 20, ex.config.device)


def bench_decode_variants(loop, model, shape, args, ceilings, rows) -> dict:
    """Decode through each variant (sdpa, triton, triton + graphs with and without the fused
    prologue and GLU kernels); returns {(variant, batch): step ms}."""
    reps = 6 if args.quick else 21
    step_ms: dict[tuple[str, int], float] = {}
    variants = sizes(args).variants
    for backend, graphs, prologue, gemv in variants:
        name = variant_name(backend, graphs, prologue, gemv)
        ex = new_executor(model, args.device, backend, graphs, sizes(args), prologue, gemv)
        try:
            for b in sizes(args).decode_batches:
                ms, context = decode_steps(loop, ex, b, reps, shape["vocab_size"])
                gpu_ms = graph_device_ms(ex, b) if graphs else None
                moved = ex.parameter_bytes + b * context * ex.pool.bytes_per_token
                floor_ms = moved / (ceilings["copy_gb_s"] * 1e9) * 1e3
                step_ms[(name, b)] = ms
                rows.append({"what": "decode", "attention": name, "batch": b, "context": context, "step_ms": ms,
                             "graph_device_ms": gpu_ms, "tok_s": b / ms * 1e3, "bytes_per_step": moved,
                             "bandwidth_gb_s": moved / ms / 1e6, "floor_ms": floor_ms, "x_floor": ms / floor_ms})
                extra = f", graph on the device {gpu_ms:.3f} ms" if gpu_ms is not None else ""
                print(f"  decode {name:24s} batch {b:2d}: {ms:7.3f} ms/step, {b / ms * 1e3:8.0f} tok/s, "
                      f"{moved / ms / 1e6:6.0f} GB/s, {ms / floor_ms:.2f}x the floor ({floor_ms:.3f} ms){extra}",
                      flush=True)
                if (backend, graphs, prologue, gemv) == variants[-1]:
                    piped = decode_pipelined(loop, ex, b, reps, shape["vocab_size"])
                    rows.append({"what": "decode pipelined", "attention": name, "batch": b, "step_ms": piped,
                                 "one_at_a_time_ms": ms, "graph_device_ms": gpu_ms})
                    print(f"  decode {name:24s} batch {b:2d}, two fed steps in flight: {piped:7.3f} ms/step "
                          f"({ms / piped:.2f}x one at a time)", flush=True)
            if gemv and ex.graphs is not None and ex.graphs.matmuls is not None:
                chosen = ex.graphs.matmuls.chosen()
                rows.append({"what": "few_row_matmuls", "chosen": chosen,
                             "timings_ms": {str(k[:5]): v for k, v in ex.graphs.matmuls.timings.items()}})
                print("  few-row matmuls chosen: " + ", ".join(f"{k} {v}" for k, v in chosen.items()), flush=True)
            if (backend, graphs, prologue, gemv) == variants[-1]:
                bench_prefill(loop, ex, shape, args, ceilings, rows)
                bench_grpc(loop, ex, shape, args, rows)
        finally:
            ex.worker.close()
            del ex
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return step_ms


def bench_prefill(loop, ex, shape, args, ceilings, rows) -> None:
    """batch_prefill of 32 x 128 tokens in one call against 32 prefill calls in a row."""
    n = sizes(args).prefill_prompts
    ps = prompts(n, PROMPT_LEN, shape["vocab_size"], SEED + 7)

    async def one_call():
        outs = await ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX) for p in ps])
        for o in outs:
            await ex.release_cache(o.kv_cache.cache_id)

    async def serial():
        for p in ps:
            out = await ex.prefill(PrefillInput(input_ids=p, logits_policy=ARGMAX))
            await ex.release_cache(out.kv_cache.cache_id)

    def wall(coro_fn) -> float:
        sync(args.device)
        t0 = time.perf_counter()
        loop.run(coro_fn())
        sync(args.device)
        return time.perf_counter() - t0

    wall(one_call), wall(serial)  # warm-up
    batched = statistics.median(wall(one_call) for _ in range(5))
    one_by_one = statistics.median(wall(serial) for _ in range(3))
    flops = 2 * ex.num_parameters * n * PROMPT_LEN  # matmuls; attention over 128 keys adds ~2%
    rows.append({"what": "batch_prefill", "prompts": n, "prompt_len": PROMPT_LEN, "batched_ms": batched * 1e3,
                 "serial_ms": one_by_one * 1e3, "per_prefill_ms": one_by_one * 1e3 / n, "ratio": one_by_one / batched,
                 "batched_tflops": flops / batched / 1e12, "matmul_tflops": ceilings["matmul_tflops"]})
    print(f"  batch_prefill {n}x{PROMPT_LEN}: {batched * 1e3:.1f} ms ({flops / batched / 1e12:.0f} TFLOP/s of "
          f"{ceilings['matmul_tflops']:.0f}) vs {n} prefills {one_by_one * 1e3:.1f} ms "
          f"({one_by_one * 1e3 / n:.2f} ms each): {one_by_one / batched:.1f}x", flush=True)


def bench_grpc(loop, ex, shape, args, rows) -> None:
    """The decode step at batch 32 with ARGMAX in-process and over gRPC (unix socket) from a
    client in a process of its own: BatchDecode, UnifiedDecode, a StepSession stream step by
    step, and one keeping two steps in flight that feed the sampled tokens (the time between
    two results)."""
    batch, rounds = sizes(args).grpc_batch, 10 if args.quick else 30
    server = serve(loop, ex, unix_socket=tempfile.mktemp(prefix="modelexec-bench-", suffix=".sock"))
    try:
        outs = loop.run(ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX)
                                          for p in prompts(batch, PROMPT_LEN, shape["vocab_size"])]))
        hs = [o.kv_cache for o in outs]
        walls = []
        for r in range(rounds + 1):
            sync(args.device)
            steps, _, wall_ns = loop.run(inproc_batch_decode(
                ex, [DecodeInput(token_id=5, kv_cache=h, logits_policy=ARGMAX) for h in hs]))
            hs = [s.kv_cache for s in steps]
            if r:
                walls.append(wall_ns / 1e6)
        for h in hs:
            loop.run(ex.release_cache(h.cache_id))
        inproc = statistics.median(walls)
        proc = subprocess.run([sys.executable, "-m", "bench.grpc_client", "--address", server.address,
                               "--batch", str(batch), "--rounds", str(rounds), "--prompt-len", str(PROMPT_LEN),
                               "--vocab", str(shape["vocab_size"]), "--policies", "ARGMAX", "--walls",
                               "--pipelined"],
                              capture_output=True, text=True, timeout=600, cwd=ROOT, check=True)
        for rpc, by_policy in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            remote = statistics.median(by_policy["ARGMAX"]) * 1e3
            rows.append({"what": "grpc", "rpc": rpc, "batch": batch, "policy": "ARGMAX", "inproc_ms": inproc,
                         "grpc_ms": remote, "over_inproc": remote / inproc - 1})
            print(f"  gRPC batch {batch} ARGMAX {rpc:13s}: {remote:.3f} ms a step from another process vs "
                  f"{inproc:.3f} ms in-process (+{100 * (remote / inproc - 1):.1f}%)", flush=True)
    finally:
        loop.run(server.stop(0))


def bench_transformers(hf, shape, args, step_ms, rows) -> None:
    """transformers' generate with its static cache, eager and torch.compiled, on the same weights."""
    new_tokens = 8 if args.quick else 32
    for compiled in (False, True):
        for b in sizes(args).hf_batches:
            label = "compiled" if compiled else "eager"
            ids = torch.tensor(prompts(b, PROMPT_LEN, shape["vocab_size"]), device=args.device)

            def gen(n):
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0, cache_implementation="static",
                                      disable_compile=not compiled)
                sync(args.device)
                return out

            try:
                t0 = time.perf_counter()
                gen(1 + new_tokens)  # the largest first: later calls reuse its static cache (and graphs)
                warm = time.perf_counter() - t0
                pairs = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    gen(1)
                    t1 = time.perf_counter()
                    gen(1 + new_tokens)
                    pairs.append((t1 - t0, time.perf_counter() - t1))
            except Exception as e:  # noqa: BLE001 - a compile that fails is a figure of its own
                rows.append({"what": "vs transformers", "mode": label, "batch": b, "error": f"{type(e).__name__}: {e}"})
                print(f"  transformers {label} batch {b}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            hf_ms = statistics.median(a - p for p, a in pairs) / new_tokens * 1e3
            ours = step_ms[(variant_name(*sizes(args).variants[-1]), b)]
            rows.append({"what": "vs transformers", "mode": label, "batch": b, "hf_step_ms": hf_ms,
                         "ours_step_ms": ours, "ratio": hf_ms / ours, "first_call_s": warm})
            print(f"  vs transformers ({label}, static cache) batch {b:2d}: ours {ours:.3f} ms/step vs "
                  f"{hf_ms:.3f}: {hf_ms / ours:.1f}x (its first call {warm:.0f} s)", flush=True)


def bench_gpu(args) -> list[dict]:
    device = getattr(args, "device", "cuda")
    args.device = device
    rows = RowSink(getattr(args, "rows_jsonl", None))
    if device.startswith("cuda") and not torch.cuda.is_available():
        rows.append({"skipped": "no GPU"})
        return rows
    shape = SHAPES[getattr(args, "shape", "qwen3-0.6b")]
    ceilings = {"copy_gb_s": copy_bandwidth(device), "matmul_tflops": matmul_tflops(device, torch.bfloat16)}
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    rows.append({"what": "ceilings", "device": name, **ceilings})
    print(f"  {name}: copy {ceilings['copy_gb_s']:.0f} GB/s (read + write), bf16 matmul "
          f"{ceilings['matmul_tflops']:.0f} TFLOP/s", flush=True)
    hf, model = random_pair(shape, device, run_dtype(device))
    loop = Loop()
    try:
        step_ms = bench_decode_variants(loop, model, shape, args, ceilings, rows)
        bench_transformers(hf, shape, args, step_ms, rows)
    finally:
        loop.close()
    return rows

