"""DeepSeek V2 and V3: latent attention's cache, routers, adapters and checkpoint layout
against transformers (the logits over gRPC are test_families.py's, every CPU path
test_cpu_paths.py's, two ranks test_tensor_parallel.py's)."""

from __future__ import annotations

import json

import pytest
import torch

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import moe
from executors.models.config import DecoderConfig, UnsupportedModel
from executors.models.decoder import DecoderLM
from executors.models.loader import load_model
from tests.models.tiny_models import build

tf = pytest.importorskip("transformers")
TOKENS = [3, 17, 250, 9, 44, 101, 5, 77, 12, 300, 64, 2, 31]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_the_pool_caches_one_latent_row_a_token(family, tmp_path):
    """One KV head of kv_lora_rank + qk_rope_head_dim (32 + 8) a layer, whatever the heads,
    stored once as K and read as V too: transformers' expanded keys and values would be 4
    heads of (16 + 8) + 24."""
    build(family, tmp_path)
    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(tmp_path), num_blocks=16, block_size=4))
    try:
        pool = ex.pool
        assert (pool.num_kv_heads, pool.head_dim) == (1, 40)
        # The rows are their own values: K alone, 3 layers, float32; V is the same tensor.
        assert pool.bytes_per_token == 3 * 40 * 4 and pool.value[0] is pool.key[0]
        assert pool.total_bytes == 16 * 4 * 3 * 40 * 4
        assert ex.model_config.head_dim == 40 and ex.model_config.num_kv_heads == 1
    finally:
        ex.worker.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_routers_choose_and_weigh_as_transformers(family, tmp_path):
    """V3's sigmoid scores plus a correction within the best groups (renormalised, scaled),
    V2's softmax within the groups of the best single scores (scaled, not renormalised)."""
    theirs = build(family, tmp_path).model.layers[1].mlp
    block = load_model(tmp_path, torch.float32, "cpu").model.layers[1].mlp
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, their_weights, their_experts = theirs.gate(x)
        weights, experts = moe.route(x, block.gate.weight, block.top_k, block.norm_topk_prob, block.grouped_routing())
        torch.testing.assert_close(block(x), theirs(x[None])[0], atol=1e-5, rtol=0)
    order, got_order = their_experts.sort(-1), experts.sort(-1)
    assert torch.equal(order.values, got_order.values)
    torch.testing.assert_close(weights.gather(1, got_order.indices), their_weights.gather(1, order.indices))


def test_v3_loads_past_its_prediction_layer(tmp_path):
    """DeepSeek V3's files hold a multi-token-prediction layer after the last one
    (num_nextn_predict_layers), which transformers does not load: neither does the loader."""
    from safetensors.torch import load_file, save_file

    build("deepseek_v3", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    layers = json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"]
    weights[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(4, 4)
    weights[f"model.layers.{layers}.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path, torch.float32, "cpu")
    assert len(model.model.layers) == layers


def test_parameter_names_are_transformers_but_for_its_stacked_experts():
    """The decoder holds transformers' parameters by name (transformers 5 stacks the routed
    experts in its modules; the files, and the decoder, hold one module each)."""
    for config_cls, model_cls, arch in ((tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, "DeepseekV3ForCausalLM"),
                                        (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, "DeepseekV2ForCausalLM")):
        for q_lora in (16, None):
            config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=16, moe_intermediate_size=8,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8,
                                q_lora_rank=q_lora, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=4,
                                n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                first_k_dense_replace=1, attention_bias=q_lora is not None, pad_token_id=0)
            with torch.device("meta"):
                theirs = {n for n, _ in model_cls(config).named_parameters()}
                theirs |= {n for n, _ in model_cls(config).named_buffers() if "e_score_correction_bias" in n}
                mine = {n for n, _ in DecoderLM(DecoderConfig.from_dict(
                    {**config.to_dict(), "architectures": [arch]})).named_parameters()}
            stacked = {n for n in theirs if ".mlp.experts." in n}
            assert mine - theirs == {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(4)
                                     for p in ("gate_proj", "up_proj", "down_proj")}, (arch, q_lora)
            assert theirs - mine == stacked, (arch, q_lora)


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_an_o_proj_adapter_against_peft_and_others_refused(reference, tmp_path):
    """Latent attention takes adapters on o_proj (its input the heads' values, the expansion's
    output): rows under the adapter and rows without it in one step. An adapter on the latent
    projections is refused by name."""
    from peft import LoraConfig, get_peft_model

    from executors.lora import LoraAdapterError, build_adapter, read_peft_dir
    from tests.models.test_lora import adapter_against_peft

    targets = adapter_against_peft("deepseek_v3", ["o_proj"], reference, tmp_path, TOKENS)
    other = get_peft_model(build("deepseek_v3", tmp_path / "base2"), LoraConfig(
        r=4, target_modules=["q_a_proj"], init_lora_weights=False))
    other.save_pretrained(tmp_path / "latent")
    config, tensors = read_peft_dir(tmp_path / "latent")
    with pytest.raises(LoraAdapterError, match="target module 'q_a_proj' is not one .* supported: o_proj"):
        build_adapter("b", "b@1", config, tensors, targets, dtype=torch.float32, device="cpu", max_rank=8,
                      source=str(tmp_path / "latent"))


@pytest.mark.parametrize("edit, refusal", [
    ({"attention_bias": True, "q_lora_rank": None}, "attention_bias: true with q_lora_rank: null"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    ({"kv_lora_rank": 30}, "must be a multiple of 8"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be an integer >= 1"),
])
def test_latent_settings_it_cannot_serve_are_refused(edit, refusal):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 2, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}
    with pytest.raises(UnsupportedModel, match=refusal):
        DecoderConfig.from_dict({**cfg, **edit})


def test_the_one_call_decode_step_says_why_it_stays_off(tmp_path):
    """Its decode steps run op by op: the one-call CPU step has no latent attention."""
    from executors.models import fused_decode

    build("deepseek_v2", tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu")
    assert model.fused_decode is None and fused_decode.unsupported(model) == "multi-head latent attention"


def test_a_moved_cache_of_latent_rows_continues_as_the_original(tmp_path):
    """ExportKv sends each row as K and as V (the wire format of every model); the receiver's
    pool of one half stores it once. The moved cache decodes as the original does."""
    import numpy as np

    from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput
    from service.config import ServeConfig
    from tests.conftest import start_server

    build("deepseek_v3", tmp_path)
    full = LogitsPolicy.full()
    running = [start_server(ServeConfig(port=0, executor="llm", model=str(tmp_path)), LlmExecutor(
        LlmExecutorConfig(model_dir=str(tmp_path), block_size=block, num_blocks=64))) for block in (4, 8)]
    clients = [ExecutorClient(r.address, timeout=60) for r in running]
    try:
        a, b = clients
        orig = a.prefill(PrefillInput(TOKENS, logits_policy=full)).kv_cache
        moved = b.import_kv(a.export_kv(orig, max_chunk_bytes=900), "moved").kv_cache
        for token in (5, 77, 200):
            do, dm = (c.decode(DecodeInput(token, h, logits_policy=full)) for c, h in ((a, orig), (b, moved)))
            np.testing.assert_allclose(do.logits.logits, dm.logits.logits, atol=1e-5, rtol=0)
            orig, moved = do.kv_cache, dm.kv_cache
    finally:
        for c in clients:
            c.close()
        for r in running:
            r.stop()
