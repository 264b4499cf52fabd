"""The mixture-of-experts and sliding-window families over gRPC against transformers (fp32, 1e-4).

Qwen3-MoE, Qwen2-MoE, Mixtral, Mistral, Gemma, Gemma 2, Gemma 3, Phi-3, Granite, SmolLM3 (NoPE layers), OLMo 2 (norms after attention
and the MLP only, q/k norms across heads), OLMo 3 (its windows, YaRN on its global layers) and
EXAONE 4 (output norms, per-head q/k norms, NoPE global layers among sliding ones) and GLM-4
(half of each head rotating in neighbouring pairs, fused gate/up, renamed norms), Ministral,
Helium (whole heads rotating in neighbouring pairs) and Seed-OSS (o_proj's bias by its own key):
tiny random checkpoints saved by
transformers (tiny_models.py), loaded by our loader and served by a real server, as
test_llm_executor.py does for the dense families. The sliding families have a window of 8
tokens with blocks of 4, and the sequences here run to 5-10 windows, with chunk boundaries
inside windows, on them and across them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client import DecodeInput, PrefillInput, UnifiedBatchItem
from tests.models.test_llm_executor import Served, close, greedy, prompt

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "mistral", "gemma", "gemma2", "gemma3", "phi3", "granite", "smollm3", "olmo2",
            "olmo3", "exaone4", "glm4", "ministral",
            "helium", "seed_oss", "cohere", "cohere2", "stablelm", "starcoder2", "olmoe", "phi",
            "glm4_moe", "gemma3_multimodal", "mistral3", "minimax_m2", "command_r_plus",
            "qwen2_5_vl", "qwen3_vl", "gpt_oss", "granitemoe", "granitemoeshared", "deepseek_v3", "deepseek_v2"]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    s = Served(request.param, tmp_path_factory.mktemp("tiny"))
    mc = s.executor.model_config
    if mc.all_layers_sliding:
        # Keep 6 positions before the window (drafts to roll back) instead of 64, so that
        # these short sequences return blocks to the pool too.
        s.executor.kv.enable_sliding(max(mc.layer_windows), 6)
    yield s
    s.close()


def test_prefill_chunked_prefill_and_decode_across_windows(served):
    c = served.client
    tokens = prompt(45)
    ref = served.logits(tokens + [5, 6, 7, 8])
    whole = c.prefill(PrefillInput(tokens))
    close(whole.logits.logits, ref[44])
    handle = None
    # Chunks of 3, 8, 1, 17 and 16: inside a window, exactly one, and spanning several.
    for a, b in [(0, 3), (3, 11), (11, 12), (12, 29), (29, 45)]:
        out = c.prefill(PrefillInput(tokens[a:b], kv_cache=handle))
        handle = out.kv_cache
        close(out.logits.logits, ref[b - 1])
    for i, t in enumerate([5, 6, 7, 8]):
        step = c.decode(DecodeInput(t, handle))
        handle = step.kv_cache
        close(step.logits.logits, ref[45 + i])
    c.release_cache(handle)
    c.release_cache(whole.kv_cache)


def test_batch_prefill_batch_decode_and_unified_batches(served):
    c = served.client
    prompts = [prompt(n) for n in (1, 6, 13, 37)]
    outs = c.batch_prefill([PrefillInput(p) for p in prompts])
    for p, o in zip(prompts, outs):
        close(o.logits.logits, served.logits(p)[-1])
    nxt = prompt(4)
    steps = c.batch_decode([DecodeInput(t, o.kv_cache) for t, o in zip(nxt, outs)])
    for p, t, s in zip(prompts, nxt, steps):
        close(s.logits.logits, served.logits(p + [t])[-1])
    # A unified step: a fresh prompt, a chunk starting far into its sequence, a decode.
    chunked, fresh = prompt(50), prompt(21)
    part = c.prefill(PrefillInput(chunked[:33])).kv_cache
    results = c.unified_decode([
        UnifiedBatchItem("", fresh, 0, True),
        UnifiedBatchItem(part.cache_id, chunked[33:], 33, True),
        UnifiedBatchItem(steps[3].kv_cache.cache_id, [9], 38, True),
    ])
    close(results[0].logits.logits, served.logits(fresh)[-1])
    close(results[1].logits.logits, served.logits(chunked)[-1])
    close(results[2].logits.logits, served.logits(prompts[3] + [nxt[3], 9])[-1])
    for s in steps[:3]:
        c.release_cache(s.kv_cache)
    for r in results:
        c.release_cache(r.seq_id)


def test_forward_verify_and_forward(served):
    c = served.client
    tokens, drafts = prompt(27), prompt(6)
    ref = served.logits(tokens + drafts)
    handle = c.prefill(PrefillInput(tokens)).kv_cache
    ver = c.forward_verify(handle, drafts)
    for i, row in enumerate(ver.outputs):
        close(row.logits, ref[27 + i])
    # Roll the rejected drafts back and go on: the window's K and V are still there.
    handle = c.truncate_kv(ver.kv_cache, 29).kv_cache
    step = c.decode(DecodeInput(drafts[2], handle))
    close(step.logits.logits, ref[29])
    c.release_cache(step.kv_cache)
    seq = tokens + drafts
    close(c.forward(seq).output, ref)
    close(c.forward(seq, output="hidden_states").output, served.hidden(seq))


def test_greedy_tokens_match_transformers_for_32_steps_whatever_the_batch_or_chunks(served):
    c = served.client
    tokens = prompt(19)
    alone = greedy(c, tokens, 32)
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(32):
            seq.append(int(served.oracle(torch.tensor([seq])).logits[0, -1].argmax()))
    assert alone == seq[19:]
    assert greedy(c, tokens, 32, mates=[prompt(3), prompt(30), prompt(17)]) == alone
    assert greedy(c, tokens, 32, chunk=5) == alone


def test_status_reports_expert_load_or_window_freeing(served):
    st = served.client.status()
    moe = served.executor.model_config.moe
    if moe is None:
        assert not st.HasField("expert_load")
    else:
        load = st.expert_load
        assert load.num_experts == moe.num_experts and load.experts_per_token == moe.top_k
        assert list(load.sparse_layers) == [i for i, s in enumerate(moe.sparse_layers) if s]
        per_layer = np.array(load.layer_tokens_per_expert).reshape(len(load.sparse_layers), moe.num_experts)
        assert (per_layer.sum(0) == np.array(load.tokens_per_expert)).all()
        # Every routed row went to top_k experts, in every sparse layer alike.
        assert len(set(per_layer.sum(1))) == 1 and per_layer.sum(1)[0] % moe.top_k == 0
    if served.executor.model_config.all_layers_sliding:  # Mistral: the earlier tests freed blocks
        assert st.kv_pool.window_freed_blocks > 0
    else:
        assert st.kv_pool.window_freed_blocks == 0


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "smollm3", "olmo2", "olmo3", "exaone4", "glm4",
                                    "phi3", "granite", "cohere", "cohere2", "stablelm", "starcoder2", "phi"])
def test_every_dense_family_decodes_in_one_kernel_call(family, tmp_path):
    """A float32 CPU decode step of every dense family runs whole in the one-call kernel
    (test_fused_decode.py holds its logits to the reference's): none is left op by op."""
    from executors.cpu_kernels import cpu_kernels
    from executors.llm import LlmExecutor, LlmExecutorConfig
    from executors.models.fused_decode import unsupported
    from tests.models.tiny_models import build

    if cpu_kernels() is None:
        pytest.skip("the CPU kernels do not build here: there is no one-call step")
    build(family, tmp_path)
    executor = LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path), num_blocks=32))
    try:
        assert unsupported(executor.model) is None and executor.model.fused_decode is not None
    finally:
        executor.close()


def test_gemma2_soft_capped_scores_refuse_the_triton_kernels(tmp_path):
    """No Triton kernel caps scores: asked for by name they are refused, auto falls back to
    SDPA's path (and, on a CPU in float32, the CPU kernels, which cap)."""
    from executors.llm import LlmExecutor, LlmExecutorConfig
    from tests.models.tiny_models import build

    build("gemma2", tmp_path)
    executor = LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path), num_blocks=32))
    try:
        assert executor.attention_backend == "sdpa"
    finally:
        executor.close()
    with pytest.raises(ValueError, match="the Triton kernels do not soft-cap attention scores"):
        LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path), num_blocks=32, attention_backend="triton"))
