"""Decode steps as one kernel call (executors/models/fused_decode.py) against the reference.

The kernel runs every layer of a step of up to 64 decode rows (its matmuls over the
panels in 6-row tiles); test_cpu_paths.py and test_sliding_window.py cover it under their
"default" policy. Here: it is the path those steps take, at batch sizes from 1 to 8 (one
tile, a tile and its tail), followed by a step through torch's block gather on the same
caches (which must find the blocks the kernel entered cleared); decodes past a window every
layer slides (whose blocks behind it are freed); what it leaves to the op-by-op path; what it
refuses, and that a refusal writes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import executors.cpu_kernels as cpu_kernels_module
from executors.cpu_kernels.step import OUT_OF_RANGE
from executors.llm import WINDOW_ROLLBACK_TOKENS
from executors.models import attention_plan, fused_decode
from executors.models.attention import Segment, StepContext
from executors.types import DecodeInput, LogitsPolicy, PrefillInput, UnifiedBatchItem
from kvcache.block_table import FREED
from tests.models import test_sliding_window as windows
from tests.models.test_cpu_paths import Pair, same, tiny_model, tokens

pytestmark = pytest.mark.skipif(cpu_kernels_module.cpu_kernels() is None, reason="the CPU kernels do not build here")


@pytest.fixture
def calls(monkeypatch):
    """The statuses of every one-call decode step the test runs."""
    seen: list[int] = []
    original = cpu_kernels_module.CpuKernels.decode_step

    def counted(self, model, step):
        status = original(self, model, step)
        seen.append(status)
        return status

    monkeypatch.setattr(cpu_kernels_module.CpuKernels, "decode_step", counted)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "smollm3", "gemma2", "gemma3", "olmo2",
                                    "olmo3", "exaone4", "cohere", "cohere2", "stablelm", "stablelm_parallel",
                                    "starcoder2", "phi"])
def test_batches_of_every_size_then_gathers_on_the_same_caches(family, calls, monkeypatch):
    """Every dense family's layer: NoPE (SmolLM3), capped scores and output norms (Gemma 2),
    a second rotary table on sliding layers (Gemma 3), q/k norms across heads and no input
    norms (OLMo 2 and 3, OLMo 3 with windows and YaRN), per-head q/k norms without input norms
    and NoPE global layers (EXAONE 4), LayerNorms and parallel attention and MLP (Cohere,
    Cohere 2 with windows, StableLM with biases, in sequence and in parallel), an ungated MLP
    (StarCoder2; Phi's in parallel with attention)."""
    windowed = family in windows.FAMILIES
    pair = Pair(family, model=windows.tiny_model(family)) if windowed else Pair(family)
    try:
        pair.fast.pool._storage.fill_(float("nan"))  # stale slots must be cleared, not read
        pair.ref.pool._storage.fill_(float("nan"))
        outs, _ = pair.both("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (3, 7, 4, 12, 9, 1, 5, 6)])
        handles = [o.kv_cache for o in outs]
        batches = (1, 2, 3, 4, 5, 8, 4, 1, 7, 3, 2, 8, 8, 8)
        for step, batch in enumerate(batches):
            chosen = handles[:batch] if step % 2 else handles[-batch:][::-1]  # rows in other orders
            a, b = pair.both("batch_decode", [DecodeInput(token_id=t, kv_cache=h)
                                              for t, h in zip(tokens(batch), chosen)])
            for x, y in zip(a, b, strict=True):
                assert np.isfinite(x.logits.logits.array).all()
                same(x, y)
            done = {x.kv_cache.cache_id: x.kv_cache for x in a}
            handles = [done.get(h.cache_id, h) for h in handles]
        assert calls == [0] * len(batches)
        # Then op by op through torch's batched block gather, which reads whole blocks
        # (masked): a stale NaN the kernel failed to clear in a block it entered would poison it.
        monkeypatch.setattr(fused_decode, "FUSED_DECODE", False)
        monkeypatch.setattr(attention_plan, "PAGED_KERNEL", False)
        monkeypatch.setattr(attention_plan, "MAX_VIEW_RUNS", 0)
        a, b = pair.both("batch_decode", [DecodeInput(token_id=t, kv_cache=h) for t, h in zip(tokens(8), handles)])
        for x, y in zip(a, b, strict=True):
            assert np.isfinite(x.logits.logits.array).all()
            same(x, y)
        assert len(calls) == len(batches)
    finally:
        pair.close()


def test_steps_of_many_rows_on_either_instruction_set(isa, calls):
    """Past 6 rows the step's matmuls pack x and run the tiles: AVX2's 8- and 16-row ones, or
    AVX-512's 16 x 24 and 32 x 12 (weight_panel512.h). Steps of 7 to 64 rows against the
    reference, and a row decoded alone (the dot products) the same bits as in the step."""
    pair = Pair("qwen2", num_blocks=400)  # q/k/v biases: the tiles' bias and residual stores
    try:
        outs, _ = pair.both("batch_prefill", [PrefillInput(input_ids=tokens(3 + n % 11)) for n in range(64)])
        handles = [o.kv_cache for o in outs]
        for batch in (7, 16, 17, 33, 64):
            ids = tokens(batch)
            # the first row alone (the dot products), then its cache back as it was
            alone = pair.loop.run_until_complete(pair.fast.decode(DecodeInput(token_id=ids[0], kv_cache=handles[0])))
            pair.loop.run_until_complete(pair.fast.truncate_kv(handles[0].cache_id, handles[0].sequence_length))
            a, b = pair.both("batch_decode", [DecodeInput(token_id=t, kv_cache=h) for t, h in zip(ids, handles)])
            for x, y in zip(a, b, strict=True):
                same(x, y)
            assert np.array_equal(alone.logits.logits.array, a[0].logits.logits.array), batch
            done = {x.kv_cache.cache_id: x.kv_cache for x in a}
            handles = [done.get(h.cache_id, h) for h in handles]
        assert calls and set(calls) == {0}
    finally:
        pair.close()


def test_decodes_past_a_window_every_layer_slides_stay_one_call(calls, caplog):
    """Mistral: every layer slides, so the blocks wholly behind the window (and the rollback
    reserve, WINDOW_ROLLBACK_TOKENS) go back to the pool and their block-table entries become
    FREED (-1). The kernel reads (and checks) only the blocks of the keys in the window: each
    step stays one call, none is refused, and the logits match the reference. Rows with and
    without freed entries share batched steps; one row's first entry is freed on the way."""
    pair = windows.Pair("mistral")
    try:
        assert pair.fast.model.config.num_layers == 3 and all(
            pair.fast.model.config.window(i) == windows.WINDOW for i in range(3))
        reserve = WINDOW_ROLLBACK_TOKENS + windows.WINDOW - 1  # tokens kept before any block is freed
        prompts = (reserve + 3, reserve + 50, 3)  # a block freed after a few steps; 12 at once; none
        outs, refs = pair.both("batch_prefill", [PrefillInput(input_ids=windows.tokens(n)) for n in prompts])
        for x, y in zip(outs, refs, strict=True):
            same(x, y)
        handles = [o.kv_cache for o in outs]
        steps = 0
        for _ in range(3):  # each alone: one row, its table's early entries FREED
            x, y = pair.both("decode", DecodeInput(token_id=windows.tokens(1)[0], kv_cache=handles[1]))
            same(x, y)
            handles[1] = x.kv_cache
            steps += 1
        for _ in range(10):  # together, across block boundaries, the short one's window filling then sliding
            a, b = pair.both("batch_decode", [DecodeInput(token_id=t, kv_cache=h)
                                              for t, h in zip(windows.tokens(len(handles)), handles)])
            for x, y in zip(a, b, strict=True):
                assert np.isfinite(x.logits.logits.array).all()
                same(x, y)
            handles = [x.kv_cache for x in a]
            steps += 1
        tables = [pair.fast.kv.get(h.cache_id).block_ids for h in handles]
        assert FREED in tables[0] and tables[1][:12] == [FREED] * 12 and FREED not in tables[2], tables
        assert calls == [0] * steps  # every step one call, none refused
        assert pair.fast.model.fused_decode.refused == 0
        assert "refused" not in caplog.text
    finally:
        pair.close()


def test_models_it_does_not_take():
    from executors.models.config import DecoderConfig
    from executors.models.decoder import DecoderLM

    assert fused_decode.unsupported(tiny_model("qwen3").fuse()) is None
    assert fused_decode.unsupported(windows.tiny_model("gemma3").fuse()) is None
    moe = DecoderLM(DecoderConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})).fuse()
    assert moe.fused_decode is None and fused_decode.unsupported(moe) == "experts"
    plus = DecoderLM(DecoderConfig.from_dict({  # Command R+'s q/k LayerNorms: op by op (the kernel's are RMSNorms)
        "architectures": ["CohereForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "use_qk_norm": True})).fuse()
    assert plus.fused_decode is None and fused_decode.unsupported(plus) == "q/k LayerNorms with a weight per head"


def test_an_index_out_of_range_is_refused_before_anything_is_written(calls):
    """The kernel checks positions, slots and blocks itself; a refusal leaves the pool as it
    was and sends the step to the op-by-op path (whose own checks then raise)."""
    pair = Pair("llama")
    try:
        out, _ = pair.both("prefill", PrefillInput(input_ids=tokens(6)))
        model, pool = pair.fast.model, pair.fast.pool
        assert model.fused_decode is not None
        block_ids = list(out.kv_cache.block_ids)
        slots = pool.key[0].shape[0] * pool.block_size
        before = pool._storage.clone()
        x = torch.randn(1, model.config.hidden_size)
        for slot, position, table in ((slots, 6, block_ids), (-1, 6, block_ids), (3, 10_000, block_ids),
                                      (3, 6, [pool.key[0].shape[0]] * len(block_ids))):
            ctx = StepContext([Segment(0, 1, position, block_ids=table)], pool,
                              torch.tensor([slot], dtype=torch.int64))
            assert model.fused_decode.hidden_states(x.clone(), torch.tensor([position]), ctx) is None
        assert calls == [OUT_OF_RANGE] * 4
        assert model.fused_decode.refused == 4  # counted, the first logged
        assert torch.equal(pool._storage.nan_to_num(7.0), before.nan_to_num(7.0))
    finally:
        pair.close()


def test_steps_it_leaves_to_the_op_by_op_path(calls):
    pair = Pair("qwen3")
    try:
        outs, _ = pair.both("batch_prefill", [PrefillInput(input_ids=tokens(5)) for _ in range(3)])
        items = [UnifiedBatchItem(seq_id="", q_tokens=tokens(4), pos_offset=0, is_final_chunk=True)]  # a prompt
        items += [UnifiedBatchItem(seq_id=o.kv_cache.cache_id, q_tokens=tokens(1), pos_offset=5, is_final_chunk=True)
                  for o in outs]  # beside three decode rows
        a, b = pair.both("unified_decode", items)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x.logits.logits.array, y.logits.logits.array, atol=1e-4, rtol=0)
        other, _ = pair.both("prefill", PrefillInput(input_ids=tokens(6)))
        va, vb = pair.both("forward_verify", other.kv_cache, [4, 5, 6], LogitsPolicy())  # three rows of one sequence
        for x, y in zip(va.outputs, vb.outputs, strict=True):
            np.testing.assert_allclose(x.logits.array, y.logits.array, atol=1e-4, rtol=0)
        assert calls == []
    finally:
        pair.close()
