"""`python -m client schedule`: a file of prompts through the reference scheduler, colocated on
--targets (client/scheduler.py) or disaggregated, prefill on --prefill-targets and decode on
--decode-targets (client/disaggregated.py). Prints each completion with its time to first
token and inter-token latency, then throughput and a latency summary (client/latency.py)."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from .batch_runner import _Progress
from .cli_options import (
    MAX_SEED,
    add_sampling_arguments,
    add_tokenizer_argument,
    at_least,
    check_sampling_arguments,
    load_tokenizer,
    sampling_penalties,
    sampling_policy,
)
from .latency import summarize_latency
from .router import AsyncExecutorRouter, parse_targets
from .scheduler import Completion, Scheduler, SchedulerConfig, run_batch


def add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default=None,
                   help="HOST:PORT[,HOST:PORT...] of the executor replicas (default: --target)")
    p.add_argument("--prefill-targets", default=None,
                   help="disaggregated: HOST:PORT[,...] of the executors that prefill the prompts")
    p.add_argument("--decode-targets", default=None,
                   help="disaggregated: HOST:PORT[,...] of the executors that decode; each cache moves "
                        "there from its prefill executor once its prompt is in")
    p.add_argument("--prompts-file", required=True, help="one prompt per line (blank lines are skipped)")
    p.add_argument("--max-tokens", type=at_least(1), default=64,
                   help="most new tokens per prompt (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    add_tokenizer_argument(p)
    add_sampling_arguments(p, seed_help="with --temperature: seed of server-side sampling (per prompt: seed + index)")
    p.add_argument("--max-num-seqs", type=at_least(1), default=SchedulerConfig().max_num_seqs,
                   help="sequences per step and replica (default %(default)s)")
    p.add_argument("--max-batched-tokens", type=at_least(1), default=SchedulerConfig().max_num_batched_tokens,
                   help="tokens per step and replica; longer prompts are prefilled in chunks (default %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")


def check_schedule_arguments(args: argparse.Namespace) -> str | None:
    """What argparse alone cannot refuse: a flag that would be ignored."""
    return check_sampling_arguments(args)


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of --prompts-file; ValueError with a plain message when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts-file {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"--prompts-file {path}: {e.strerror or e}") from None
    if not texts:
        raise ValueError(f"{path} holds no prompts")
    return texts


def _target_groups(args: argparse.Namespace) -> list[list[str]]:
    """[replicas] colocated, or [prefill, decode] disaggregated."""
    if args.prefill_targets is None and args.decode_targets is None:
        return [parse_targets(args.targets or args.target)]
    if not (args.prefill_targets and args.decode_targets):
        raise ValueError("--prefill-targets and --decode-targets go together")
    if args.targets:
        raise ValueError("--targets is the colocated mode; give --prefill-targets and --decode-targets instead")
    return [parse_targets(args.prefill_targets), parse_targets(args.decode_targets)]


def run_schedule_command(args: argparse.Namespace, **client_options: Any) -> int:
    """The `schedule` subcommand: prints each completion, then throughput, to stdout; returns
    how many requests failed. `client_options` (credentials, token) go to every client."""
    groups = _target_groups(args)
    tok = load_tokenizer(args.tokenizer)
    texts = read_prompts(args.prompts_file)
    rendered = [tok.apply_chat_template([{"role": "user", "content": t}]) if args.chat else t for t in texts]
    prompts = [tok.encode(t) for t in rendered]

    async def main() -> tuple[list[Completion], float, Any]:
        routers = [AsyncExecutorRouter(g, timeout=args.timeout, **client_options) for g in groups]
        progress = _Progress(len(prompts))
        try:
            options: dict[str, Any] = {
                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_batched_tokens,
                "eos_token_ids": None if args.ignore_eos else tuple(sorted(tok.eos_ids)) or None}
            if len(routers) == 2:
                from .disaggregated import DisaggregatedScheduler

                sched: Any = DisaggregatedScheduler(*routers, **options)
            else:
                sched = Scheduler(routers[0], **options)
            async with sched:
                started = time.monotonic()
                # One seed per prompt: prompts differ from each other, and a run repeats exactly.
                policies = [sampling_policy(args, None if args.seed is None else (args.seed + i) % (MAX_SEED + 1))
                            for i in range(len(prompts))]
                completions = await run_batch(sched, prompts, max_tokens=args.max_tokens, policy=policies,
                                              progress=progress, ignore_eos=args.ignore_eos,
                                              penalties=sampling_penalties(args) or None, min_tokens=args.min_tokens)
                elapsed = time.monotonic() - started
                return completions, elapsed, sched.stats
        finally:
            progress.close()  # on a terminal, ends the progress line (also on Ctrl-C)
            for router in routers:
                await router.close()

    completions, elapsed, stats = asyncio.run(main())
    failed = 0
    for i, (text, c) in enumerate(zip(texts, completions)):
        print(f"--- [{i}] {text}")
        if c.finish_reason == "error":
            failed += 1
            print(f"error: {c.error}")
        else:
            print(tok.decode(c.token_ids).strip())
        print(f"    ({len(c.token_ids)} tokens, {c.finish_reason}, first token {c.ttft_s or 0:.2f}s, "
              f"inter-token {c.itl_s or 0:.3f}s, done {c.latency_s or 0:.2f}s)")
    generated = sum(len(c.token_ids) for c in completions)
    prompt_tokens = sum(len(p) for p in prompts)
    where = (f"{len(groups[0])} executor(s)" if len(groups) == 1 else
             f"{len(groups[0])} prefill + {len(groups[1])} decode executors")
    print(f"{len(completions)} requests ({failed} failed) on {where}: {prompt_tokens} prompt + "
          f"{generated} generated tokens in {elapsed:.2f}s")
    print(f"throughput: {generated / elapsed:.1f} tokens/s, {len(completions) / elapsed:.2f} requests/s "
          f"({stats.steps} steps, up to {stats.max_items_per_step} sequences per step, "
          f"{stats.preemptions} preemptions)")
    print(summarize_latency(completions))
    if len(groups) == 2:
        print(f"moves: {stats.moves} caches, {stats.bytes_moved / 1e6:.3g} MB, "
              f"{stats.move_seconds / max(stats.moves, 1):.3f}s each on average "
              f"({stats.move_refusals} refused by a full pool, {stats.failed_moves} failed)")
    return failed
