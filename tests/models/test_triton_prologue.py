"""The fused attention prologue (q/k norm, rotation, K/V store in one Triton kernel) against torch.

Triton's interpreter runs the kernel here (the compiled one on a GPU). The whole-model paths
through it are in test_triton_paths.py (the triton executors against the reference, 1e-4).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import triton_kernels_unrunnable

pytestmark = pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))
pytest.importorskip("triton")

from executors.models import triton_prologue
from executors.models.layers import apply_rope
from executors.models.step_ops import torch_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(heads, kv_heads, d, m, norm, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(m, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 100, (m,), generator=g).to(DEVICE)
    slots = torch.randperm(40, generator=g)[:m].to(DEVICE)
    angles = torch.rand(100, d // 2, generator=g) * 6.3
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sin[:, :d // 2].neg_()  # signed: the first half negated, as RotaryEmbedding.signed_sin
    norms = (1 + 0.3 * torch.randn(2, d, generator=g)).to(DEVICE, dtype) if norm else None
    return qkv, positions, slots, cos.to(DEVICE), sin.to(DEVICE), norms


def pools(kv_heads, d, dtype):
    key = torch.full((40, kv_heads, d), float("nan"), dtype=dtype, device=DEVICE)
    return key, torch.full_like(key, float("nan"))


@pytest.mark.parametrize("heads,kv_heads,d,m,norm", [(4, 2, 16, 5, True), (4, 2, 16, 5, False),
                                                     (8, 8, 64, 3, True), (6, 2, 24, 4, True), (2, 1, 16, 1, False)])
def test_the_kernel_computes_the_torch_ops(heads, kv_heads, d, m, norm):
    qkv, positions, slots, cos, sin, norms = case(heads, kv_heads, d, m, norm)
    got_key, got_value = pools(kv_heads, d, torch.float32)
    want_key, want_value = pools(kv_heads, d, torch.float32)
    q = triton_prologue.prologue(qkv, positions, slots, got_key, got_value, cos, sin, norms, 1e-6, heads, kv_heads, d)
    want = triton_prologue.torch_prologue(qkv, positions, slots, want_key, want_value, cos, sin, norms, 1e-6, heads,
                                          kv_heads, d)
    torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-5)
    for got, ref in ((got_key, want_key), (got_value, want_value)):
        written = torch.zeros(40, dtype=torch.bool, device=DEVICE)
        written[slots] = True
        torch.testing.assert_close(got[written], ref[written], atol=1e-5, rtol=1e-5)
        assert got[~written].isnan().all()  # no other slot touched


def test_the_reference_is_the_models_own_ops():
    """torch_prologue computes what fast_forward's torch path does: RMSNorm, then apply_rope."""
    heads, kv_heads, d, m = 4, 2, 16, 6
    qkv, positions, slots, cos, sin, norms = case(heads, kv_heads, d, m, True, seed=3)
    key, value = pools(kv_heads, d, torch.float32)
    q = triton_prologue.torch_prologue(qkv, positions, slots, key, value, cos, sin, norms, 1e-6, heads, kv_heads, d)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    hq, hk = heads * d, kv_heads * d
    want_q = apply_rope(torch_norm(qkv[:, :hq].reshape(m, heads, d), norms[0], 1e-6), c, s)
    want_k = apply_rope(torch_norm(qkv[:, hq:hq + hk].reshape(m, kv_heads, d), norms[1], 1e-6), c, s)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(key[slots], want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(value[slots], qkv[:, hq + hk:].reshape(m, kv_heads, d))


def test_the_start_up_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    assert triton_prologue.self_check(DEVICE, torch.float32, 4, 2, 16, qk_norm=True) is None
    assert triton_prologue.self_check(DEVICE, torch.float32, 4, 2, 16, qk_norm=False) is None
    real = triton_prologue.prologue

    def off_by_a_little(*args):
        return real(*args) * 1.001

    monkeypatch.setattr(triton_prologue, "prologue", off_by_a_little)
    problem = triton_prologue.self_check(DEVICE, torch.float32, 4, 2, 16, qk_norm=True)
    assert problem is not None and "q differs from the torch ops" in problem


def test_an_executor_falls_back_to_the_torch_ops_and_says_why(monkeypatch, caplog):
    import asyncio

    from executors.llm import LlmExecutor, LlmExecutorConfig
    from executors.types import PrefillInput
    from tests.models.test_cpu_paths import BLOCK, tiny_model

    monkeypatch.setattr(triton_prologue, "self_check", lambda *a, **k: "the prologue kernel failed to run: boom")
    cfg = LlmExecutorConfig(model_dir="/nonexistent/qwen3", block_size=BLOCK, num_blocks=16, device=DEVICE,
                            dtype="float32", max_batch_size=2, attention_backend="triton", max_sequence_length=64)
    model = tiny_model("qwen3")
    with caplog.at_level(logging.WARNING, logger="executors.triton_setup"):
        ex = LlmExecutor(cfg, model.to(DEVICE), decode_graphs=False)
    try:
        assert ex.qkv_prologue is None
        assert ex.info().metadata["triton_fused_ops"] == ["glu"]
        assert "the fused attention prologue is off" in caplog.text and "boom" in caplog.text
        loop = asyncio.new_event_loop()
        out = loop.run_until_complete(ex.prefill(PrefillInput(input_ids=[1, 2, 3])))
        assert out.kv_cache.sequence_length == 3
        loop.close()
    finally:
        ex.worker.close()


def test_the_config_can_turn_it_off_and_steps_agree_either_way():
    """triton_fused_ops=False runs the torch ops (the bench compares the two); the logits of
    the two executors on the same model agree within float32 rounding."""
    import asyncio

    from executors.llm import LlmExecutor, LlmExecutorConfig
    from executors.types import DecodeInput, PrefillInput
    from tests.models.test_cpu_paths import BLOCK, tiny_model

    model = tiny_model("qwen3").to(DEVICE)
    executors = [LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/qwen3", block_size=BLOCK, num_blocks=16,
                                               device=DEVICE, dtype="float32", max_batch_size=2,
                                               attention_backend="triton", max_sequence_length=64,
                                               triton_fused_ops=on), model, decode_graphs=False)
                 for on in (True, False)]
    loop = asyncio.new_event_loop()
    try:
        assert [ex.info().metadata["triton_fused_ops"] for ex in executors] == [["prologue", "glu"], []]
        logits = []
        for ex in executors:
            out = loop.run_until_complete(ex.prefill(PrefillInput(input_ids=[5, 9, 2, 7, 1])))
            step = loop.run_until_complete(ex.decode(DecodeInput(token_id=4, kv_cache=out.kv_cache)))
            logits.append((out.logits.logits, step.logits.logits))
        for a, b in zip(*logits):
            torch.testing.assert_close(torch.from_numpy(a.array), torch.from_numpy(b.array), atol=1e-5, rtol=1e-5)
    finally:
        loop.close()
        for ex in executors:
            ex.worker.close()
