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

This module: the parts' list and the run (`main`). The helpers: bench/common.py; prefill, decode
and hf: bench/throughput.py; grpc: bench/grpc_overhead.py; prefix: bench/prefix.py; lora:
bench/lora.py; the table and plots: bench/report.py; the other parts: the files named above.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Re-exported: other scripts import the helpers and the parts from here.
from bench.common import (
    ARGMAX,
    MODEL_DIR,
    PROMPT_LEN,
    RESULTS,
    ROOT,
    SEED,
    Loop,
    executor,
    machine,
    prompts,
    serve,
    timed,
    weight_bytes,
)
from bench.grpc_overhead import bench_grpc
from bench.lora import LORA_MODULES, LORA_RANK, bench_lora, random_lora_source
from bench.prefix import QUESTION_LEN, SYSTEM_PROMPT_LEN, bench_prefix
from bench.report import plots, table
from bench.throughput import bench_decode, bench_hf, bench_prefill

__all__ = ["ARGMAX", "GPU_PARTS", "LORA_MODULES", "LORA_RANK", "MODEL_DIR", "PARTS", "PROMPT_LEN", "QUESTION_LEN",
           "RESULTS", "ROOT", "SEED", "SYSTEM_PROMPT_LEN", "Loop", "bench_decode", "bench_grpc", "bench_hf",
           "bench_lora", "bench_prefill", "bench_prefix", "executor", "machine", "main", "plots", "prompts",
           "random_lora_source", "serve", "table", "timed", "weight_bytes"]

PARTS = ("prefill", "decode", "grpc", "hf", "gpu", "offline", "prefix", "lora", "peers", "transfer", "tp")
GPU_PARTS = ("gpu", "offline")  # bench/gpu.py and bench/offline.py: their own random model, no MODEL_DIR


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
    p.add_argument("--rows-jsonl", default=None,
                   help="the GPU parts also append each row to this JSON-lines file as it is made")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if bad := [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]:
        p.error(f"--dtypes: {', '.join(bad)} is not one of float32, bfloat16, float16")
    if args.out and not Path(args.out).resolve().parent.is_dir():  # found out now, not after the run
        p.error(f"--out {args.out}: the directory {Path(args.out).resolve().parent} does not exist")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not MODEL_DIR.is_dir() and set(parts) - set(GPU_PARTS):
        p.error(f"{MODEL_DIR} is missing: run `make model` first")
    results: dict[str, Any] = {
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
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
