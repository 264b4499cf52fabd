"""Sliding-window attention on every path, and the KV blocks a window leaves (fp32, 1e-4).

As test_cpu_paths.py: a fast and a reference LlmExecutor share one tiny random model with
windows of 6 tokens over blocks of 4 (so a window's first block is partly out of it), under
the policies of that module (one-call decode steps, kernels op by op, views, gathers), on fresh
and fragmented pools. The Triton kernels (Triton's interpreter without a GPU) run against
the reference too. test_families.py checks these models against transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executors.models.config import DecoderConfig
from executors.models.decoder import DecoderLM
from executors.types import DecodeInput, LogitsPolicy, PrefillInput, UnifiedBatchItem
from kvcache import KvCacheManager
from kvcache.block_table import FREED
from kvcache.errors import LeftWindow
from tests.conftest import triton_kernels_unrunnable
from tests.models import test_cpu_paths as cpu_paths
from tests.models.test_cpu_paths import BLOCK, TOL, VOCAB, policy, same  # noqa: F401 - policy: a fixture

WINDOW = 6
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
          "sliding_window": WINDOW}
FAMILIES = {
    "mistral": {"architectures": ["MistralForCausalLM"]},
    # A global layer between sliding ones, a query scale other than 1/sqrt(head_dim).
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "query_pre_attn_scalar": 20,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
               "final_logit_softcapping": 30.0},
    # OLMo 3: sliding layers around a global one, YaRN on it, q/k norms across heads, no input norms.
    "olmo3": {"architectures": ["Olmo3ForCausalLM"],
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
              "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                     "original_max_position_embeddings": 2048},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 3e3}}},
    # EXAONE 4: output norms only, per-head q/k norms, the global layer NoPE.
    "exaone4": {"architectures": ["Exaone4ForCausalLM"], "head_dim": 16,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # Cohere 2: parallel layers with LayerNorms, the sliding ones rotating, the global one NoPE.
    "cohere2": {"architectures": ["Cohere2ForCausalLM"], "head_dim": 16,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
}


def tiny_model(family: str) -> DecoderLM:
    torch.manual_seed(13)
    model = DecoderLM(DecoderConfig.from_dict(dict(COMMON, **FAMILIES[family])))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) + (1 if "norm" in name and family != "gemma3" else 0))
    return model.eval()


class Pair(cpu_paths.Pair):
    def __init__(self, family: str, num_blocks: int = 160, backend: str = "sdpa") -> None:
        super().__init__(family, num_blocks, model=tiny_model(family), backend=backend)


@pytest.fixture(params=list(FAMILIES))
def pair(request):
    p = Pair(request.param)
    yield p
    p.close()


rng = np.random.default_rng(17)


def tokens(n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def fragment(p: Pair) -> None:
    held = []
    while (free := p.fast.kv.allocator.num_free) > 0:
        outs, _ = p.both("batch_prefill", [PrefillInput(input_ids=tokens(BLOCK)) for _ in range(min(free, 64))])
        held.extend(o.kv_cache.cache_id for o in outs)
    for cache_id in held[::2]:
        p.both("release_cache", cache_id)


def test_chunks_decodes_and_batches_over_windows_on_fragmented_pools(pair, policy):  # noqa: F811 - the fixture
    for fragmented in (False, True):
        if fragmented:
            fragment(pair)
        seq, handle = tokens(47), None
        # Chunks inside a window, exactly one, across several; then decodes past it.
        for lo, hi in [(0, 2), (2, 8), (8, 9), (9, 30), (30, 41)]:
            a, b = pair.both("prefill", PrefillInput(input_ids=seq[lo:hi], kv_cache=handle))
            same(a, b)
            handle = a.kv_cache
        for t in seq[41:]:
            a, b = pair.both("decode", DecodeInput(token_id=t, kv_cache=handle))
            same(a, b)
            handle = a.kv_cache
        outs, _ = pair.both("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (1, 5, 6, 7, 19, 19, 40)])
        handles = [o.kv_cache for o in outs]
        for _ in range(5):
            a, b = pair.both("batch_decode", [DecodeInput(token_id=t, kv_cache=h)
                                              for t, h in zip(tokens(len(handles)), handles)])
            for x, y in zip(a, b):
                same(x, y)
            handles = [x.kv_cache for x in a]
        items = [UnifiedBatchItem(seq_id="", q_tokens=tokens(13), pos_offset=0, is_final_chunk=True),
                 UnifiedBatchItem(seq_id=handles[6].cache_id, q_tokens=tokens(9), pos_offset=45, is_final_chunk=True),
                 UnifiedBatchItem(seq_id=handles[4].cache_id, q_tokens=tokens(1), pos_offset=24, is_final_chunk=True)]
        a, b = pair.both("unified_decode", items)
        for x, y in zip(a, b):
            same(x, y)
        for h in handles:
            pair.both("release_cache", h.cache_id)
        pair.both("release_cache", a[0].seq_id)


@pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_kernels_bound_their_key_loops_by_the_window(family):
    p = Pair(family, num_blocks=48, backend="triton")
    try:
        assert p.fast.attention_backend == "triton"
        seq = tokens(30)
        a, b = p.both("prefill", PrefillInput(input_ids=seq[:3]))
        same(a, b)
        a, b = p.both("prefill", PrefillInput(input_ids=seq[3:27], kv_cache=a.kv_cache))  # a chunk over windows
        same(a, b)
        handle = a.kv_cache
        other, _ = p.both("prefill", PrefillInput(input_ids=tokens(20)))
        handles = [handle, other.kv_cache]
        for t in seq[27:]:
            a, b = p.both("batch_decode", [DecodeInput(token_id=t, kv_cache=h) for h in handles])
            for x, y in zip(a, b):
                same(x, y)
            handles = [x.kv_cache for x in a]
    finally:
        p.close()


# -- returning the blocks a window left ------------------------------------------------------
def test_only_a_model_whose_every_layer_slides_frees_blocks():
    mistral, gemma = Pair("mistral"), Pair("gemma3")
    try:
        assert mistral.fast.kv.window == WINDOW and gemma.fast.kv.window is None
        for p in (mistral, gemma):
            a, _ = p.both("prefill", PrefillInput(input_ids=tokens(200)))
            held = len(a.kv_cache.block_ids)
            if p is mistral:  # 200 tokens, a window of 6 and 64 positions kept for rollbacks
                assert held == -(-200 // BLOCK) - (200 - WINDOW + 1 - 64) // BLOCK
                assert p.fast.status().kv_pool.window_freed_blocks == -(-200 // BLOCK) - held
            else:
                assert held == -(-200 // BLOCK) and p.fast.status().kv_pool.window_freed_blocks == 0
            p.fast.kv.check_invariants()
    finally:
        mistral.close()
        gemma.close()


def test_freed_blocks_keep_decode_verify_truncate_and_release_right():
    p = Pair("mistral", num_blocks=40)
    try:
        for ex in (p.fast, p.ref):
            ex.kv.enable_sliding(WINDOW, 5)
        seq = tokens(90)
        a, b = p.both("prefill", PrefillInput(input_ids=seq[:50]))
        same(a, b)
        table = p.fast.kv.get(a.kv_cache.cache_id)
        assert table.freed_blocks == (50 - WINDOW + 1 - 5) // BLOCK and table.block_ids[0] == FREED
        [listed] = p.loop.run_until_complete(p.fast.list_caches([a.kv_cache.cache_id]))
        assert listed.num_blocks == len(a.kv_cache.block_ids) == len(table.block_ids) - table.freed_blocks
        handle = a.kv_cache
        for t in seq[50:120]:  # 70 tokens on 40 blocks: only because the window's blocks go back
            a, b = p.both("decode", DecodeInput(token_id=t, kv_cache=handle))
            same(a, b)
            handle = a.kv_cache
        ver, vref = p.both("forward_verify", handle, tokens(4), LogitsPolicy())
        for x, y in zip(ver.outputs, vref.outputs):
            np.testing.assert_allclose(x.logits.array, y.logits.array, atol=TOL, rtol=0)
        length = ver.kv_cache.sequence_length
        a, b = p.both("truncate_kv", handle.cache_id, length - 4)  # the drafts: within the reserve
        a, b = p.both("decode", DecodeInput(token_id=7, kv_cache=a.kv_cache))
        same(a, b)
        with pytest.raises(LeftWindow, match="left the sliding window"):
            p.loop.run_until_complete(p.fast.truncate_kv(handle.cache_id, 30))
        p.fast.kv.check_invariants()
        (res, _) = p.both("truncate_kv", handle.cache_id, 0)  # to 0: nothing left to read
        assert res.kv_cache.block_ids == ()
        p.both("release_cache", handle.cache_id)
        assert p.fast.kv.allocator.num_free == 40
        p.fast.kv.check_invariants()
    finally:
        p.close()


def test_sliding_past_a_shared_prefix_leaves_its_sharers_alone():
    kv = KvCacheManager(num_blocks=32, block_size=4)
    kv.enable_sliding(window=4, reserve=0)
    prompt = list(range(24))
    a, _ = kv.create()
    kv.extend(a, 24)
    kv.commit(a, 0, prompt)
    b, _ = kv.create()
    assert kv.match_prefix(b, prompt, 24) == 24  # b shares all six blocks of a
    kv.extend(b, 25)
    kv.commit(b, 24, [99])
    shared = kv.get(b).block_ids[:5]
    assert kv.slide(b) == (25 - 4 + 1) // 4 == kv.get(b).freed_blocks
    assert kv.stats().window_freed_blocks == 0, "a still holds them: nothing returns to the pool"
    assert kv.get(a).block_ids[:5] == shared and FREED not in kv.get(a).block_ids
    kv.check_invariants()
    freed = kv.slide(a)
    assert freed == (24 - 4 + 1) // 4  # now they go back (as cached prefix blocks): all of them were shared
    assert kv.stats().window_freed_blocks == freed and kv.stats().cached_blocks >= freed
    kv.check_invariants()
    c, _ = kv.create()
    assert kv.match_prefix(c, prompt, 24) == 24, "the freed blocks still serve a later prompt with that prefix"
    kv.check_invariants()
