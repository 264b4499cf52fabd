"""The client of bench part (c) in a process of its own: `python -m bench.grpc_client`.

A scheduler calls the executor from another process (or host), so the gRPC overhead it
sees excludes what an in-process client costs the server: the interpreter lock shared
with the server's event loop, and the client's own (de)serialisation competing for it.
This script is that client. It prefills `--batch` seeded prompts through the real client,
then for each RPC (unary BatchDecode and UnifiedDecode, and steps on one StepSession
stream) and each logits policy (`--policies`, all by default) times `--rounds` decode
steps (after one warm-up step), and prints one JSON object: {rpc: {policy: [step wall time
minus the executor time the server reports, in seconds, per step]}}; with `--walls`, the
whole wall time of each step instead. With `--pipelined`, also "StepSession pipelined"
(ARGMAX and SAMPLE only): decode steps that feed each cache's sampled token
(feed_sampled_token), `--in-flight` of them sent ahead of the one being read, each sample
the time between two results (the steps overlap, so it is always a wall time). It imports
the client only (no torch), as a scheduler would, and tunes its process's malloc as a
scheduler asking for FULL logits should (`client.keep_freed_memory`; `--default-malloc`
leaves glibc's defaults).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput, UnifiedBatchItem, keep_freed_memory

POLICIES = {
    "FULL fp32": LogitsPolicy.full("float32"),
    "FULL bf16": LogitsPolicy.full("bfloat16"),
    "ARGMAX": LogitsPolicy.argmax(),
    "SAMPLE": LogitsPolicy.sample(0.8, top_p=0.95, seed=1),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_client", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="host:port or unix:PATH")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of %(default)s")
    p.add_argument("--walls", action="store_true", help="report whole step wall times, not wall minus executor time")
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc thresholds as they are")
    p.add_argument("--pipelined", action="store_true", help="also StepSession with steps in flight (ARGMAX, SAMPLE)")
    p.add_argument("--in-flight", type=int, default=2, help="with --pipelined, steps sent ahead (default %(default)s)")
    args = p.parse_args(argv)
    if not args.default_malloc:
        keep_freed_memory()
    policies = {name: POLICIES[name] for name in args.policies.split(",")}
    rng = np.random.default_rng(args.seed)
    result: dict[str, dict[str, list[float]]] = {}
    with ExecutorClient(args.address, timeout=600) as c, c.step_session() as session:
        prompts = rng.integers(0, args.vocab, size=(args.batch, args.prompt_len)).tolist()
        outs = c.batch_prefill([PrefillInput(ids, logits_policy=LogitsPolicy.argmax()) for ids in prompts])
        handles = [o.kv_cache for o in outs]

        def unified(policy):
            return [UnifiedBatchItem(h.cache_id, [5], h.sequence_length, True, logits_policy=policy) for h in handles]

        rpcs = {
            "BatchDecode": lambda policy: c.batch_decode([DecodeInput(5, h, logits_policy=policy) for h in handles]),
            "UnifiedDecode": lambda policy: c.unified_decode(unified(policy)),
            "StepSession": lambda policy: session.step(unified(policy)),
        }

        def pipelined(policy, rounds: int) -> list[float]:
            nonlocal handles
            outs = session.step([UnifiedBatchItem(h.cache_id, [5], h.sequence_length, True, logits_policy=policy)
                                 for h in handles])  # a sampled token to feed
            start = [o.kv_cache.sequence_length for o in outs]

            def fed(k: int) -> list[UnifiedBatchItem]:
                return [UnifiedBatchItem(o.seq_id, [], p + k, True, logits_policy=policy, feed_sampled_token=True)
                        for o, p in zip(outs, start)]

            sent, samples, last = 0, [], time.perf_counter()
            for r in range(rounds + 1):
                while sent < min(r + args.in_flight, rounds + 1):
                    session.send(fed(sent))
                    sent += 1
                got = session.receive()
                now = time.perf_counter()
                if r:  # the first result waited for the whole pipe to fill
                    samples.append(now - last)
                last = now
            handles = [o.kv_cache for o in got]
            return samples

        try:
            for rpc, step in rpcs.items():
                result[rpc] = {}
                for name, policy in policies.items():
                    samples = []
                    for r in range(args.rounds + 1):
                        started = time.perf_counter()
                        outs = step(policy)
                        wall = time.perf_counter() - started
                        handles = [o.kv_cache for o in outs]
                        if r:  # the first step warms this policy's path up
                            samples.append(wall if args.walls else wall - outs[0].timing.executor_ns / 1e9)
                    result[rpc][name] = samples
            if args.pipelined:
                result["StepSession pipelined"] = {name: pipelined(policy, args.rounds)
                                                   for name, policy in policies.items()
                                                   if policy.kind in ("argmax", "sample")}
        finally:
            for h in handles:
                c.release_cache(h)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
