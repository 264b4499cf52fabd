"""Fixtures shared by the model tests: a clean pool after each test, transformers' reading of the
embedded GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def pool_is_clean(request):
    """After each test of a module whose `served` fixture is a server with a client: every
    test released what it made, so no cache is left, every block is free (cached prefixes
    count as free) and no cache is bound to a LoRA adapter."""
    yield
    if "served" not in request.fixturenames:
        return
    client = getattr(request.getfixturevalue("served"), "client", None)
    if client is not None:
        kv = client.status().kv_pool
        assert kv.active_caches == 0 and kv.free_blocks == kv.total_blocks, kv
        lora = client.lora_metrics()
        assert lora is None or lora.active_cache_bindings == 0, lora


@pytest.fixture(scope="session")
def gguf_model(gguf_path: Path):
    """transformers' own reading of the GGUF (it dequantizes and un-permutes Q/K itself); ~30 s."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
