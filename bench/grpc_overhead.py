"""The suite's `grpc` part (c): one decode step in-process and over gRPC (TCP loopback, unix
socket) for each logits policy, with the client in the server's process and in its own
(bench/grpc_client.py), and our overhead over a bare grpc.aio echo of the same sizes (bench/echo.py)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile

from bench.common import ARGMAX, PROMPT_LEN, ROOT, Loop, executor, inproc_batch_decode, prompts, serve, timed
from executors.types import DecodeInput, LogitsKind, LogitsPolicy, PrefillInput


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
                        outs, exec_ns, wall_ns = loop.run(inproc_batch_decode(ex, dins))
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
    from client import ExecutorClient, convert
    from client import LogitsPolicy as CPolicy

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
