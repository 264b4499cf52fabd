"""The fast CPU paths against the plain reference computation (fp32, max abs diff <= 1e-4).

Two LlmExecutors share one tiny random model: one runs the fast path (fused weights, the
CPU kernels of executors/cpu_kernels for small steps, planned attention), the other the
reference (per-layer modules, per-sequence slot gathers). Both receive the same calls, so
their block tables are identical, and every output must agree. Each scenario runs under
five policies: the defaults (decode steps of up to 64 rows as one kernel call, other steps
op by op through the CPU kernels), the kernels op by op, torch's plan of pool views and block
gathers, everything through pool views (with log-sum-exp merges over fragmented blocks) and
everything through the batched block gather.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import attention_plan, fused_decode
from executors.models.config import DecoderConfig
from executors.models.decoder import DecoderLM
from executors.types import DecodeInput, DType, ForwardKind, LogitsPolicy, PrefillInput, UnifiedBatchItem

TOL = 1e-4
VOCAB = 300
BLOCK = 4

FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False, "head_dim": 32},
    # SmolLM3: layer 1 a NoPE one (q and k not rotated), on every path and in the one-call step.
    "smollm3": {"architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1, 0]},
    # OLMo 2: no input norms, q/k norms across heads.
    "olmo2": {"architectures": ["Olmo2ForCausalLM"]},
    # Gemma 2: soft-capped scores (caps that bite on this model's scores and logits), norms
    # around attention's and the MLP's outputs, (1 + w) norms; its default window (4096) is
    # past these positions.
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "head_dim": 16, "attn_logit_softcapping": 1.0,
               "final_logit_softcapping": 5.0, "query_pre_attn_scalar": 20},
    # Cohere: LayerNorms without biases, attention and the MLP in parallel, interleaved pairs.
    "cohere": {"architectures": ["CohereForCausalLM"], "attention_bias": True, "logit_scale": 0.5},
    # Command R+: q/k LayerNorms with a weight row per head (op by op: not the one-call step's).
    "command_r_plus": {"architectures": ["CohereForCausalLM"], "use_qk_norm": True},
    # StableLM: LayerNorms with biases, a quarter of each head rotating; in sequence and in parallel.
    "stablelm": {"architectures": ["StableLmForCausalLM"], "use_qkv_bias": True},
    "stablelm_parallel": {"architectures": ["StableLmForCausalLM"], "use_parallel_residual": True},
    # StarCoder2: LayerNorms with biases, an ungated MLP, biases everywhere (no window here).
    "starcoder2": {"architectures": ["Starcoder2ForCausalLM"], "use_bias": True, "hidden_act": "gelu_pytorch_tanh"},
    # Phi: StarCoder2's MLP in parallel with attention, half of each head rotating, the lm_head's bias.
    "phi": {"architectures": ["PhiForCausalLM"], "hidden_act": "gelu_new"},
    # GPT-OSS: attention sinks (through the paged and prefill kernels, and the reference where a
    # window masks a prompt), layer 0 sliding over 8 tokens; 4 stacked experts with biases, top 2,
    # a clamped SwiGLU whose limit bites at these weights.
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "head_dim": 16, "sliding_window": 8, "num_local_experts": 4,
                "num_experts_per_tok": 2, "swiglu_limit": 1.0,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 1.5e5, "truncate": False,
                                    "original_max_position_embeddings": 16}},
    # Granite MoE with a shared MLP: stacked experts without biases, Granite's multipliers.
    "granitemoeshared": {"architectures": ["GraniteMoeSharedForCausalLM"], "num_local_experts": 4,
                         "num_experts_per_tok": 2, "shared_intermediate_size": 48, "embedding_multiplier": 2.0,
                         "attention_multiplier": 0.3, "residual_multiplier": 0.6, "logits_scaling": 1.5},
    # DeepSeek V3: latent attention (rows of 40 in the pool, one KV head) with its q_lora_rank;
    # 8 experts in 4 groups under the sigmoid router, layer 0 dense. V2: queries from q_proj,
    # the softmax router within groups.
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "q_lora_rank": 48, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24, "moe_intermediate_size": 32,
                    "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
                    "first_k_dense_replace": 1},
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24, "moe_intermediate_size": 32,
                    "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
                    "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5,
                    "first_k_dense_replace": 1},
}
POLICIES = {
    "default": {},  # decode steps of up to 64 rows in one kernel call, other steps op by op
    "ops": {"FUSED_DECODE": False},  # decode steps op by op, through the paged CPU kernel
    "torch": {"FUSED_DECODE": False, "PAGED_KERNEL": False},  # views and gathers as the plan picks them
    "views": {"FUSED_DECODE": False, "PAGED_KERNEL": False, "VIEW_MIN_TOKENS": 0, "MAX_VIEW_RUNS": 1000},
    "gather": {"FUSED_DECODE": False, "PAGED_KERNEL": False, "MAX_VIEW_RUNS": 0},
}


def tiny_model(family: str, dtype: torch.dtype = torch.float32, **edits) -> DecoderLM:
    cfg = DecoderConfig.from_dict(dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, **{**FAMILIES[family], **edits}))
    torch.manual_seed(11)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    return model.to(dtype).eval()


class Pair:
    """A fast and a reference executor over the same model, driven in lockstep."""

    def __init__(self, family: str, num_blocks: int = 160, model: DecoderLM | None = None,
                 backend: str = "sdpa") -> None:
        model = tiny_model(family) if model is None else model
        cfg = LlmExecutorConfig(model_dir=f"/nonexistent/{family}", block_size=BLOCK, num_blocks=num_blocks,
                                attention_backend=backend)
        self.fast = LlmExecutor(cfg, model)
        self.ref = LlmExecutor(cfg, model, reference=True)
        self.loop = asyncio.new_event_loop()

    def both(self, method: str, *args):
        a = self.loop.run_until_complete(getattr(self.fast, method)(*args))
        b = self.loop.run_until_complete(getattr(self.ref, method)(*args))
        return a, b

    def close(self) -> None:
        self.fast.worker.close()
        self.ref.worker.close()
        self.loop.close()


@pytest.fixture(params=list(POLICIES))
def policy(request, monkeypatch):
    for name, value in POLICIES[request.param].items():
        monkeypatch.setattr(fused_decode if name == "FUSED_DECODE" else attention_plan, name, value)
    return request.param


@pytest.fixture(params=list(FAMILIES))
def pair(request):
    p = Pair(request.param)
    yield p
    p.close()


rng = np.random.default_rng(3)


def tokens(n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def same(a, b) -> None:
    np.testing.assert_allclose(a.logits.logits.array, b.logits.logits.array, atol=TOL, rtol=0)


def fragment(p: Pair, keep_free: int = 0) -> None:
    """Fill the pool one block per cache, then free every other one: later caches get
    non-contiguous blocks (the free list is FIFO, so the freed ones come next)."""
    held = []
    while (free := p.fast.kv.allocator.num_free - keep_free) > 0:
        outs, _ = p.both("batch_prefill", [PrefillInput(input_ids=tokens(BLOCK)) for _ in range(min(free, 64))])
        held.extend(o.kv_cache.cache_id for o in outs)
    for cache_id in held[::2]:
        p.both("release_cache", cache_id)


def test_prefill_and_equal_length_batch_prefill(pair, policy):
    a, b = pair.both("prefill", PrefillInput(input_ids=tokens(13)))
    same(a, b)
    outs = pair.both("batch_prefill", [PrefillInput(input_ids=tokens(9)) for _ in range(5)])
    for x, y in zip(*outs):
        same(x, y)
    mixed = pair.both("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (1, 7, 7, 16, 3)])
    for x, y in zip(*mixed):
        same(x, y)


def test_chunked_prefill_over_contiguous_and_fragmented_blocks(pair, policy):
    for fragmented in (False, True):
        if fragmented:
            fragment(pair)
        seq = tokens(41)
        handle = None
        for lo, hi in [(0, 6), (6, 7), (7, 22), (22, 41)]:
            a, b = pair.both("prefill", PrefillInput(input_ids=seq[lo:hi], kv_cache=handle))
            same(a, b)
            assert a.kv_cache == b.kv_cache
            handle = a.kv_cache
        if fragmented:
            ids = handle.block_ids
            assert any(y != x + 1 for x, y in zip(ids, ids[1:])), "blocks should be non-contiguous"


@pytest.mark.parametrize("length", [1, 4, 5, 17, 64, 130])
def test_decode_at_context_lengths_across_block_boundaries(pair, policy, length):
    fragment(pair)
    a, _ = pair.both("prefill", PrefillInput(input_ids=tokens(length)))
    handle = a.kv_cache
    for t in tokens(6):  # crosses at least one block boundary
        a, b = pair.both("decode", DecodeInput(token_id=t, kv_cache=handle))
        same(a, b)
        handle = a.kv_cache


def test_batch_decode_of_mixed_lengths_with_interleaved_blocks(pair, policy):
    lengths = [1, 2, 5, 9, 16, 23, 40, 70]
    outs, _ = pair.both("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in lengths])
    handles = [o.kv_cache for o in outs]
    for step in range(9):  # decoding together interleaves their new blocks
        inputs = [DecodeInput(token_id=t, kv_cache=h) for t, h in zip(tokens(len(handles)), handles)]
        if step % 3 == 2:
            inputs = inputs[::-1]  # rows in another order than the pool's
        a, b = pair.both("batch_decode", inputs)
        for x, y in zip(a, b):
            same(x, y)
        handles = sorted((x.kv_cache for x in a), key=lambda h: h.cache_id)
    assert any(any(y != x + 1 for x, y in zip(h.block_ids, h.block_ids[1:])) for h in handles)


def test_unified_batches_mix_prompts_chunks_and_decodes(pair, policy):
    fragment(pair)
    dec, _ = pair.both("prefill", PrefillInput(input_ids=tokens(19)))
    part, _ = pair.both("prefill", PrefillInput(input_ids=tokens(10)))
    other, _ = pair.both("prefill", PrefillInput(input_ids=tokens(33)))
    items = [
        UnifiedBatchItem(seq_id="", q_tokens=tokens(12), pos_offset=0, is_final_chunk=True),
        UnifiedBatchItem(seq_id=part.kv_cache.cache_id, q_tokens=tokens(8), pos_offset=10, is_final_chunk=True),
        UnifiedBatchItem(seq_id=dec.kv_cache.cache_id, q_tokens=tokens(1), pos_offset=19, is_final_chunk=True),
        UnifiedBatchItem(seq_id="", q_tokens=tokens(12), pos_offset=0, is_final_chunk=True),
        UnifiedBatchItem(seq_id=other.kv_cache.cache_id, q_tokens=tokens(1), pos_offset=33, is_final_chunk=True),
    ]
    a, b = pair.both("unified_decode", items)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.logits.logits.array, y.logits.logits.array, atol=TOL, rtol=0)


def test_forward_verify_and_forward(pair, policy):
    seq = tokens(30)
    a, _ = pair.both("prefill", PrefillInput(input_ids=seq[:21]))
    va, vb = pair.both("forward_verify", a.kv_cache, seq[21:], LogitsPolicy())
    for x, y in zip(va.outputs, vb.outputs):
        np.testing.assert_allclose(x.logits.array, y.logits.array, atol=TOL, rtol=0)
    fa, fb = pair.both("forward", seq, ForwardKind.LOGITS, DType.FLOAT32)
    np.testing.assert_allclose(fa.array, fb.array, atol=TOL, rtol=0)


def test_stale_pool_contents_never_leak_into_the_fast_path(policy):
    """A block's slots past a sequence's end may hold anything (here NaN): the fast path,
    which reads whole blocks under a mask, must clear them before it reads them."""
    p = Pair("llama")
    try:
        p.fast.pool._storage.fill_(float("nan"))
        p.ref.pool._storage.fill_(float("nan"))
        outs, _ = p.both("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (3, 6, 9)])
        handles = [o.kv_cache for o in outs]
        for _ in range(6):
            a, b = p.both("batch_decode", [DecodeInput(token_id=t, kv_cache=h) for t, h in zip(tokens(3), handles)])
            for x, y in zip(a, b):
                assert np.isfinite(x.logits.logits.array).all()
                same(x, y)
            handles = [x.kv_cache for x in a]
    finally:
        p.close()


def test_runs_of_block_tables():
    assert attention_plan.runs_of([5], 1) == [(5, 1)]
    assert attention_plan.runs_of([3, 4, 5, 9, 10, 2], 6) == [(3, 3), (9, 2), (2, 1)]
    assert attention_plan.runs_of([3, 4, 5, 9, 10, 2], 4) == [(3, 3), (9, 1)]


@pytest.mark.parametrize("kernels", [True, False])
def test_fusing_keeps_parameters_and_their_count(kernels):
    """Without the CPU kernels the modules' weights become views of the fused tensors; with
    them, panels (tests/models/test_panel_weights.py). The checkpoint's parameters, their
    count and the state_dict are the same either way."""
    model = tiny_model("qwen2")
    model.use_cpu_kernels = kernels
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    count = sum(p.numel() for p in model.parameters())
    model.fuse()
    after = dict(model.logical_parameters())
    assert list(before) == list(after)
    for n, p in after.items():
        assert torch.equal(before[n], p), n
    assert model.num_parameters() == count
    state = model.state_dict()
    assert all(torch.equal(state[n], p) for n, p in before.items())
    if model.cpu_kernels is None:
        layer = model.model.layers[0].self_attn
        assert layer.q_proj.weight.data_ptr() == model.fused[0].qkv.data_ptr(), "q_proj is a view of the fused weight"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_fast_path_is_as_close_to_float32_as_the_bfloat16_reference(family):
    """bfloat16 rounds differently on each path (oneDNN prepacked matmuls, bf16 SDPA on bf16
    KV): the fast path's distance to float32 must stay that of the plain bf16 computation.
    One sequence's worst row is noise (the two paths' ratio ranges 0.6-1.9 over sequences),
    so the mean of eight sequences' worst rows is compared, on sequences of the test's own.
    A mixture of experts chooses every expert here: its top-k choice between close router
    logits flips under bfloat16's rounding, on either path at random, and one flipped expert
    moves a row's logits far more than rounding does (GPT-OSS's and Granite MoE's worst rows
    then ranged 0.13-1.3 on both paths), which would hide the arithmetic this compares."""
    local = np.random.default_rng(17)
    seqs = [local.integers(0, VOCAB, size=37).tolist() for _ in range(8)]
    experts = FAMILIES[family].get("num_local_experts")
    every_expert = {} if experts is None else {"num_experts_per_tok": experts}

    def run(dtype: str, reference: bool) -> list[np.ndarray]:
        model = tiny_model(family, torch.float32 if dtype == "float32" else torch.bfloat16, **every_expert)
        ex = LlmExecutor(LlmExecutorConfig(model_dir=f"/nonexistent/{family}", dtype=dtype, block_size=BLOCK,
                                           num_blocks=128), model, reference=reference)
        loop = asyncio.new_event_loop()
        try:
            outs = []
            for seq in seqs:
                out = loop.run_until_complete(ex.prefill(PrefillInput(input_ids=seq[:30])))
                rows, handle = [out.logits.logits.array], out.kv_cache
                for t in seq[30:]:
                    out = loop.run_until_complete(ex.decode(DecodeInput(token_id=t, kv_cache=handle)))
                    rows.append(out.logits.logits.array)
                    handle = out.kv_cache
                loop.run_until_complete(ex.release_cache(handle.cache_id))
                outs.append(np.stack(rows))
            return outs
        finally:
            ex.worker.close()
            loop.close()

    exact = run("float32", True)
    fast_err = np.mean([np.abs(f - e).max() for f, e in zip(run("bfloat16", False), exact)])
    ref_err = np.mean([np.abs(r - e).max() for r, e in zip(run("bfloat16", True), exact)])
    assert fast_err <= 1.25 * ref_err + 0.02, (fast_err, ref_err)


def test_moving_a_fused_model_fuses_it_again():
    """The fused weights are no parameters: .to() must not leave the fast forward reading the
    old device's (or dtype's) copies while the parameters move (a model fused on the CPU,
    then moved to a GPU, was the case)."""
    from executors.models.attention import Segment, StepContext

    model = tiny_model("llama").fuse()
    model.to(torch.float64)
    assert model.fused[0].qkv.dtype == torch.float64
    # Still one copy of the weights: the parameters are views of the fused tensors again.
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == model.fused[0].qkv.data_ptr()
    ids, positions = torch.tensor([3, 1, 4, 1, 5]), torch.arange(5)
    fast = model.hidden_states(ids, positions, StepContext([Segment(0, 5, 0)]))
    ref = model.hidden_states(ids, positions, StepContext([Segment(0, 5, 0)], reference=True))
    assert fast.dtype == torch.float64
    torch.testing.assert_close(fast, ref, atol=TOL, rtol=0)  # the two rotate in float32 tables each way
