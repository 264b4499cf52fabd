"""`python -m bench.accuracy`: max |ours - reference| per model and call, fp32 on CPU.

References: the NumPy re-computation for the paged executor, transformers for the tiny
random Qwen3/Llama/Qwen2 models, and transformers reading the embedded GGUF for SmolLM2.
In-process (no gRPC): the tests check the same through the server.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import numpy as np
import torch

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig
from executors.types import DecodeInput, LogitsPolicy, PrefillInput


async def run_sequence(ex, tokens: list[int], split: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Prefill tokens[:split] in two chunks, decode the next two, verify the rest."""
    half = split // 2
    a = await ex.prefill(PrefillInput(input_ids=tokens[:half]))
    b = await ex.prefill(PrefillInput(input_ids=tokens[half:split], kv_cache=a.kv_cache))
    d1 = await ex.decode(DecodeInput(token_id=tokens[split], kv_cache=b.kv_cache))
    d2 = await ex.decode(DecodeInput(token_id=tokens[split + 1], kv_cache=d1.kv_cache))
    v = await ex.forward_verify(d2.kv_cache, tokens[split + 2:], LogitsPolicy())
    await ex.release_cache(v.kv_cache.cache_id)
    return b.logits.logits.array, d2.logits.logits.array, [o.logits.array for o in v.outputs]


def max_diffs(ours, reference: np.ndarray, split: int) -> tuple[float, float, float]:
    prefill, decode, verify = ours
    return (float(np.abs(prefill - reference[split - 1]).max()),
            float(np.abs(decode - reference[split + 1]).max()),
            float(np.abs(np.stack(verify) - reference[split + 2:]).max()))


def main() -> None:
    from tests.models.tiny_models import VOCAB, build
    from tests.paged_reference import PagedModel

    rng = np.random.default_rng(0)
    rows = []
    paged = PagedAttentionExecutor(PagedExecutorConfig(block_size=4))
    tokens = rng.integers(0, 256, 40).tolist()
    rows.append(("paged (NumPy reference)",
                 max_diffs(asyncio.run(run_sequence(paged, tokens, 30)), PagedModel().logits(tokens), 30)))
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("qwen3", "llama", "qwen2"):
            oracle = build(family, Path(tmp) / family)
            ex = LlmExecutor(LlmExecutorConfig(model_dir=str(Path(tmp) / family), block_size=4, num_blocks=64))
            tokens = rng.integers(0, VOCAB, 40).tolist()
            with torch.no_grad():
                reference = oracle(torch.tensor([tokens])).logits[0].numpy()
            rows.append((f"{family} tiny (transformers)",
                         max_diffs(asyncio.run(run_sequence(ex, tokens, 30)), reference, 30)))
    from executors.gguf_import import DEFAULT_MODEL_DIR, convert, default_gguf_path

    gguf = default_gguf_path()
    convert(gguf, DEFAULT_MODEL_DIR)
    import transformers

    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                               dtype=torch.float32).eval()
    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(DEFAULT_MODEL_DIR), num_blocks=64))
    tokens = rng.integers(0, 49152, 40).tolist()
    with torch.no_grad():
        reference = oracle(torch.tensor([tokens])).logits[0].numpy()
    rows.append(("SmolLM2-135M (transformers, GGUF)",
                 max_diffs(asyncio.run(run_sequence(ex, tokens, 30)), reference, 30)))
    print(f"{'model (reference)':36} {'chunked prefill':>16} {'decode':>10} {'verify (8 rows)':>16}")
    for name, (p, d, v) in rows:
        print(f"{name:36} {p:16.2e} {d:10.2e} {v:16.2e}")


if __name__ == "__main__":
    main()
