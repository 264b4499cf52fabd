"""`python -m bench.gpu_profile`: where a decode step's time goes, on the GPU part's model.

bench/gpu.py says how long a step takes; this says why, for the next change:
- the host side of batch_decode (cProfile, from the executor's worker thread) over many steps replayed from the decode CUDA graphs: Python's share
  of a step that the graph itself runs in a fraction of;
- the device side of eager steps (torch.profiler, CUDA activity): which kernels take the
  step's device time, without graphs, at batch 1 and 32;
- the server's side of ARGMAX steps at batch 32 through gRPC from a client process (cProfile);
- where eager steps synchronize with the device (CUDA's sync-debug mode);
- why a decode-graph capture fails, if it does (last).
Tables go to stdout and, with --out FILE, to FILE. `--device cpu --shape tiny`
is a dry run of this code (the CPU activity only).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

import torch

from bench.common import ARGMAX, PROMPT_LEN, Loop, prompts
from bench.gpu import DRY_RUN, SHAPES, Sizes, new_executor, random_pair, sync
from executors.types import DecodeInput, PrefillInput


def _prefilled(loop: Loop, ex, batch: int, vocab: int) -> list:
    outs = loop.run(ex.batch_prefill([PrefillInput(input_ids=p, logits_policy=ARGMAX)
                                      for p in prompts(batch, PROMPT_LEN, vocab)]))
    return [o.kv_cache for o in outs]


def _steps(loop: Loop, ex, handles: list, n: int) -> list:
    for _ in range(n):
        steps = loop.run(ex.batch_decode([DecodeInput(token_id=1, kv_cache=h, logits_policy=ARGMAX)
                                          for h in handles]))
        handles = [s.kv_cache for s in steps]
    return handles


def host_profile(loop: Loop, ex, batch: int, vocab: int, steps: int) -> str:
    """cProfile over `steps` decode steps, from the executor's worker thread (every thread on 3.12)."""
    handles = _steps(loop, ex, _prefilled(loop, ex, batch, vocab), 3)
    # One profiler, started on the worker thread: Python 3.12's cProfile is one tool for the
    # whole process (a second one refuses to start) and sees every thread; 3.11's, that thread.
    prof = cProfile.Profile()
    ex.worker.schedule(prof.enable).result()
    handles = _steps(loop, ex, handles, steps)
    ex.worker.schedule(prof.disable).result()
    for h in handles:
        loop.run(ex.release_cache(h.cache_id))
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return f"-- host, batch {batch}, {steps} steps (per step: divide by {steps})\n{buf.getvalue()}"


def grpc_profile(loop: Loop, ex, batch: int, vocab: int, rounds: int) -> str:
    """cProfile of the server (every thread on 3.12; the event loop's on 3.11) while a client in
    a process of its own (bench/grpc_client.py) runs `rounds` ARGMAX steps of `batch` rows
    through BatchDecode, UnifiedDecode and a StepSession: where a step's time over gRPC goes
    beyond the in-process step's."""
    import json
    import statistics
    import subprocess
    import sys
    import tempfile

    from bench.common import ROOT, serve

    server = serve(loop, ex, unix_socket=tempfile.mktemp(prefix="modelexec-profile-", suffix=".sock"))
    prof = cProfile.Profile()
    try:
        loop.run(_call(prof.enable))
        done = subprocess.run([sys.executable, "-m", "bench.grpc_client", "--address", server.address,
                               "--batch", str(batch), "--rounds", str(rounds), "--prompt-len", str(PROMPT_LEN),
                               "--vocab", str(vocab), "--policies", "ARGMAX", "--walls"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT, check=True)
        loop.run(_call(prof.disable))
    finally:
        loop.run(server.stop(0))
    walls = {rpc: statistics.median(d["ARGMAX"]) * 1e3
             for rpc, d in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    return (f"-- gRPC server, batch {batch}, {rounds} steps per RPC (median wall ms a step, under the profiler: "
            + ", ".join(f"{rpc} {ms:.3f}" for rpc, ms in walls.items()) + f")\n{buf.getvalue()}")


async def _call(fn):
    fn()


def device_profile(loop: Loop, ex, batch: int, vocab: int, device: str) -> str:
    """torch.profiler over 3 eager decode steps: the kernels by device time (CPU ops on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    handles = _steps(loop, ex, _prefilled(loop, ex, batch, vocab), 2)
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    prof = profile(activities=activities)
    # Entered on the worker thread, which runs the steps: the profiler sees the operators of
    # the thread that started it (CUDA kernels it sees from every thread).
    ex.worker.schedule(prof.__enter__).result()
    try:
        handles = _steps(loop, ex, handles, 3)
        sync(device)
    finally:
        ex.worker.schedule(prof.__exit__, None, None, None).result()
    for h in handles:
        loop.run(ex.release_cache(h.cache_id))
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return f"-- device, batch {batch}, 3 eager steps\n" + prof.key_averages().table(sort_by=key, row_limit=25)


def capture_diagnosis(model, device: str) -> str:
    """Why decode graphs fail to capture: the eager step under CUDA's sync-debug mode (an op that
    synchronizes, which a capture forbids, raises where it is), then a capture with its traceback."""
    import traceback

    from executors.decode_graphs import DecodeGraphs

    size = Sizes(decode_batches=(4,), max_seq=4096)
    ex = new_executor(model, device, "triton", True, size)
    lines = [f"-- capture: the executor's graphs: {ex.graphs.captured if ex.graphs else None}"]
    try:
        graphs = DecodeGraphs(ex.model, ex.pool, 4, 4096, capture=False, prologue=ex.qkv_prologue)
        graphs._step(1)  # compiles first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphs._step(1)
            lines.append("eager step under sync-debug mode: no synchronizing op")
        except Exception:  # noqa: BLE001 - the diagnosis is the traceback
            lines.append("eager step under sync-debug mode:\n" + traceback.format_exc())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        try:
            DecodeGraphs(ex.model, ex.pool, 4, 4096, capture=True, prologue=ex.qkv_prologue)
            lines.append("capture of buckets 1, 2, 4: ok")
        except Exception:  # noqa: BLE001
            lines.append("capture:\n" + traceback.format_exc())
    finally:
        ex.worker.close()
    return "\n".join(lines)


def sync_report(loop: Loop, ex, vocab: int) -> str:
    """Where eager steps wait for the device (CUDA's sync-debug mode, warning at each
    synchronizing op): a batch_prefill of two prompts and two batch_decode steps. A step
    returns ids to the host once by design; anything else is a stall to look at."""
    import collections
    import warnings

    counts: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            handles = _steps(loop, ex, _prefilled(loop, ex, 2, vocab), 2)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            counts[f"{Path(w.filename).name}:{w.lineno}"] += 1
    for h in handles:
        loop.run(ex.release_cache(h.cache_id))
    rows = [f"    {n:4d}  {where}" for where, n in counts.most_common(25)]
    return "-- syncs in an eager batch_prefill of 2 and 2 decode steps (count, where)\n" + "\n".join(rows or ["    none"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=200, help="decode steps under cProfile (default %(default)s)")
    p.add_argument("--out", default=None, help="also write the tables to this file")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("skipped: no GPU (--device cpu --shape tiny runs this code on a CPU)")
        if args.out:
            Path(args.out).write_text("skipped: no GPU\n")
        return 0
    shape = SHAPES[args.shape]
    size = Sizes(decode_batches=(32,), max_seq=4096) if cuda else DRY_RUN
    backend = "triton" if cuda else "sdpa"
    _, model = random_pair(shape, args.device, torch.bfloat16 if cuda else torch.float32)
    loop, sections = Loop(), []
    try:
        for graphs in (True, False):
            ex = new_executor(model, args.device, backend, graphs and cuda, size)
            try:
                if graphs:
                    for b in (1, 32 if cuda else 4):
                        sections.append(host_profile(loop, ex, b, shape["vocab_size"], args.steps))
                        print(sections[-1], flush=True)
                    sections.append(grpc_profile(loop, ex, 32 if cuda else 4, shape["vocab_size"], args.steps // 4))
                    print(sections[-1], flush=True)
                else:
                    for b in (1, 32 if cuda else 4):
                        sections.append(device_profile(loop, ex, b, shape["vocab_size"], args.device))
                        print(sections[-1], flush=True)
                    if cuda:
                        sections.append(sync_report(loop, ex, shape["vocab_size"]))
                        print(sections[-1], flush=True)
            finally:
                ex.worker.close()
                del ex
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        loop.close()
    if cuda:  # last: a failed capture can leave the device unusable for what would follow
        try:
            sections.append(capture_diagnosis(model, args.device))
        except Exception as e:  # noqa: BLE001 - keep the sections above
            sections.append(f"-- capture diagnosis failed: {type(e).__name__}: {e}")
        print(sections[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
