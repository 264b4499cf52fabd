"""GPT-OSS's checkpoints as published: MXFP4 experts (a `_blocks` and a `_scales` tensor per
matrix) dequantized at load, as transformers dequantizes them.

test_families.py serves the tiny unquantized GPT-OSS against transformers over gRPC (its
sinks, biased router, stacked experts and clamped SwiGLU); here the MXFP4 files: the values,
a checkpoint of them served against transformers holding the same dequantized experts, its
digest and its tensor-parallel slices, and what is refused; PEFT adapters on the attention of
the models whose experts are stacked (GPT-OSS, Granite MoE).
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from executors.kv_transfer import digest_tensors
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.models import mxfp4
from executors.models.config import DecoderConfig, UnsupportedModel
from executors.models.loader import checkpoint_parameters, load_model
from executors.parallel.shard import ShardPlan
from executors.types import PrefillInput
from tests.models.tiny_models import build

TOKENS = [3, 17, 5, 99, 12, 7, 250, 31, 8, 64, 2, 45]
MATRICES = ("gate_up_proj", "down_proj")


def random_mxfp4(rows_shape: tuple[int, ...], cols: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of a [*rows_shape, cols] matrix: every nibble, scales around 2^-4..2^1."""
    blocks = torch.randint(0, 256, (*rows_shape, cols // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(123, 129, (*rows_shape, cols // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantizes_as_transformers_does(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=g)  # 2^-27 .. 2^22
    ours = mxfp4.dequantize(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 10]: x @ it
    assert ours.shape == (3, 10, 128) and ours.dtype == dtype
    assert torch.equal(ours.transpose(1, 2), theirs)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks, scales[..., :3])
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.dequantize(blocks.to(torch.int32), scales)


def quantized_checkpoint(root) -> tuple[object, np.ndarray]:
    """A tiny GPT-OSS whose experts' matrices are MXFP4 values, saved as the published files hold
    them (blocks, scales, quantization_config); the oracle holds them dequantized."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    oracle = build("gpt_oss", root)
    state = load_file(root / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for i, layer in enumerate(oracle.model.layers):
            experts = layer.mlp.experts
            for name in MATRICES:
                param = getattr(experts, name)  # [E, in, out]: x @ it
                blocks, scales = random_mxfp4((param.shape[0], param.shape[2]), param.shape[1], g)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                key = f"model.layers.{i}.mlp.experts.{name}"
                del state[key]
                state[key + mxfp4.BLOCKS], state[key + mxfp4.SCALES] = blocks, scales
        want = oracle(torch.tensor([TOKENS])).logits[0, -1].float().numpy()
    save_file(state, root / "model.safetensors")
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (root / "config.json").write_text(json.dumps(config))
    return oracle, want


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    oracle, want = quantized_checkpoint(root)
    return root, oracle, want


def test_an_mxfp4_checkpoint_serves_its_experts_as_transformers_dequantizes_them(quantized):
    root, _, want = quantized
    ex = LlmExecutor(LlmExecutorConfig(model_dir=str(root), block_size=4, num_blocks=32))
    try:
        got = asyncio.run(ex.prefill(PrefillInput(input_ids=TOKENS))).logits.logits.array
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        # The weights digest (what a tensor-parallel rank computes from the files) reads them alike.
        assert digest_tensors(checkpoint_parameters(root, torch.float32)) == ex._weights_digest()
    finally:
        ex.close()


def test_two_ranks_read_their_rows_of_the_dequantized_experts(quantized):
    root, oracle, _ = quantized
    whole = load_model(root, torch.float32, "cpu", cpu_kernels=False)  # the stacks as tensors, not panels
    inter = whole.config.moe.intermediate_size
    for rank in range(2):
        part = load_model(root, torch.float32, "cpu", shard=lambda c, r=rank: ShardPlan(c, r, 2), cpu_kernels=False)
        lo, hi = rank * inter // 2, (rank + 1) * inter // 2
        for mine, all_ in zip(part.model.layers, whole.model.layers):
            a, b = mine.mlp.experts, all_.mlp.experts
            rows = torch.cat([b.gate_up_proj[:, lo:hi], b.gate_up_proj[:, inter + lo:inter + hi]], dim=1)
            assert torch.equal(a.gate_up_proj, rows)
            assert torch.equal(a.down_proj, b.down_proj[:, :, lo:hi])
    # ... and the one process holds transformers' dequantized experts in its layout
    first = whole.model.layers[0].mlp.experts.gate_up_proj
    theirs = oracle.model.layers[0].mlp.experts.gate_up_proj.transpose(1, 2)  # interleaved gate, up rows
    assert torch.equal(first[:, :inter], theirs[:, 0::2]) and torch.equal(first[:, inter:], theirs[:, 1::2])


def test_half_an_mxfp4_pair_is_refused_by_name(tmp_path):
    _, _ = quantized_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.experts.down_proj" + mxfp4.SCALES]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModel, match=r"layers\.1\.mlp\.experts\.down_proj_blocks has no .*down_proj_scales"):
        load_model(tmp_path, torch.float32, "cpu")


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100}


@pytest.mark.parametrize("config,method", [(LLAMA, "awq"), (LLAMA, "mxfp4"), (GPT_OSS, "compressed-tensors"),
                                           (LLAMA, "bitsandbytes")])
def test_other_quantized_checkpoints_are_refused_by_their_method(config, method):
    with pytest.raises(UnsupportedModel, match=f"quant_method '{method}' is not supported"):
        DecoderConfig.from_dict({**config, "quantization_config": {"quant_method": method}})
    DecoderConfig.from_dict(config)  # unquantized: served


@pytest.mark.parametrize("edit,refusal", [
    ({"swiglu_limit": -1.0}, "swiglu_limit must be a positive number"),
    ({"swiglu_alpha": "1.7"}, "swiglu_alpha must be a positive number"),
    ({"num_experts_per_tok": 5, "num_local_experts": 4}, r"num_experts_per_tok must be between 1 and num_local_experts \(4\)"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must list num_hidden_layers"),
])
def test_gpt_oss_settings_it_cannot_serve_are_refused(edit, refusal):
    with pytest.raises(UnsupportedModel, match=refusal):
        DecoderConfig.from_dict({**GPT_OSS, **edit})


def test_gpt_oss_holds_transformers_parameter_names():
    """Its experts, router, sinks and biases under transformers' names (its files' for the
    unquantized checkpoints): what the loader, the digest and tensor parallelism go by."""
    import transformers as tf

    from executors.models.decoder import DecoderLM

    config = tf.GptOssConfig(**{k: v for k, v in GPT_OSS.items() if k != "architectures"}, num_local_experts=4,
                             pad_token_id=0)
    with torch.device("meta"):
        theirs = {n for n, _ in tf.GptOssForCausalLM(config).named_parameters()}
        mine = {n for n, _ in DecoderLM(DecoderConfig.from_dict({**config.to_dict(), **GPT_OSS})).named_parameters()}
    assert mine == theirs


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
@pytest.mark.parametrize("family", ["gpt_oss", "granitemoe"])
def test_an_attention_adapter_on_stacked_experts_models_against_peft(family, reference, tmp_path):
    """A mixture of experts takes adapters on attention: q/k/v/o, whose biases and sinks
    (GPT-OSS) or multipliers (Granite MoE: o_proj's delta scaled by the residual multiplier too)
    stay the base model's; rows under the adapter and rows without it in one step."""
    from tests.models.test_lora import adapter_against_peft

    adapter_against_peft(family, ["q_proj", "k_proj", "v_proj", "o_proj"], reference, tmp_path, TOKENS)
