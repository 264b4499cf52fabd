"""The embedded SmolLM2-135M-Instruct, served over gRPC, against transformers reading the same GGUF."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput
from client.tokenizer import TextTokenizer
from service.config import ServeConfig
from tests.conftest import start_server

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def served(smollm2_dir):
    running = start_server(ServeConfig(port=0, executor="llm", model=str(smollm2_dir), num_blocks=256))
    with ExecutorClient(running.address, timeout=120) as c:
        yield c, TextTokenizer(smollm2_dir), running
    running.stop()


def chat_prompt(tok: TextTokenizer) -> str:
    return tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])


def test_prefill_logits_match_transformers(served, gguf_model):
    c, tok, _ = served
    for text in PROMPTS + [chat_prompt(tok)]:
        ids = tok.encode(text)
        with torch.no_grad():
            expected = gguf_model(torch.tensor([ids])).logits[0].numpy()
        out = c.prefill(PrefillInput(ids))
        # Same dequantised weights on both sides; what is left is float32 summation order.
        np.testing.assert_allclose(out.logits.logits, expected[-1], atol=2e-3, rtol=0)
        np.testing.assert_allclose(c.forward(ids).output, expected, atol=2e-3, rtol=0)
        c.release_cache(out.kv_cache)


def greedy(c: ExecutorClient, ids: list[int], n: int) -> list[int]:
    policy = LogitsPolicy.argmax()
    out = c.prefill(PrefillInput(ids, logits_policy=policy))
    tokens = [out.logits.token_id]
    for _ in range(n - 1):
        out = c.decode(DecodeInput(tokens[-1], out.kv_cache, logits_policy=policy))
        tokens.append(out.logits.token_id)
    c.release_cache(out.kv_cache)
    return tokens


@pytest.mark.parametrize("which", ["plain", "chat"])
def test_32_greedy_tokens_equal_transformers_generate(served, gguf_model, which):
    c, tok, _ = served
    ids = tok.encode(PROMPTS[0] if which == "plain" else chat_prompt(tok))
    # No end-of-sequence handling: min_new_tokens would mask EOS out of the argmax, and a
    # stop would end the comparison early; the executor returns the plain argmax. generate()
    # fills an unset eos_token_id from the model's own generation config, so clear it there.
    saved = gguf_model.generation_config.eos_token_id
    gguf_model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            ref = gguf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    finally:
        gguf_model.generation_config.eos_token_id = saved
    expected = ref[0, len(ids):].tolist()
    assert greedy(c, ids, 32) == expected, (tok.decode(greedy(c, ids, 32)), tok.decode(expected))


def test_the_generate_command_prints_real_text(served):
    _, _, running = served
    done = subprocess.run(
        [sys.executable, "-m", "client", "--target", running.address, "generate",
         "--prompt", "The capital of France is", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is Paris"), done.stdout
    chat = subprocess.run(
        [sys.executable, "-m", "client", "--target", running.address, "generate", "--chat",
         "--prompt", "What is the capital of France?", "--max-tokens", "20"],
        capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0 and "Paris" in chat.stdout, chat.stdout + chat.stderr
    kv = ExecutorClient(running.address).status().kv_pool
    assert kv.active_caches == 0, "generate releases its cache"
