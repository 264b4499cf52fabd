"""`python -m bench.speculative`: speculative decoding against plain greedy, over gRPC, on this machine.

Starts the target (fp32) and each draft as separate `python -m service` processes on free
local ports, then for every prompt times plain greedy decoding on the target (prefill, one
Decode per token, ARGMAX) and speculative decoding (client/speculative.py: N draft steps,
one ForwardVerify, TruncateKv on rejection), interleaved so that machine load hits both
alike. Reports acceptance rate, tokens per target call, tokens/s of each and the
speed-up, checks that the tokens are identical, and writes everything as JSON (--json).

Drafts (--draft, repeatable):
  same          the target's own weights (every draft accepted: the protocol's overhead)
  bf16          the target's weights at bfloat16
  layers:K      the first K decoder layers of the target (+ its final norm and lm_head), fp32
  drop:A-B[,C-D] the target without decoder layers A..B (inclusive; self-speculative layer skipping)
  ...:bf16      either of those at bfloat16
  DIR           any model directory with the target's vocabulary

Nothing here runs in the test suite except a tiny smoke run on a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.service_process import free_port
from client import AsyncExecutorClient, DecodeInput, LogitsPolicy, PrefillInput
from client.speculative import SpeculativeDecoder, SpeculativeStats

DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"
DEFAULT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works.",
    "What are the benefits of regular exercise?",
    "def fibonacci(n):",
]
ARGMAX = LogitsPolicy.argmax()


class Server:
    """`python -m service` in a child process, stopped on exit."""

    def __init__(self, model: Path, dtype: str, threads: int | None, log: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--executor", "llm", "--model", str(model), "--dtype", dtype,
             "--port", str(self.port), "--num-blocks", "512", "--cache-ttl-seconds", "0"],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    async def ready(self, timeout: float = 300) -> None:
        async with AsyncExecutorClient(self.address) as c:
            try:
                await c.wait_ready(timeout)
            except Exception:  # noqa: BLE001 - any failure: show the server's log
                self.log.flush()
                raise RuntimeError(f"server on {self.address} did not start:\n{Path(self.log.name).read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class InProcessServer:
    """The same server on a background thread of this process (--in-process: no start-up cost)."""

    def __init__(self, model: Path, dtype: str, threads: int | None, log: Path) -> None:
        import threading

        from service.config import ServeConfig
        from service.server import ExecutorServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = ServeConfig(port=0, executor="llm", model=str(model), dtype=dtype, num_blocks=512,
                             cache_ttl_seconds=0)

        async def make() -> ExecutorServer:
            server = ExecutorServer(config)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(make(), self.loop).result(300)
        self.address = self.server.address

    async def ready(self, timeout: float = 300) -> None:
        async with AsyncExecutorClient(self.address) as c:
            await c.wait_ready(timeout)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def layer_subset_copy(src: Path, dst: Path, keep: list[int]) -> Path:
    """A Hugging Face layout model with only the decoder layers `keep` (renumbered in order),
    and the target's embeddings, final norm and lm_head: a draft sharing its vocabulary."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not keep or any(not 0 <= k < total for k in keep):
        raise ValueError(f"layers to keep must be in [0, {total})")
    renumber = {old: new for new, old in enumerate(sorted(set(keep)))}
    config["num_hidden_layers"] = len(renumber)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                parts = name.split(".")
                if "layers" in parts:
                    i = parts.index("layers") + 1
                    if int(parts[i]) not in renumber:
                        continue
                    parts[i] = str(renumber[int(parts[i])])
                tensors[".".join(parts)] = st.get_tensor(name).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def draft_model(spec: str, target: Path, scratch: Path) -> tuple[Path, str]:
    """(model directory, dtype) of a --draft spec."""
    if spec == "same":
        return target, "float32"
    if spec == "bf16":
        return target, "bfloat16"
    if spec.startswith(("layers:", "drop:")):
        parts = spec.split(":")
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[parts[2]] if len(parts) > 2 else "float32"
        total = json.loads((target / "config.json").read_text())["num_hidden_layers"]
        if parts[0] == "layers":
            keep = list(range(int(parts[1])))
        else:
            dropped: set[int] = set()
            for r in parts[1].split(","):
                a, _, b = r.partition("-")
                dropped.update(range(int(a), int(b or a) + 1))
            keep = [i for i in range(total) if i not in dropped]
        name = spec.replace(":", "_").replace(",", "_")
        return layer_subset_copy(target, scratch / name, keep), dtype
    return Path(spec), "float32"


async def plain_greedy(client: AsyncExecutorClient, prompt: list[int], n: int) -> list[int]:
    out = await client.prefill(PrefillInput(prompt, logits_policy=ARGMAX))
    tokens = [out.logits.token_id]
    while len(tokens) < n:
        out = await client.decode(DecodeInput(tokens[-1], out.kv_cache, logits_policy=ARGMAX))
        tokens.append(out.logits.token_id)
    await client.release_cache(out.kv_cache)
    return tokens


def prompts_for(args: argparse.Namespace, model: Path) -> tuple[list[list[int]], list[str]]:
    if args.random_prompts:
        import random

        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        r = random.Random(0)
        ids = [[r.randrange(vocab) for _ in range(r.randrange(4, 24))] for _ in range(args.random_prompts)]
        return ids, [f"<{len(p)} random ids>" for p in ids]
    from client.tokenizer import TextTokenizer

    tok = TextTokenizer(model)
    texts = args.prompt or DEFAULT_PROMPTS
    rendered = [tok.apply_chat_template([{"role": "user", "content": t}]) if tok.chat_template else t for t in texts]
    return [tok.encode(t) for t in rendered], texts


async def measure(target: str, draft: str, prompts: list[list[int]], n_draft: int, args) -> dict:
    async with AsyncExecutorClient(target, timeout=300) as t, AsyncExecutorClient(draft, timeout=300) as d:
        spec = SpeculativeDecoder(t, d, num_draft_tokens=n_draft)
        await plain_greedy(t, prompts[0], 4)  # warm both paths (connections, first-call costs)
        await spec.generate(prompts[0], max_tokens=4)
        stats = SpeculativeStats()
        plain_s = spec_s = 0.0
        tokens = 0
        identical = True
        for _ in range(args.repeats):
            for p in prompts:
                t0 = time.perf_counter()
                ref = await plain_greedy(t, p, args.max_tokens)
                t1 = time.perf_counter()
                res = await spec.generate(p, max_tokens=args.max_tokens)
                t2 = time.perf_counter()
                plain_s += t1 - t0
                spec_s += t2 - t1
                tokens += len(ref)
                identical &= res.token_ids == ref
                stats.add(res.stats)
        return {
            "num_draft_tokens": n_draft,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_target_call": round(stats.tokens_per_round, 3),
            "plain_tok_s": round(tokens / plain_s, 2),
            "speculative_tok_s": round(tokens / spec_s, 2),
            "speedup": round(plain_s / spec_s, 3),
            "identical": identical,
            "tokens": tokens,
            "rounds": stats.rounds,
            "draft_calls": stats.draft_calls,
            "target_calls": stats.target_calls,
        }


async def run(args: argparse.Namespace) -> dict:
    model = Path(args.model)
    prompts, labels = prompts_for(args, model)
    scratch = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    servers: list[Server] = []
    results = []
    try:
        # All servers start at once (start-up is mostly importing torch); they idle while others run.
        kind = InProcessServer if args.in_process else Server
        target = kind(model, "float32", args.threads, scratch / "target.log")
        servers.append(target)
        drafts = []
        for i, spec in enumerate(args.draft):
            draft_dir, dtype = draft_model(spec, model, scratch)
            drafts.append((spec, dtype, kind(draft_dir, dtype, args.threads, scratch / f"draft-{i}.log")))
            servers.append(drafts[-1][2])
        await asyncio.gather(*(s.ready() for s in servers))
        for spec, dtype, draft in drafts:
            for n in args.num_draft_tokens:
                row = {"draft": spec, "draft_dtype": dtype, **await measure(target.address, draft.address, prompts,
                                                                             n, args)}
                results.append(row)
                print(f"draft {spec:<14} N={n}  acceptance {row['acceptance_rate']:.2f}  "
                      f"{row['tokens_per_target_call']:.2f} tok/target call  plain {row['plain_tok_s']:.1f} tok/s  "
                      f"speculative {row['speculative_tok_s']:.1f} tok/s  speed-up {row['speedup']:.2f}x  "
                      f"identical {row['identical']}", flush=True)
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "benchmark": "speculative decoding vs plain greedy, gRPC on localhost",
        "model": model.name,
        "target_dtype": "float32",
        "prompts": labels,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "servers": "threads of one process" if args.in_process else "separate processes",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="target model directory (default: embedded SmolLM2)")
    p.add_argument("--draft", action="append", default=None,
                   help="same | bf16 | layers:K[:bf16] | drop:A-B[:bf16] | DIR (repeatable; default: bf16, same, drop:10-19)")
    p.add_argument("--num-draft-tokens", type=int, action="append", default=None,
                   help="N drafts per round (repeatable; default 4)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per prompt (default %(default)s)")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; chat template applied)")
    p.add_argument("--random-prompts", type=int, default=0, help="use K random-id prompts (models with no tokenizer)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each server process")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--in-process", action="store_true",
                   help="host the servers on threads of this process instead of child processes (smoke runs; "
                        "they then share one interpreter, so timings are not representative)")
    args = p.parse_args(argv)
    args.draft = args.draft or ["bf16", "same", "drop:10-19"]
    args.num_draft_tokens = args.num_draft_tokens or [4]
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if all(r["identical"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
