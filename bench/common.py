"""The benchmark suite's shared helpers: its fixed workloads (seeded prompts, the embedded model),
the machine's description, an executor, an event loop on a thread with a gRPC server on it, timing."""

from __future__ import annotations

import asyncio
import os
import platform
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.types import LogitsKind, LogitsPolicy

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"
RESULTS = Path(__file__).resolve().parent / "results"
SEED = 1234
PROMPT_LEN = 128
ARGMAX = LogitsPolicy(kind=LogitsKind.ARGMAX)


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
             prefix_caching: bool = False, quantization: str = "none") -> LlmExecutor:
    return LlmExecutor(LlmExecutorConfig(model_dir=str(model_dir), dtype=dtype, device=device,
                                         num_blocks=num_blocks, max_batch_size=64, prefix_caching=prefix_caching,
                                         quantization=quantization))


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


def prefill_flops(ex: LlmExecutor, prompts: int, prompt_len: int) -> int:
    """Floating-point operations of a batch_prefill of `prompts` prompts of `prompt_len` tokens
    (dense models): every token through every layer's matmuls, the lm_head for one token a
    prompt (its logits are the last token's), and causal attention (q.k and p.v, 2 x 2 x
    head_dim a query-key pair and head). The embedding's lookup computes nothing: counting the
    checkpoint's parameters for every token would add a tied SmolLM2's 28 M-parameter lm_head
    4096 times over a 32 x 128 batch, ~24 % more than it does."""
    cfg = ex.model.config
    head = cfg.vocab_size * cfg.hidden_size
    layers = ex.num_parameters - head * (1 if cfg.tie_word_embeddings else 2)  # the norms' few thousand too
    tokens, pairs = prompts * prompt_len, prompts * prompt_len * (prompt_len + 1) // 2
    return (2 * layers * tokens + 2 * head * prompts
            + 4 * cfg.head_dim * cfg.num_heads * cfg.num_layers * pairs)


def alternating_decode_steps(loop: asyncio.AbstractEventLoop, executors: dict[Any, LlmExecutor],
                             handles: dict[Any, list], rounds: int, vocab: int,
                             before: Any = None, after: Any = None) -> dict[Any, list[float]]:
    """In-process ARGMAX decode steps of each executor's caches (`handles`, updated in place), the
    executors taking turns for rounds + 1 rounds (the first a warm-up, not timed); each one's
    step times in seconds. Each row gets a different token each round (rows of a mixture of
    experts route apart). `before(key)` and `after(key)` run around each step, untimed."""
    from executors.types import DecodeInput

    times: dict[Any, list[float]] = {key: [] for key in executors}
    for r in range(rounds + 1):
        for key, ex in executors.items():
            if before is not None:
                before(key)
            t0 = time.perf_counter()
            steps = loop.run_until_complete(ex.batch_decode(
                [DecodeInput(token_id=(5 + 31 * r + 977 * i) % vocab, kv_cache=h, logits_policy=ARGMAX)
                 for i, h in enumerate(handles[key])]))
            if r:
                times[key].append(time.perf_counter() - t0)
            if after is not None:
                after(key)
            handles[key] = [s.kv_cache for s in steps]
    return times


def release_all(loop: asyncio.AbstractEventLoop, executors: dict[Any, LlmExecutor], handles: dict[Any, list]) -> None:
    for key, ex in executors.items():
        for h in handles[key]:
            loop.run_until_complete(ex.release_cache(h.cache_id))


def weight_bytes(ex: LlmExecutor) -> int:
    return ex.parameter_bytes


async def inproc_batch_decode(ex, inputs):
    """batch_decode in-process: (outputs, executor ns as the service would report it, wall ns)."""
    from executors.timing import CallTimer, current_call_timer

    timer = CallTimer()
    current_call_timer.set(timer)
    t0 = time.perf_counter_ns()
    outs = await ex.batch_decode(inputs)
    return outs, timer.executor_ns, time.perf_counter_ns() - t0


async def pipelined_decode(ex, handles, steps: int) -> tuple[list[float], list[list]]:
    """`steps` decode steps of a scheduler keeping two fed ARGMAX steps in flight in-process
    (step k+2 is sent when step k's tokens arrive; executors/step_overlap.py lets the executor
    launch it before step k+1 settles): the seconds between consecutive results from the third
    on, and every step's results (UnifiedItemResults)."""
    from executors.types import UnifiedBatchItem

    lengths = [h.sequence_length for h in handles]

    def step(k: int):
        return asyncio.ensure_future(ex.unified_decode(
            [UnifiedBatchItem(seq_id=h.cache_id, q_tokens=[], pos_offset=n + k, is_final_chunk=True,
                              logits_policy=ARGMAX, feed_sampled_token=True) for h, n in zip(handles, lengths)]))

    sent, gaps, last, results = [step(0), step(1)], [], 0.0, []
    for k in range(steps):
        results.append(await sent[k])
        now = time.perf_counter()
        if k >= 2:
            gaps.append(now - last)
        last = now
        if k + 2 < steps:
            sent.append(step(k + 2))
    return gaps, results
