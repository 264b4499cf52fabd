"""Weight layouts chosen at load (executors/models/cpu_layout.py): one copy, the same function.

The choice itself is a timing and varies with the machine; what must hold whatever it is:
the forward computes the same logits in any layout (fp32, 1e-5), the modules' parameters
stay views of the one stored copy, and status counts every copy of the weights there is.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import cpu_layout
from executors.models.attention import Segment, StepContext
from executors.types import DecodeInput, PrefillInput
from tests.models.test_cpu_paths import tiny_model

ALL = dict.fromkeys(cpu_layout.KINDS, 2.0)  # "twice as fast column-major": every kind moves
NONE = dict.fromkeys(cpu_layout.KINDS, 1.0)


def row_major(family: str, monkeypatch):
    """A tiny model fused with every weight row-major (no timed choice at fuse)."""
    monkeypatch.setattr(cpu_layout, "wanted", lambda model: False)
    model = tiny_model(family).fuse()
    monkeypatch.undo()
    return model


def logits(model, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    hidden = model.hidden_states(torch.tensor(tokens), torch.arange(n), StepContext([Segment(0, n, 0)]))
    return model.logits(hidden)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_layout_computes_the_same_logits_from_one_copy(family, monkeypatch):
    model = row_major(family, monkeypatch)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    model.fused_fp32_packed = model.packed_head_fp32 = None  # the one-row and prefill paths, not oneDNN's
    before = logits(model, tokens)
    params = sum(p.numel() for p in model.parameters())
    assert cpu_layout.apply(model, ALL) == list(cpu_layout.KINDS)
    for w in model.fused:
        assert all(cpu_layout.is_column_major(getattr(w, k)) for k in ("qkv", "o", "gate_up", "down"))
    layer = model.model.layers[0]
    assert layer.self_attn.k_proj.weight.data_ptr() == model.fused[0].qkv[model.config.num_heads * model.config.head_dim:].data_ptr()
    assert layer.mlp.down_proj.weight.data_ptr() == model.fused[0].down.data_ptr()
    assert cpu_layout.is_column_major(model.head_weight())
    assert sum(p.numel() for p in model.parameters()) == params  # moved, not copied
    torch.testing.assert_close(logits(model, tokens), before, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits(model, tokens[:1]), before[:1], atol=1e-5, rtol=0)  # one row


def test_no_speedup_keeps_every_weight_row_major(monkeypatch):
    model = row_major("qwen3", monkeypatch)
    assert cpu_layout.apply(model, NONE) == []
    assert not any(cpu_layout.is_column_major(getattr(w, k)) for w in model.fused for k in ("qkv", "gate_up"))


def test_the_choice_is_timed_on_the_models_own_weights():
    model = tiny_model("llama")
    model.use_cpu_kernels = False  # with the kernels the weights are panels, no layout to choose
    model.fuse()
    speedups = cpu_layout.choose(model)
    assert set(speedups) == set(cpu_layout.KINDS) and all(s > 0 for s in speedups.values())


def test_status_counts_the_packed_copies_of_the_weights():
    model = tiny_model("llama")
    ex = LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/llama", num_blocks=16), model)
    try:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        packed = model.packed_bytes()
        if model.fused_fp32_packed is not None:  # every matmul weight once more, in oneDNN's layout
            matmuls = sum(getattr(w, k).numel() for w in model.fused for k in ("qkv", "o", "gate_up", "down"))
            assert packed == 4 * (matmuls + model.head_weight().numel())
        status = ex.status()
        assert status.memory_usage.allocated_bytes == params + packed + ex.pool.total_bytes
        loop = asyncio.new_event_loop()
        out = loop.run_until_complete(ex.prefill(PrefillInput(input_ids=[1, 2, 3])))
        loop.run_until_complete(ex.decode(DecodeInput(token_id=4, kv_cache=out.kv_cache)))
        loop.close()
    finally:
        ex.worker.close()
