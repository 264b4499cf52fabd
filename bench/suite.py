"""`python -m bench`: the performance suite; results and how to read them: bench/RESULTS.md.

Parts, on the embedded SmolLM2-135M (fixed, seeded workloads):
  prefill   batch_prefill of 32 prompts x 128 tokens as one call vs 32 prefill calls in a row
  decode    decode tokens/s at batch 1, 8, 32, 64 through BatchDecode and UnifiedDecode (gRPC,
            unix socket, ARGMAX), with the achieved memory bandwidth (weights + KV read per step)
  grpc      the same decode step in-process and over gRPC (TCP loopback, unix socket) for the
            logits policies FULL fp32, FULL bf16, ARGMAX and SAMPLE: overhead in ms and as a ratio,
            with the client in the server's process and in its own (bench/grpc_client.py; there also
            through UnifiedDecode and a StepSession stream)
  hf        ours vs transformers on the same weights: prefill and decode tokens/s at batch 1, 32
            (transformers `generate` with its static cache)
  gpu       on CUDA ("skipped: no GPU" else), a Qwen3-0.6B-shaped random model in bf16 (bench/gpu.py):
            decode steps through sdpa, triton and triton + CUDA graphs against the bandwidth floor,
            batch_prefill(32) vs serial, gRPC at batch 32, decode vs transformers on the same weights
  offline   on CUDA, nano-vllm's offline benchmark through the reference scheduler (bench/offline.py):
            256 requests, prompt and output lengths uniform in 100-1024, ours vs transformers
  prefix    prefill of a long shared system prompt + a question, with and without a prefix-cache hit
  lora      decode step time with no adapter, one rank-16 adapter on every row, and rows mixed over
            four adapters and the base model (in-process)
  peers     ours beside llama.cpp (F32 and Q8_0 GGUFs made by its own quantizer) and CTranslate2
            (fp32) on the same weights: decode at batch 1 and 32, a 128-token prefill, batched
            prefill against the fp32 peak (bench/peers.py; bench/requirements-peers.txt)
  transfer  one KV cache of 1k and 8k tokens (fp32) moved between two servers in processes of their
            own (ExportKv into ImportKv, TCP loopback and unix sockets) vs its prefill, and vs a plain
            memory copy, each move checked by a decode step (bench/transfer.py; --quick: 1k only)
  tp        decode (batch 1 and 8) and a 128-token prefill of a random 126M Llama served at
            --tensor-parallel-size 1 and 2 (--tp-device cuda: 1..N GPUs) (bench/tensor_parallel.py)

Prefix caching is off in every part but `prefix`, so repeated workloads are computed each time.

Writes bench/results/<date>-<host>.json and PNG plots (bench/results/plots/), prints a table.
The service never imports this; transformers and matplotlib are bench/test dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.types import DecodeInput, LogitsKind, LogitsPolicy, LoraSource, PrefillInput

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"
RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("prefill", "decode", "grpc", "hf", "gpu", "offline", "prefix", "lora", "peers", "transfer", "tp")
GPU_PARTS = ("gpu", "offline")  # bench/gpu.py and bench/offline.py: their own random model, no MODEL_DIR
SYSTEM_PROMPT_LEN = 1024
QUESTION_LEN = 32
SEED = 1234
PROMPT_LEN = 128
ARGMAX = LogitsPolicy(kind=LogitsKind.ARGMAX)


# -- helpers ---------------------------------------------------------------------------------
def prompts(n: int, length: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(n, length)).tolist()


def machine() -> dict[str, Any]:
    model = platform.processor() or ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "host": socket.gethostname(), "cpu": model, "cores": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "python": platform.python_version(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg_start": list(os.getloadavg()),
    }


def executor(dtype: str, num_blocks: int = 2048, device: str = "cpu", model_dir: Path = MODEL_DIR,
             prefix_caching: bool = False) -> LlmExecutor:
    return LlmExecutor(LlmExecutorConfig(model_dir=str(model_dir), dtype=dtype, device=device,
                                         num_blocks=num_blocks, max_batch_size=64, prefix_caching=prefix_caching))


class Loop:
    """An event loop on a thread: executor calls in-process, and optionally a gRPC server on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def serve(loop: Loop, ex, **config):
    from service.config import ServeConfig
    from service.server import ExecutorServer

    async def start():
        server = ExecutorServer(ServeConfig(executor="llm", model=str(MODEL_DIR), warmup_on_start=False,
                                            cache_ttl_seconds=0, **config), ex)
        await server.start()
        return server

    return loop.run(start())


def timed(fn, *args) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def weight_bytes(ex: LlmExecutor) -> int:
    return ex.parameter_bytes


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
                    times, exec_times = [], []
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


# -- (c) the cost of gRPC --------------------------------------------------------------------
def bench_grpc(args) -> list[dict]:
    from client import DecodeInput as CDecode
    from client import ExecutorClient
    from client import LogitsPolicy as CPolicy
    from client.types import KvCacheHandle as CHandle
    from executors.types import DType
    from executors.types import KvCacheHandle as DHandle

    policies = {
        "FULL fp32": (LogitsPolicy(), CPolicy.full("float32")),
        "FULL bf16": (LogitsPolicy(full_dtype=DType.BFLOAT16), CPolicy.full("bfloat16")),
        "ARGMAX": (ARGMAX, CPolicy.argmax()),
        "SAMPLE": (LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, top_p=0.95, seed=1),
                   CPolicy.sample(0.8, top_p=0.95, seed=1)),
    }
    rows = []
    ex = executor("float32")
    rounds = {1: 5 if args.quick else 20, 32: 3 if args.quick else 8}
    for transport in ("tcp", "unix"):
        loop = Loop()
        if transport == "tcp":
            server = serve(loop, ex, host="127.0.0.1", port=0)
        else:
            server = serve(loop, ex, unix_socket=tempfile.mktemp(prefix="modelexec-bench-", suffix=".sock"))
        with ExecutorClient(server.address, timeout=600) as c:
            c.warmup()
            for b in (1, 32):
                outs = loop.run(ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX)
                                                  for p in prompts(b, PROMPT_LEN, ex.vocab_size)]))
                lengths = {o.kv_cache.cache_id: o.kv_cache.sequence_length for o in outs}
                ids = list(lengths)
                for name, (dpol, cpol) in policies.items():
                    # Paired within each call: its wall time minus the executor time it reports,
                    # so the model step's own variance (other load on the machine) cancels out.
                    inproc, remote, steps = [], [], []
                    for r in range(rounds[b] + 1):
                        dins = [DecodeInput(token_id=5, kv_cache=DHandle(cid, lengths[cid]), logits_policy=dpol)
                                for cid in ids]
                        outs, exec_ns, wall_ns = loop.run(_inproc_batch_decode(ex, dins))
                        for o in outs:
                            lengths[o.kv_cache.cache_id] = o.kv_cache.sequence_length
                        cins = [CDecode(5, CHandle(cid, lengths[cid]), logits_policy=cpol) for cid in ids]
                        t_rpc, couts = timed(c.batch_decode, cins)
                        for o in couts:
                            lengths[o.kv_cache.cache_id] = o.kv_cache.sequence_length
                        if r:
                            inproc.append((wall_ns - exec_ns) / 1e9)
                            remote.append(t_rpc - couts[0].timing.executor_ns / 1e9)
                            steps += [exec_ns / 1e9, couts[0].timing.executor_ns / 1e9]
                    step = statistics.median(steps) + statistics.median(inproc)  # the in-process call
                    over = statistics.median(remote) - statistics.median(inproc)
                    rows.append({"transport": transport, "client": "in-process", "rpc": "BatchDecode",
                                 "batch": b, "policy": name,
                                 "inproc_ms": step * 1e3,
                                 "grpc_ms": (step + over) * 1e3, "overhead_ms": over * 1e3,
                                 "overhead_ratio": over / step, "inproc_call_overhead_ms": statistics.median(inproc) * 1e3,
                                 "rounds": rounds[b]})
                    print(f"  grpc {transport:4s} batch {b:2d} {name:9s}: in-process {step * 1e3:7.2f} ms, "
                          f"over gRPC +{over * 1e3:6.3f} ms ({100 * over / step:5.1f}%)", flush=True)
                for cid in ids:
                    loop.run(ex.release_cache(cid))
        # The same calls from a client in a process of its own, as a scheduler would make them
        # (bench/grpc_client.py): no interpreter lock shared with the server.
        for b in (1, 32):
            proc = subprocess.run([sys.executable, "-m", "bench.grpc_client", "--address", server.address,
                                   "--batch", str(b), "--rounds", str(rounds[b]), "--prompt-len", str(PROMPT_LEN),
                                   "--vocab", str(ex.vocab_size)],
                                  capture_output=True, text=True, timeout=1800, cwd=ROOT, check=True)
            for rpc, by_policy in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                for name, remote in by_policy.items():
                    base = next(x for x in rows if x["transport"] == transport and x["client"] == "in-process"
                                and x["batch"] == b and x["policy"] == name)
                    step = base["inproc_ms"] / 1e3
                    over = statistics.median(remote) - base["inproc_call_overhead_ms"] / 1e3
                    rows.append({**base, "client": "process", "rpc": rpc, "grpc_ms": (step + over) * 1e3,
                                 "overhead_ms": over * 1e3, "overhead_ratio": over / step})
                    print(f"  grpc {transport:4s} batch {b:2d} {name:9s}: in-process {step * 1e3:7.2f} ms, over "
                          f"{rpc} from another process +{over * 1e3:6.3f} ms ({100 * over / step:5.1f}%)", flush=True)
        if transport == "unix":
            rows += _echo_rows(loop, server, ex, rows, rounds[1])
        loop.run(server.stop(0))
        loop.close()
    ex.worker.close()
    return rows


def _echo_rows(loop: Loop, server, ex, rows: list[dict], rounds: int) -> list[dict]:
    """A bare grpc.aio echo with our batch-1 ARGMAX messages' sizes (bench/echo.py), and our
    overhead over it for unary BatchDecode and for StepSession steps; also over the same echo
    answering only after waiting as long as our step on a worker thread (what a call that
    idles through a model step costs gRPC and the machine, whoever serves it)."""
    from bench.echo import echo_round_trips
    from client import DecodeInput as CDecode
    from client import ExecutorClient
    from client import LogitsPolicy as CPolicy
    from client import convert

    with ExecutorClient(server.address, timeout=600) as c:
        out = loop.run(ex.prefill(PrefillInput(input_ids=prompts(1, PROMPT_LEN, ex.vocab_size)[0],
                                               logits_policy=ARGMAX)))
        from client.types import KvCacheHandle as CHandle

        handle = CHandle(out.kv_cache.cache_id, out.kv_cache.sequence_length, tuple(out.kv_cache.block_ids))
        request = convert.batch_decode_request([CDecode(5, handle, logits_policy=CPolicy.argmax())])
        response = c.stub.BatchDecode(request, timeout=60)
        loop.run(ex.release_cache(out.kv_cache.cache_id))
    sizes = (request.ByteSize(), response.ByteSize())
    step = next(x for x in rows if x["transport"] == "unix" and x.get("client") == "process" and x["batch"] == 1
                and x["policy"] == "ARGMAX")["inproc_ms"] / 1e3
    echo = echo_round_trips(loop, *sizes, rounds=max(rounds * 10, 100), step_s=step, step_rounds=max(rounds * 4, 20))
    out_rows = []
    for rpc, kind in (("BatchDecode", "unary"), ("StepSession", "stream")):
        ours = next(x for x in rows if x["transport"] == "unix" and x.get("client") == "process"
                    and x.get("rpc") == rpc and x["batch"] == 1 and x["policy"] == "ARGMAX")
        over = ours["overhead_ms"] - echo[kind] * 1e3
        after = echo[f"{kind} after step"] * 1e3
        out_rows.append({"transport": "unix", "client": "process", "rpc": f"echo {kind}", "batch": 1,
                         "policy": "ARGMAX", "request_bytes": sizes[0], "response_bytes": sizes[1],
                         "echo_ms": echo[kind] * 1e3, "ours_overhead_ms": ours["overhead_ms"],
                         "over_echo_ms": over, "step_ms": step * 1e3, "echo_after_step_ms": after,
                         "over_echo_after_step_ms": ours["overhead_ms"] - after})
        print(f"  grpc unix batch  1 {rpc:13s}: our overhead {ours['overhead_ms']:.3f} ms, a bare grpc.aio echo "
              f"({kind}, {sizes[0]} / {sizes[1]} bytes) {echo[kind] * 1e3:.3f} ms: +{over:.3f} ms; the echo "
              f"answering after a {step * 1e3:.1f} ms wait on a worker thread {after:.3f} ms: "
              f"{ours['overhead_ms'] - after:+.3f} ms", flush=True)
    return out_rows


async def _inproc_batch_decode(ex, inputs):
    """batch_decode in-process: (outputs, executor ns as the service would report it, wall ns)."""
    from executors.timing import CallTimer, current_call_timer

    timer = CallTimer()
    current_call_timer.set(timer)
    t0 = time.perf_counter_ns()
    outs = await ex.batch_decode(inputs)
    return outs, timer.executor_ns, time.perf_counter_ns() - t0


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
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=tdt).eval()
        hf.generation_config.eos_token_id = None
        ex = executor(dtype)
        loop = Loop()
        loop.run(ex.warmup())
        for b in (1, 32):
            ps = prompts(b, PROMPT_LEN, ex.vocab_size, SEED + b)
            ids = torch.tensor(ps)
            mask = torch.ones_like(ids)

            def gen(n):
                with torch.inference_mode():
                    return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                       pad_token_id=0, cache_implementation="static")

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


# -- (e) GPU-only parts: bench/gpu.py ----------------------------------------------------------


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


# -- report ----------------------------------------------------------------------------------
def table(results: dict) -> str:
    out = []
    r = results["results"]
    if "prefill" in r:
        out.append("(a) batch_prefill vs serial prefill")
        for x in r["prefill"]:
            out.append(f"    {x['dtype']:8s} {x['prompts']}x{x['prompt_len']}: one call {x['batched_s']:.2f} s "
                       f"({x['batched_tok_s']:.0f} tok/s), serial {x['serial_s']:.2f} s: {x['ratio']:.2f}x "
                       f"[target >= 2x: {'met' if x['ratio'] >= 2 else 'SHORT'}]")
    if "decode" in r:
        out.append("(b) decode throughput (gRPC unix socket, ARGMAX, context ~128)")
        out.append(f"    {'dtype':8s} {'rpc':13s} {'batch':>5s} {'ms/step':>9s} {'tok/s':>8s} {'GB/s':>6s}")
        for x in r["decode"]:
            out.append(f"    {x['dtype']:8s} {x['rpc']:13s} {x['batch']:5d} {x['step_ms']:9.1f} {x['tok_s']:8.1f} "
                       f"{x['bandwidth_gb_s']:6.1f}")
    if "grpc" in r:
        out.append("(c) gRPC overhead on one decode step (fp32, medians; client in the server's process or its own)")
        out.append(f"    {'transport':9s} {'client':10s} {'rpc':13s} {'batch':>5s} {'policy':10s} {'in-proc ms':>10s} "
                   f"{'+ms':>7s} {'ratio':>7s}")
        for x in r["grpc"]:
            if "echo_ms" in x:
                continue
            out.append(f"    {x['transport']:9s} {x.get('client', 'in-process'):10s} {x.get('rpc', 'BatchDecode'):13s} "
                       f"{x['batch']:5d} {x['policy']:10s} {x['inproc_ms']:10.2f} {x['overhead_ms']:7.3f} "
                       f"{100 * x['overhead_ratio']:6.1f}%")
        for x in r["grpc"]:
            if "echo_ms" in x:
                met = "met" if x["over_echo_ms"] <= 0.3 else "SHORT"
                out.append(f"    batch 1 over a bare grpc.aio {x['rpc']} ({x['request_bytes']} / {x['response_bytes']} "
                           f"bytes, {x['echo_ms']:.3f} ms): ours {x['ours_overhead_ms']:.3f} ms, "
                           f"+{x['over_echo_ms']:.3f} ms  [target <= 0.3 ms: {met}]")
                if "echo_after_step_ms" in x:
                    out.append(f"      the same echo answering after a {x['step_ms']:.1f} ms wait on a worker thread "
                               f"{x['echo_after_step_ms']:.3f} ms: ours {x['over_echo_after_step_ms']:+.3f} ms")
    if "hf" in r:
        out.append("(d) ours vs transformers (same weights, in-process)")
        for x in r["hf"]:
            if "skipped" in x:
                out.append(f"    skipped: {x['skipped']}")
                continue
            out.append(f"    {x['dtype']:8s} batch {x['batch']:2d}: prefill {x['ours_prefill_tok_s']:7.0f} vs "
                       f"{x['hf_prefill_tok_s']:7.0f} tok/s ({x['prefill_ratio']:.2f}x); decode "
                       f"{x['ours_decode_tok_s']:6.1f} vs {x['hf_decode_tok_s']:6.1f} tok/s ({x['decode_ratio']:.2f}x)")
    if "prefix" in r:
        out.append("(f) prefix caching: prefill of a shared system prompt + question (in-process)")
        for x in r["prefix"]:
            out.append(f"    {x['dtype']:8s} {x['system_len']}+{x['question_len']} tokens: cold {x['cold_ms']:.1f} ms, "
                       f"prefix hit {x['hit_ms']:.1f} ms ({x['reused_tokens']} tokens reused): {x['speedup']:.1f}x")
    if "lora" in r:
        out.append(f"(g) multi-LoRA: decode step, rank {LORA_RANK} on all seven projections (in-process, context ~128)")
        for x in r["lora"]:
            out.append(f"    {x['dtype']:8s} batch {x['batch']:2d} {x['mix']:18s} {x['step_ms']:8.1f} ms "
                       f"({x['vs_base']:.2f}x base)")
    if "gpu" in r or "offline" in r:
        from bench.gpu_report import table_lines

        out.extend(table_lines(r.get("gpu", []) + r.get("offline", [])))
    if "peers" in r:
        from bench.peers import table_lines as peer_lines

        out.extend(peer_lines(r["peers"]))
    if "transfer" in r:
        from bench.transfer import table_lines as transfer_lines

        out.extend(transfer_lines(r["transfer"]))
    if "tp" in r:
        from bench.tensor_parallel import table_lines as tp_lines

        out.extend(tp_lines(r["tp"]))
    return "\n".join(out)


def plots(results: dict, out: Path, latest: bool) -> list[str]:
    """PNG plots beside `out` (<its stem>-<name>.png) and, for a run into bench/results
    (`latest`), copies under bench/results/plots/, which the README shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no plots: pip install -r bench/requirements.txt)", flush=True)
        return []
    written = []
    plot_dir = RESULTS / "plots"
    if latest:
        plot_dir.mkdir(parents=True, exist_ok=True)
    r = results["results"]
    title = f"{results['machine']['cpu']} ({results['machine']['cores']} cores), SmolLM2-135M"

    def save(fig, name):
        for path in [out.with_name(f"{out.stem}-{name}.png")] + ([plot_dir / f"{name}.png"] if latest else []):
            fig.savefig(path, dpi=110, bbox_inches="tight")
            written.append(str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT)
                           else str(path))
        plt.close(fig)

    if r.get("decode"):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for dtype in sorted({x["dtype"] for x in r["decode"]}):
            for rpc, style in (("BatchDecode", "-o"), ("UnifiedDecode", "--s")):
                xs = [x for x in r["decode"] if x["dtype"] == dtype and x["rpc"] == rpc]
                ax1.plot([x["batch"] for x in xs], [x["tok_s"] for x in xs], style, label=f"{rpc} {dtype}")
                ax2.plot([x["batch"] for x in xs], [x["bandwidth_gb_s"] for x in xs], style, label=f"{rpc} {dtype}")
        for ax, label in ((ax1, "decode tokens/s"), (ax2, "achieved GB/s (weights + KV per step)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=8)
        fig.suptitle(f"Decode throughput (context ~128, gRPC unix socket) - {title}", fontsize=9)
        save(fig, "decode")
    if r.get("grpc"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, b in zip(axes, (1, 32)):
            xs = [x for x in r["grpc"] if x["batch"] == b and x.get("rpc", "BatchDecode") == "BatchDecode"]
            names = list(dict.fromkeys(x["policy"] for x in xs))
            series = [(t, c) for t in ("tcp", "unix") for c in ("in-process", "process")
                      if any(x["transport"] == t and x.get("client", "in-process") == c for x in xs)]
            width = 0.8 / len(series)
            for k, (transport, client) in enumerate(series):
                vals = [next(x["overhead_ms"] for x in xs if x["policy"] == n and x["transport"] == transport
                             and x.get("client", "in-process") == client) for n in names]
                ax.bar(np.arange(len(names)) + k * width, vals, width,
                       label=f"{transport}, client {'in the server process' if client == 'in-process' else 'apart'}")
            ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
            ax.set_ylabel("gRPC overhead per step (ms)")
            ax.set_title(f"batch {b}", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
        fig.suptitle(f"Decode step over gRPC minus in-process - {title}", fontsize=9)
        save(fig, "grpc")
    hf = [x for x in r.get("hf", []) if "skipped" not in x]
    if hf:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, what in zip(axes, ("prefill", "decode")):
            labels = [f"{x['dtype']}\nbatch {x['batch']}" for x in hf]
            ax.bar(np.arange(len(hf)) - 0.2, [x[f"ours_{what}_tok_s"] for x in hf], 0.4, label="modelexec")
            ax.bar(np.arange(len(hf)) + 0.2, [x[f"hf_{what}_tok_s"] for x in hf], 0.4, label="transformers")
            ax.set_xticks(np.arange(len(hf)), labels)
            ax.set_ylabel(f"{what} tokens/s")
            ax.grid(alpha=0.3, axis="y")
            ax.legend()
        fig.suptitle(f"Ours vs transformers (same weights) - {title}", fontsize=9)
        save(fig, "vs_transformers")
    if r.get("prefill"):
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = r["prefill"]
        ax.bar(np.arange(len(xs)) - 0.2, [x["batched_s"] for x in xs], 0.4, label="one batch_prefill call")
        ax.bar(np.arange(len(xs)) + 0.2, [x["serial_s"] for x in xs], 0.4, label="prefill calls in a row")
        ax.set_xticks(np.arange(len(xs)), [f"{x['dtype']}\n{x['ratio']:.2f}x" for x in xs])
        ax.set_ylabel(f"seconds for {xs[0]['prompts']} x {xs[0]['prompt_len']} tokens")
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
        ax.set_title(title, fontsize=8)
        save(fig, "prefill")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Parts:\n" + __doc__.split("Parts, on the embedded SmolLM2-135M (fixed, seeded "
                                                                  "workloads):\n")[1].split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer prompts, steps and rounds (3-4 minutes instead of ~7)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--dtypes", default="float32,bfloat16", help="dtypes for prefill, decode and hf")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<date>-<host>.json)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--device", default="cuda", help="the device of the GPU parts (default %(default)s)")
    p.add_argument("--tp-device", default="cpu", choices=("cpu", "cuda"),
                   help="the device of the tp part: cpu (sizes 1 and 2) or cuda (1..N GPUs) (default %(default)s)")
    p.add_argument("--shape", default="qwen3-0.6b", choices=("qwen3-0.6b", "tiny"),
                   help="the GPU parts' model: Qwen3-0.6B-shaped, or tiny (a dry run of their code, on a CPU too)")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if args.threads:
        torch.set_num_threads(args.threads)
    if not MODEL_DIR.is_dir() and set(parts) - set(GPU_PARTS):
        p.error(f"{MODEL_DIR} is missing: run `make model` first")
    results: dict[str, Any] = {
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": MODEL_DIR.name if set(parts) - set(GPU_PARTS) else args.shape, "machine": machine(), "quick": args.quick, "results": {},
    }
    started = time.perf_counter()
    for part in parts:
        print(f"[{part}]", flush=True)
        t0 = time.perf_counter()
        if part == "prefill":
            results["results"]["prefill"] = bench_prefill(args, dtypes)
        elif part == "decode":
            results["results"]["decode"] = bench_decode(args, dtypes)
        elif part == "grpc":
            results["results"]["grpc"] = bench_grpc(args)
        elif part == "hf":
            results["results"]["hf"] = bench_hf(args, dtypes)
        elif part == "prefix":
            results["results"]["prefix"] = bench_prefix(args, dtypes)
        elif part == "lora":
            results["results"]["lora"] = bench_lora(args, dtypes)
        elif part == "gpu":
            from bench.gpu import bench_gpu

            results["results"]["gpu"] = bench_gpu(args)
        elif part == "offline":
            from bench.offline import bench_offline

            results["results"]["offline"] = bench_offline(args)
        elif part == "peers":
            from bench.peers import bench_peers

            results["results"]["peers"] = bench_peers(args)
        elif part == "transfer":
            from bench.transfer import bench_transfer

            results["results"]["transfer"] = bench_transfer(args)
        elif part == "tp":
            from bench.tensor_parallel import bench_tp

            results["results"]["tp"] = bench_tp(args)
        for x in results["results"].get(part, []):
            if "skipped" in x:
                print(f"  skipped: {x['skipped']}", flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    results["seconds"] = time.perf_counter() - started
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"{dt.date.today().isoformat()}-{socket.gethostname()}"
    if not args.out and (RESULTS / f"{stem}.json").exists():  # never overwrite an earlier run of the day
        stem = next(f"{stem}-{n}" for n in itertools.count(2) if not (RESULTS / f"{stem}-{n}.json").exists())
    out = Path(args.out) if args.out else RESULTS / f"{stem}.json"
    if not args.no_plots:
        results["plots"] = plots(results, out, latest=not args.out)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + table(results))
    print(f"\nwrote {out}" + (f" and {len(results.get('plots', []))} plots" if results.get("plots") else ""))
    return 0
