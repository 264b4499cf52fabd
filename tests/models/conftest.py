"""Fixtures shared by the model tests: a clean pool after each test, transformers' reading of the
embedded GGUF, the CPU kernels' instruction set."""

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


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    """The CPU kernels' wide paths (int8 dot products, float32 tiles) on AVX2, then on AVX-512
    where this CPU has it; back to the CPU's best afterwards."""
    from executors.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built here")
    if request.param == "avx512" and kernels.isa(True) != "avx512":
        pytest.skip("this CPU has no AVX-512")
    assert kernels.isa(request.param == "avx512") == request.param
    yield request.param
    kernels.isa(True)
