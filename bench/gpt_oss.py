"""`python -m bench.gpt_oss`: what serving GPT-OSS adds on a CPU: its attention sinks in the
CPU attention kernels, and the dequantization of its MXFP4 experts at load.

- `sinks`: the paged decode kernel (one query token a row over its context) and the prefill
  kernel (a fresh prompt over itself) at gpt-oss's head shape (64 query heads over 8 KV heads
  of 64), float32, with GPT-OSS's sinks and without, in alternating rounds (median); the
  sinks add one term to each head's softmax sum, so the two should be equal.
- `dequant`: mxfp4.dequantize on one of gpt-oss-20b's layers (32 experts: gate/up
  [32, 5760, 2880] and down [32, 2880, 2880] as blocks and scales, random), to bfloat16 as
  the loader serves them: seconds a layer, output GB/s, and the 24 layers' total.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from executors.cpu_kernels import cpu_kernels
from executors.models import mxfp4

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64  # gpt-oss-20b and 120b
BLOCK = 16


def time_sinks(args) -> None:
    kernels = cpu_kernels()
    if kernels is None:
        print("sinks: the CPU kernels cannot be built here", flush=True)
        return
    g = torch.Generator().manual_seed(0)
    sinks = torch.randn(HEADS, generator=g)
    scale = HEAD_DIM ** -0.5
    for context in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            blocks = batch * -(-context // BLOCK)
            kpool = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
            vpool = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
            tables = torch.randperm(blocks, generator=g).to(torch.int32).view(batch, -1)
            lo = torch.zeros(batch, dtype=torch.int32)
            hi = torch.full((batch,), context, dtype=torch.int32)
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
            out = torch.empty(batch, HEADS * HEAD_DIM)

            def run(with_sinks: bool, q=q, kpool=kpool, vpool=vpool, tables=tables, lo=lo, hi=hi, out=out):
                kernels.decode_attention(q, kpool, vpool, tables, lo, hi, scale, out,
                                         sinks=sinks if with_sinks else None)

            report(f"decode, context {context:5d}, batch {batch:2d}", run, args.rounds, args.repeat)
    for n in (int(x) for x in args.prompts.split(",")):
        q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g), torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
        out = torch.empty_like(q)

        def run(with_sinks: bool, q=q, k=k, v=v, out=out):
            kernels.prefill_attention(q, k, v, 1, scale, out, sinks=sinks if with_sinks else None)

        report(f"prefill, prompt {n:5d}", run, args.rounds, max(1, args.repeat // 10))


def report(label: str, run, rounds: int, repeat: int) -> None:
    """Median over `rounds` alternating rounds of each side's mean over `repeat` calls, in us."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds + 1):
        for side in (True, False):
            t0 = time.perf_counter()
            for _ in range(repeat):
                run(side)
            if r:  # round 0 warms up
                times[side].append((time.perf_counter() - t0) / repeat * 1e6)
    with_sinks, without = statistics.median(times[True]), statistics.median(times[False])
    print(f"{label}: sinks {with_sinks:9.1f} us, none {without:9.1f} us ({with_sinks / without:.3f}x)", flush=True)


def time_dequant(args) -> None:
    g = torch.Generator().manual_seed(1)
    experts, hidden, inter = args.experts, args.hidden, args.intermediate
    total, seconds = 0, []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):  # gate/up, down: [E, rows, cols]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 130, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)
        best = float("inf")
        for _ in range(args.dequant_rounds):
            t0 = time.perf_counter()
            out = mxfp4.dequantize(blocks, scales, torch.bfloat16)
            best = min(best, time.perf_counter() - t0)
        total += out.numel() * out.element_size()
        seconds.append(best)
        print(f"dequant [{experts}, {rows}, {cols}]: {blocks.numel() / 1e6:.0f} MB of blocks -> "
              f"{out.numel() * 2 / 1e9:.2f} GB bfloat16 in {best:.2f} s", flush=True)
    layer = sum(seconds)
    print(f"dequant: a layer's experts in {layer:.2f} s ({total / layer / 1e9:.2f} GB/s of bfloat16 out); "
          f"{args.layers} layers {layer * args.layers:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpt_oss", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="sinks,dequant")
    p.add_argument("--contexts", default="128,1024,4096")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompts", default="128,512")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--repeat", type=int, default=20, help="decode calls a round (a tenth for prefills)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--intermediate", type=int, default=2880)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dequant-rounds", type=int, default=2)
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    print(f"{torch.get_num_threads()} threads, float32 attention, heads {HEADS}/{KV_HEADS} of {HEAD_DIM}", flush=True)
    if "sinks" in parts:
        time_sinks(args)
    if "dequant" in parts:
        time_dequant(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
