"""Bench part `peers`: ours beside llama.cpp and CTranslate2 on the same weights, in one run.

- llama.cpp (llama-cpp-python, built from source by `pip install -r bench/requirements-peers.txt`):
  the packaged Q4_1 GGUF requantized by llama.cpp's own quantizer to F32 (the same weights
  as ours) and Q8_0; decode at batch 1 and a 128-token prefill, 2 threads.
- CTranslate2 (fp32, converted from the same model directory): decode at batch 1 and 32
  (the difference of generate() with 17 and with 1 new tokens, over 16) and a 128-token
  prefill (generate() of 1 token), 2 threads.
- Ours, fp32: decode steps at batch 1 and 32 through gRPC (unix socket, ARGMAX) from a
  client in a process of its own (bench/grpc_client.py), a 128-token Prefill through gRPC,
  and batch_prefill of 32 x 128 tokens in-process against the machine's fp32 FMA peak,
  measured in the same process right before and after (the better of the two: the VM's
  shared cores vary from minute to minute) as register-only FMAs as wide as the matmul
  tiles run (CpuKernels.fma_flops: AVX-512 where the CPU has it). A 2048-cube torch sgemm's
  rate is reported beside it: it was the ceiling until the kernels' AVX-512 tiles passed it
  (bench/RESULTS.md run 21).
- Ours, `--quantization int8` (int8 weights, Q8_0's grouping): the same, beside llama.cpp's
  Q8_0.

Each engine runs in a process of its own (`python -m bench.peers ENGINE` prints its row as
JSON): runtimes that keep their worker threads spinning after a call (OpenMP's) would
otherwise take the CPU from the next engine. The engines run in rounds (three; one with
--quick), and each ratio against a target is the median of the rounds' ratios, each taken
between rows minutes apart: this machine's shared cores drift by 10-20 % over that long a
run, more than the margins being judged. Converted models are kept under models/peers/
and reused. Peers are bench dependencies, never the service's; without them this part
reports "skipped" and says how to install them.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (ARGMAX, MODEL_DIR, PROMPT_LEN, ROOT, SEED, Loop, executor, prefill_flops, prompts, serve,
                          timed)
from executors.cpu_kernels import cpu_kernels
from executors.omp_pool import in_passing_thread
from executors.types import PrefillInput

PEERS_DIR = ROOT / "models" / "peers"
THREADS = 2
DECODE_STEPS = 16
ROUNDS = 3  # every engine once a round (bench_peers)


def missing() -> str | None:
    try:
        import ctranslate2  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return (f"{e.name} is not installed: pip install -r bench/requirements-peers.txt "
                "(llama-cpp-python builds from source: ~5-8 minutes on 2 cores)")
    return None


def sgemm_gflops() -> float:
    """A 2048-cube torch sgemm's rate, on a thread that ends with it: the OpenMP pool it makes
    goes along, and the executor's worker keeps the process's only one (omp_pool.py)."""
    return in_passing_thread(_sgemm_gflops)


def _sgemm_gflops() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(timed(lambda: a @ b)[0] for _ in range(7))
    return 2 * 2048 ** 3 / best / 1e9


def fma_peak_gflops() -> float:
    """The FMA units' rate on torch's threads (fma_rate.c), best of 5 calls of ~0.1 s each;
    a torch sgemm's where the kernels cannot be built (then the model runs on torch's too).
    On a thread that ends with it, as the sgemm."""
    return in_passing_thread(_fma_peak_gflops)


def _fma_peak_gflops() -> float:
    kernels = cpu_kernels()
    if kernels is None:
        return _sgemm_gflops()
    kernels.fma_flops(10_000)
    runs = [timed(kernels.fma_flops, 2_000_000) for _ in range(5)]
    return max(flops / seconds for seconds, flops in runs) / 1e9



def llama_gguf(kind: str) -> Path:
    """The packaged GGUF requantized by llama.cpp to `kind` (f32, q8_0), made once."""
    import llama_cpp

    from executors.gguf_import import default_gguf_path

    out = PEERS_DIR / f"smollm2-135m-instruct-{kind}.gguf"
    if not out.is_file():
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[kind]
        params.allow_requantize = True
        params.nthread = THREADS
        rc = llama_cpp.llama_model_quantize(str(default_gguf_path()).encode(), str(out).encode(),
                                           ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) making {out.name}")
    return out


def bench_llama(kind: str, prompt: list[int]) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(llama_gguf(kind)), n_ctx=1024, n_batch=512, n_threads=THREADS,
                          n_threads_batch=THREADS, verbose=False)
    prefill, steps = [], []
    for _ in range(3):
        llm.reset()
        prefill.append(timed(llm.eval, prompt)[0])
        for _ in range(DECODE_STEPS):
            steps.append(timed(llm.eval, [5])[0])
    return {"engine": f"llama.cpp {kind.upper()}", "decode_ms_b1": statistics.median(steps) * 1e3,
            "prefill_ms": min(prefill) * 1e3}


def ct2_model() -> Path:
    import ctranslate2

    out = PEERS_DIR / "ct2-fp32"
    if not (out / "model.bin").is_file():
        ctranslate2.converters.TransformersConverter(str(MODEL_DIR)).convert(str(out), quantization="float32",
                                                                             force=True)
    return out


def bench_ct2(vocab: int) -> dict:
    import ctranslate2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    gen = ctranslate2.Generator(str(ct2_model()), device="cpu", compute_type="float32", inter_threads=1,
                                intra_threads=THREADS)
    row = {"engine": "CTranslate2 fp32"}
    for b in (1, 32):
        batch = [[tok.id_to_token(t) for t in p] for p in prompts(b, PROMPT_LEN, vocab)]

        def run(n: int) -> float:
            return timed(lambda: gen.generate_batch(batch, max_length=n, min_length=n, sampling_topk=1,
                                                    include_prompt_in_result=False))[0]

        run(2)
        one = [run(1) for _ in range(3)]
        more = [run(1 + DECODE_STEPS) for _ in range(3)]
        step = (statistics.median(more) - statistics.median(one)) / DECODE_STEPS
        row[f"decode_ms_b{b}"] = step * 1e3
        row[f"tok_s_b{b}"] = b / step
        if b == 1:
            row["prefill_ms"] = min(one) * 1e3  # the 128-token prompt and the first token's logits
    return row


def bench_ours(vocab: int, quick: bool, quantization: str = "none") -> dict:
    ex = executor("float32", num_blocks=2048, quantization=quantization)
    loop = Loop()
    server = serve(loop, ex, unix_socket=tempfile.mktemp(prefix="modelexec-peers-", suffix=".sock"))
    weights = "int8" if quantization == "int8" else "fp32"
    row: dict = {"engine": f"ours {weights} (gRPC, unix socket, ARGMAX)"}
    try:
        loop.run(ex.warmup())
        for b in (1, 32):
            done = subprocess.run(
                [sys.executable, "-m", "bench.grpc_client", "--address", server.address, "--batch", str(b),
                 "--rounds", str(8 if quick else DECODE_STEPS), "--prompt-len", str(PROMPT_LEN), "--vocab", str(vocab),
                 "--policies", "ARGMAX", "--walls"],
                capture_output=True, text=True, timeout=1800, cwd=ROOT, check=True)
            walls = json.loads(done.stdout.strip().splitlines()[-1])
            for rpc in ("BatchDecode", "StepSession"):
                step = statistics.median(walls[rpc]["ARGMAX"])
                row[f"decode_ms_b{b}" + ("" if rpc == "BatchDecode" else "_stream")] = step * 1e3
                row[f"tok_s_b{b}" + ("" if rpc == "BatchDecode" else "_stream")] = b / step
        from client import ExecutorClient
        from client import LogitsPolicy as ClientPolicy
        from client import PrefillInput as ClientPrefill

        (prompt,) = prompts(1, PROMPT_LEN, vocab, SEED + 1)
        with ExecutorClient(server.address, timeout=600) as c:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = c.prefill(ClientPrefill(prompt, logits_policy=ClientPolicy.argmax()))
                times.append(time.perf_counter() - t0)
                c.release_cache(out.kv_cache)
        row["prefill_ms"] = min(times) * 1e3
        batch = [PrefillInput(input_ids=p, logits_policy=ARGMAX) for p in prompts(32, PROMPT_LEN, vocab, SEED + 2)]

        async def batched():
            outs = await ex.batch_prefill(batch)
            for o in outs:
                await ex.release_cache(o.kv_cache.cache_id)

        loop.run(batched())
        # The peak right before and after, in this process: the machine's shared cores vary from minute to minute.
        peak = fma_peak_gflops()
        best = min(timed(lambda: loop.run(batched()))[0] for _ in range(2))
        row["fp32_peak_gflops"] = max(peak, fma_peak_gflops())
        row["sgemm_gflops"] = sgemm_gflops()
        row["batched_prefill_gflops"] = prefill_flops(ex, 32, PROMPT_LEN) / best / 1e9
    finally:
        loop.run(server.stop(0))
        loop.close()
        ex.worker.close()
    return row


ENGINES = ("llama-f32", "llama-q8_0", "ct2", "ours", "ours-int8")


def run_engine(engine: str, quick: bool = False) -> dict:
    torch.set_num_threads(THREADS)
    vocab = 49152
    (prompt,) = prompts(1, PROMPT_LEN, vocab, SEED + 1)
    if engine.startswith("llama-"):
        row = bench_llama(engine.removeprefix("llama-"), prompt)
    elif engine == "ct2":
        row = bench_ct2(vocab)
    else:
        row = bench_ours(vocab, quick, "int8" if engine == "ours-int8" else "none")
    return {"what": "engine", **row}


def bench_peers(args) -> list[dict]:
    """Every engine once a round, ROUNDS rounds (1 with --quick), the order reversed every other
    round: the VM's cores drift by 10-20 % over minutes, so each ratio is taken between rows of
    one round (minutes apart at most) and the table reports the median of the rounds'."""
    why = missing()
    if why:
        return [{"skipped": why}]
    rows = []
    for index in range(1 if args.quick else ROUNDS):
        for engine in ENGINES if index % 2 == 0 else ENGINES[::-1]:
            done = subprocess.run([sys.executable, "-m", "bench.peers", engine, *(["--quick"] if args.quick else [])],
                                  capture_output=True, text=True, timeout=3600, cwd=ROOT, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"bench.peers {engine} failed:\n{done.stderr[-3000:]}")
            row = {**json.loads(done.stdout.strip().splitlines()[-1]), "round": index}
            rows.append(row)
            print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    return rows


def _median_of(rounds: list[dict[str, dict]], engine: str, key: str) -> float:
    return statistics.median(r[engine][key] for r in rounds)


def table_lines(rows: list[dict]) -> list[str]:
    out = ["(h) peers on the same weights (2 threads; decode at context ~128)"]
    if rows and "skipped" in rows[0]:
        return out + [f"    skipped: {rows[0]['skipped']}"]
    by_round: dict[int, dict[str, dict]] = {}
    for r in rows:
        if r["what"] == "engine":
            by_round.setdefault(r.get("round", 0), {})[r["engine"]] = r
    rounds = [by_round[i] for i in sorted(by_round)]
    names = list(rounds[0])
    ours = next(n for n in names if n.startswith("ours fp32"))
    ours_int8 = next((n for n in names if n.startswith("ours int8")), None)
    llama, ct2 = "llama.cpp F32", "CTranslate2 fp32"
    if len(rounds) > 1:
        out.append(f"    medians of {len(rounds)} rounds; each ratio the median of the rounds' own")
    out.append(f"    {'engine':40s} {'b1 ms/step':>10s} {'b32 tok/s':>10s} {'prefill 128 ms':>14s}")
    for name in names:
        b32 = f"{_median_of(rounds, name, 'tok_s_b32'):10.0f}" if "tok_s_b32" in rounds[0][name] else f"{'-':>10s}"
        out.append(f"    {name:40s} {_median_of(rounds, name, 'decode_ms_b1'):10.1f} {b32} "
                   f"{_median_of(rounds, name, 'prefill_ms'):14.0f}")

    def ratio(what: str, per_round, target: str, ok) -> None:
        values = [per_round(r) for r in rounds]
        mid = statistics.median(values)
        listed = f" (rounds: {', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else ""
        out.append(f"    {what.format(f'{mid:.2f}x')}{listed}  [target {target}: {'met' if ok(mid) else 'SHORT'}]")

    ratio("decode batch 1: {} llama.cpp F32's step", lambda r: r[ours]["decode_ms_b1"] / r[llama]["decode_ms_b1"],
          "<= 1.3x", lambda v: v <= 1.3)
    if "decode_ms_b1_stream" in rounds[0][ours]:
        ratio("decode batch 1 on a StepSession stream: {}",
              lambda r: r[ours]["decode_ms_b1_stream"] / r[llama]["decode_ms_b1"], "<= 1.3x", lambda v: v <= 1.3)
    if ours_int8 is not None and "llama.cpp Q8_0" in rounds[0]:
        ratio("decode batch 1, int8 weights: {} llama.cpp Q8_0's step",
              lambda r: r[ours_int8]["decode_ms_b1"] / r["llama.cpp Q8_0"]["decode_ms_b1"], "<= 1.3x",
              lambda v: v <= 1.3)
        if "decode_ms_b1_stream" in rounds[0][ours_int8]:
            ratio("decode batch 1, int8 weights, on a StepSession stream: {}",
                  lambda r: r[ours_int8]["decode_ms_b1_stream"] / r["llama.cpp Q8_0"]["decode_ms_b1"], "<= 1.3x",
                  lambda v: v <= 1.3)
    ratio("decode batch 32: {} CTranslate2's tokens/s", lambda r: r[ours]["tok_s_b32"] / r[ct2]["tok_s_b32"],
          ">= 2x", lambda v: v >= 2)
    ratio("prefill of 128 tokens: {} CTranslate2's time", lambda r: r[ours]["prefill_ms"] / r[ct2]["prefill_ms"],
          "<= 1x", lambda v: v <= 1)
    shares = [r[ours]["batched_prefill_gflops"] / r[ours]["fp32_peak_gflops"] for r in rounds]
    share = statistics.median(shares)
    sgemm = (f"; a torch 2048-cube sgemm: {_median_of(rounds, ours, 'sgemm_gflops'):.0f}"
             if "sgemm_gflops" in rounds[0][ours] else "")
    out.append(f"    batch_prefill 32x128: {_median_of(rounds, ours, 'batched_prefill_gflops'):.0f} GFLOP/s, "
               f"{100 * share:.0f} % of the {_median_of(rounds, ours, 'fp32_peak_gflops'):.0f} GFLOP/s FMA peak"
               f"{sgemm}  [target >= 75 %: {'met' if share >= 0.75 else 'SHORT'}]")
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.peers", description="one engine of the peers part")
    parser.add_argument("engine", choices=ENGINES)
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args()
    print(json.dumps(run_engine(options.engine, options.quick)))
