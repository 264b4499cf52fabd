"""Mixture-of-experts routing and grouped expert compute (fp32, 1e-4), and the loader's refusals.

The grouped path (rows sorted by expert, one matmul pair per expert with rows) against the
plain per-expert reference of SparseMoe and against transformers' own sparse block, on a
batch routed so that one expert gets every row and some get none; the Triton grouped GEMM
in Triton's interpreter (compiled on a GPU); torch's grouped GEMM on CUDA only. Whole-model
checks against transformers are in test_families.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import moe, moe_grouped
from executors.models.config import DecoderConfig, UnsupportedModel
from executors.models.stacked_experts import gated
from tests.conftest import triton_kernels_unrunnable
from tests.models.test_llm_executor import broken_copy
from tests.models.tiny_models import build

TOL = 1e-4
HIDDEN, EXPERTS, TOP_K = 32, 8, 2


def sparse_block(shared: bool = False, renorm: bool = True) -> moe.SparseMoe:
    cfg = DecoderConfig.from_dict(dict(
        architectures=["Qwen2MoeForCausalLM" if shared else "Qwen3MoeForCausalLM"], vocab_size=50,
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, moe_intermediate_size=24, norm_topk_prob=renorm,
        shared_expert_intermediate_size=40 if shared else 0))
    torch.manual_seed(3)
    block = moe.SparseMoe(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        # Every row has a positive first feature: expert 0 (a large positive router weight on
        # it) is every row's first choice, and experts 5-7 (large negative ones) no row's.
        block.gate.weight[0, 0] = 50.0
        block.gate.weight[5:, 0] = -50.0
    return block.eval()


def skewed_rows(n: int = 13) -> torch.Tensor:
    torch.manual_seed(4)
    x = torch.randn(n, HIDDEN)
    x[:, 0] = x[:, 0].abs() + 0.5
    return x


@pytest.mark.parametrize("shared", [False, True], ids=["qwen3_moe", "qwen2_moe_shared_expert"])
def test_grouped_path_equals_the_reference_when_one_expert_takes_every_row_and_some_none(shared):
    block = sparse_block(shared, renorm=not shared)
    x = skewed_rows()
    _, experts = moe.route(x, block.gate.weight, TOP_K, True)
    counts = torch.bincount(experts.flatten(), minlength=EXPERTS)
    assert counts[0] == x.shape[0] and (counts[5:] == 0).all()
    load_ref, load_fast = torch.zeros(EXPERTS, dtype=torch.int64), torch.zeros(EXPERTS, dtype=torch.int64)
    want = block(x, load_ref)
    got = moe.moe_forward(x, moe.stack(block), block.act, load_fast)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert torch.equal(load_ref, counts) and torch.equal(load_fast, counts)
    # Each row alone gives what it gave in the batch: no row depends on its batch mates.
    w = moe.stack(block)
    for r in range(x.shape[0]):
        torch.testing.assert_close(moe.moe_forward(x[r:r + 1], w, block.act), got[r:r + 1], atol=TOL, rtol=0)


def test_experts_no_row_picked_cost_no_matmul(monkeypatch):
    block = sparse_block()
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(moe.F, "linear", lambda x, w, *a: calls.append(tuple(w.shape)) or real(x, w, *a))
    moe.moe_forward(skewed_rows(1), moe.stack(block), block.act)
    # The router, then one gate/up matmul for each of the two experts the row picked.
    assert calls == [(EXPERTS, HIDDEN), (48, HIDDEN), (48, HIDDEN)]


def test_the_reference_equals_transformers_sparse_block():
    import transformers as tf

    block = sparse_block(shared=False)
    cfg = tf.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            moe_intermediate_size=24, norm_topk_prob=True)
    theirs = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg).eval()
    w = moe.stack(block)
    with torch.no_grad():
        theirs.gate.weight.copy_(w.router)
        theirs.experts.gate_up_proj.copy_(w.gate_up)
        theirs.experts.down_proj.copy_(w.down)
        x = skewed_rows()
        torch.testing.assert_close(block(x), theirs(x.unsqueeze(0))[0], atol=TOL, rtol=0)


def grouped_case():
    torch.manual_seed(5)
    counts = torch.tensor([0, 7, 0, 1, 20, 0, 0, 3])
    xs = torch.randn(int(counts.sum()), HIDDEN)
    gate_up, down = torch.randn(EXPERTS, 48, HIDDEN) * 0.2, torch.randn(EXPERTS, HIDDEN, 24) * 0.2
    return xs, counts, gate_up, down


@pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))
def test_triton_grouped_gemm_equals_the_loop():
    from executors.models import moe_triton

    xs, counts, gate_up, _ = grouped_case()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    xs, counts, gate_up = xs.to(device), counts.to(device), gate_up.to(device)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    want = torch.cat([xs[int(a):int(b)] @ gate_up[e].t() for e, (a, b) in
                      enumerate(zip([0] + ends.tolist()[:-1], ends.tolist()))])
    torch.testing.assert_close(moe_triton.grouped_matmul(xs, gate_up, ends), want, atol=TOL, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gpt_oss", [False, True])  # its biases gathered per row, its clamped SwiGLU
def test_cuda_grouped_backend_equals_the_loop(dtype, gpt_oss):
    xs, counts, gate_up, down = (t.cuda() for t in grouped_case())
    xs, gate_up, down = xs.to(dtype), gate_up.to(dtype), down.to(dtype)
    glu = gated(torch.nn.functional.silu, (7.0, 1.702) if gpt_oss else None)
    biases = row_experts = None
    if gpt_oss:
        biases = (torch.randn(gate_up.shape[:2], device="cuda", dtype=dtype),
                  torch.randn(down.shape[:2], device="cuda", dtype=dtype))
        row_experts = torch.repeat_interleave(torch.arange(len(counts), device="cuda"), counts)
    assert moe_grouped.grouped_backend(xs.device, dtype) in ("torch", "triton")
    want = moe_grouped.grouped_swiglu_loop(xs, counts, gate_up, down, glu, biases).float()
    got = moe_grouped.grouped_swiglu(xs, counts, gate_up, down, glu, biases, row_experts).float()
    tol = TOL if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# -- loading ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    dirs = {}
    for family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        dirs[family] = tmp_path_factory.mktemp(family)
        build(family, dirs[family])
    return dirs


@pytest.mark.parametrize("family, damage, message", [
    ("qwen3_moe", dict(drop="model.layers.2.mlp.experts.5.up_proj.weight"), "model.layers.2.mlp.experts.5.up_proj"),
    ("qwen3_moe", dict(config=lambda c: dict(c, scoring_func="sigmoid")), "scoring_func='sigmoid'"),
    ("qwen3_moe", dict(config=lambda c: dict(c, num_experts_per_tok=9)), "num_experts_per_tok"),
    ("qwen2_moe", dict(drop="model.layers.1.mlp.shared_expert_gate.weight"), "shared_expert_gate"),
    ("qwen2_moe", dict(config=lambda c: dict(c, n_group=4, topk_group=2)), "n_group=4"),
    ("mixtral", dict(drop="model.layers.0.block_sparse_moe.experts.3.w2.weight"), "experts.3.w2"),
    ("mixtral", dict(config=lambda c: {k: v for k, v in c.items() if k != "num_local_experts"}), "num_local_experts"),
], ids=["qwen3_expert", "qwen3_scoring", "qwen3_top_k", "qwen2_shared_gate", "qwen2_grouped_topk",
        "mixtral_expert", "mixtral_experts"])
def test_unservable_moe_checkpoints_fail_at_start_naming_the_problem(moe_dirs, tmp_path, family, damage, message):
    bad = broken_copy(moe_dirs[family], tmp_path / "bad", **damage)
    with pytest.raises(UnsupportedModel, match=message.replace(".", r"\.")):
        LlmExecutor(LlmExecutorConfig(model_dir=str(bad)))


def test_sharded_moe_checkpoint_loads_and_reports_expert_load(tmp_path):
    import asyncio

    from executors.types import PrefillInput

    model = build("qwen3_moe", tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path / "sharded"), block_size=4, num_blocks=32))
    try:
        tokens = list(range(11))
        out = asyncio.run(ex.prefill(PrefillInput(input_ids=tokens)))
        with torch.no_grad():
            want = model(torch.tensor([tokens])).logits[0, -1].numpy()
        torch.testing.assert_close(torch.tensor(out.logits.logits.array), torch.tensor(want), atol=TOL, rtol=0)
        load = ex.status().expert_load
        assert load.sparse_layers == (0, 2) and sum(load.tokens_per_expert) == 2 * TOP_K * len(tokens)
    finally:
        ex.worker.close()


def test_glm4_moe_loads_past_its_prediction_layer_and_keeps_its_router_correction_in_float32(tmp_path):
    """GLM-4.5's checkpoints hold a multi-token-prediction layer after the last one, which
    transformers does not load: neither does the loader (another family's extra layer is still
    refused). The router's e_score_correction_bias stays float32 in a bfloat16 model, as
    transformers keeps it: it decides between sigmoid scores closer than bfloat16 resolves."""
    from safetensors.torch import load_file, save_file

    build("glm4_moe", tmp_path / "glm")
    weights = load_file(tmp_path / "glm" / "model.safetensors")
    layers = json.loads((tmp_path / "glm" / "config.json").read_text())["num_hidden_layers"]
    weights[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(4, 4)
    weights[f"model.layers.{layers}.mlp.gate.weight"] = torch.zeros(8, 64)
    save_file(weights, tmp_path / "glm" / "model.safetensors", metadata={"format": "pt"})
    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path / "glm"), num_blocks=16, dtype="bfloat16"))
    try:
        correction = ex.model.model.layers[1].mlp.gate.e_score_correction_bias
        assert correction.dtype == torch.float32 and correction.abs().max() > 0
        assert ex.model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16
    finally:
        ex.worker.close()
    build("qwen3_moe", tmp_path / "qwen")
    weights = load_file(tmp_path / "qwen" / "model.safetensors")
    weights["model.layers.4.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, tmp_path / "qwen" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="does not expect: model.layers.4.eh_proj.weight"):
        LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path / "qwen"), num_blocks=16))


def test_glm4_moe_router_and_shared_experts_match_transformers_block(tmp_path):
    """GLM-4.5's sparse block (sigmoid scores, the correction, 2 of 4 groups, renormalised
    and scaled weights, ungated shared expert): the reference and the grouped path against
    transformers' Glm4MoeMoE on the same rows, and the same experts chosen."""
    from executors.models.loader import load_model

    theirs = build("glm4_moe", tmp_path).model.layers[1].mlp
    ours = load_model(tmp_path, torch.float32, "cpu")
    block, weights = ours.model.layers[1].mlp, ours.fused[1].moe
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = theirs(x[None])[0]
        _, their_weights, their_experts = theirs.gate(x)
        got_weights, got_experts = moe.route(x, block.gate.weight, block.top_k, block.norm_topk_prob,
                                             block.grouped_routing())
        torch.testing.assert_close(block(x), want, atol=TOL, rtol=0)
        torch.testing.assert_close(moe.moe_forward(x, weights, ours.act), want, atol=TOL, rtol=0)
    order, got_order = their_experts.sort(-1), got_experts.sort(-1)
    assert torch.equal(order.values, got_order.values)
    torch.testing.assert_close(got_weights.gather(1, got_order.indices), their_weights.gather(1, order.indices))


def test_granite_moe_files_under_transformers_module_names_load_alike(tmp_path):
    """Granite MoE's published names (input_linear, output_linear, router.layer, shared_mlp's
    fused input) and transformers' module names for them (experts.gate_up_proj, ...) serve the
    same model."""
    import asyncio

    import numpy as np
    from safetensors.torch import load_file, save_file

    from executors.types import PrefillInput

    oracle = build("granitemoeshared", tmp_path / "published")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((tmp_path / "published" / "config.json").read_text())
    weights = load_file(tmp_path / "published" / "model.safetensors")
    names = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
             "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
             "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
             "shared_mlp.output_linear.weight": "block_sparse_moe.shared_mlp.down_proj.weight"}
    moved = {}
    for name, tensor in weights.items():
        if name.endswith("shared_mlp.input_linear.weight"):
            prefix, half = name.removesuffix("shared_mlp.input_linear.weight"), tensor.shape[0] // 2
            moved[f"{prefix}block_sparse_moe.shared_mlp.gate_proj.weight"] = tensor[:half].clone()
            moved[f"{prefix}block_sparse_moe.shared_mlp.up_proj.weight"] = tensor[half:].clone()
            continue
        theirs = next((t for t in names if name.endswith(t)), None)
        moved[name if theirs is None else name.removesuffix(theirs) + names[theirs]] = tensor
    assert set(moved) != set(weights)
    save_file(moved, renamed / "model.safetensors", metadata={"format": "pt"})
    tokens = [3, 17, 5, 99, 12, 7, 250, 31]
    with torch.no_grad():
        want = oracle(torch.tensor([tokens])).logits[0, -1].numpy()
    for model_dir in (tmp_path / "published", renamed):
        ex = LlmExecutor(LlmExecutorConfig(model_dir=str(model_dir), num_blocks=16))
        try:
            got = asyncio.run(ex.prefill(PrefillInput(input_ids=tokens))).logits.logits.array
        finally:
            ex.worker.close()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
