"""config.json files shaped as the published checkpoints ship them, read into DecoderConfig.

No hub is reachable from the tests, so these are the keys and values that matter of
microsoft/Phi-3-mini-4k-instruct, microsoft/Phi-4-mini-instruct, google/gemma-2-2b-it,
ibm-granite/granite-3.1-2b-instruct, google/gemma-2b, HuggingFaceTB/SmolLM3-3B,
allenai/OLMo-2-1124-7B, allenai/Olmo-3-1025-7B LGAI-EXAONE/EXAONE-4.0-32B, THUDM/GLM-4-9B-0414,
CohereForAI/c4ai-command-r-v01, CohereForAI/c4ai-command-r-plus, CohereForAI/c4ai-command-r7b-12-2024 (with its keys transformers
does not read), stabilityai/stablelm-2-1_6b, bigcode/starcoder2-3b, allenai/OLMoE-1B-7B-0924, microsoft/phi-2, zai-org/GLM-4.5-Air, openai/gpt-oss-20b,
ibm-granite/granite-3.1-1b-a400m-instruct, deepseek-ai/DeepSeek-V3, deepseek-ai/DeepSeek-V2-Lite-Chat and Qwen/Qwen3-8B with the YaRN setting its
model card gives for 131072 tokens (transformers 4's
layout: top-level rope_theta, no layer_types; the LongRoPE factor lists stand in for the published
48 numbers: their count and place are what is read here). The tiny random models of the
other tests check the arithmetic against transformers; these check that the real files'
layouts (legacy keys, top-level rope fields, absent defaults) are read as transformers reads
them.
"""

from __future__ import annotations

import math

from executors.models.config import DecoderConfig

PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "vocab_size": 32064, "bos_token_id": 1,
    "eos_token_id": 32000, "pad_token_id": 32000, "torch_dtype": "bfloat16", "hidden_act": "silu",
}
PHI4_MINI = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "vocab_size": 200064,
    "lm_head_bias": False, "full_attn_mod": 1, "interpolate_factor": 1, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "longrope", "long_factor": [1 + i / 4 for i in range(48)], "short_factor": [1.0] * 48},
}
GEMMA_2B = {
    "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384,
    "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
    "hidden_act": "gelu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000.0, "vocab_size": 256000, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008,
    "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 65536,
    "max_window_layers": 28, "no_rope_layer_interval": 4, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
    "use_sliding_window": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "vocab_size": 128256, "bos_token_id": None, "eos_token_id": 128012, "pad_token_id": 128004,
    "pretraining_tp": 2, "torch_dtype": "bfloat16",
}
OLMO2_7B = {
    "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "attention_bias": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000,
    "tie_word_embeddings": False, "vocab_size": 100352, "eos_token_id": 100257, "pad_token_id": 100277,
    "hidden_act": "silu", "torch_dtype": "float32",
}
OLMO3_7B = {
    "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 65536,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(32)],
    "sliding_window": 4096, "attention_bias": False, "rms_norm_eps": 1e-06, "rope_theta": 500000,
    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1, "factor": 8.0,
                     "original_max_position_embeddings": 8192, "rope_type": "yarn"},
    "tie_word_embeddings": False, "vocab_size": 100278, "eos_token_id": 100257, "pad_token_id": 100277,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}
QWEN3_8B_YARN = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "attention_bias": False,
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None, "vocab_size": 151936,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "torch_dtype": "bfloat16",
}
EXAONE4_32B = {
    "architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "hidden_size": 5120, "intermediate_size": 27392,
    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "sliding_window": 4096, "sliding_window_pattern": "LLLG",
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(64)],
    "tie_word_embeddings": False, "vocab_size": 102400, "bos_token_id": 1, "eos_token_id": 361, "pad_token_id": 0,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}
GLM4_9B = {
    "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "hidden_size": 4096, "intermediate_size": 13696,
    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
    "max_position_embeddings": 32768, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "attention_bias": True, "tie_word_embeddings": False, "vocab_size": 151552, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "hidden_act": "silu", "torch_dtype": "bfloat16",
}
COMMAND_R = {
    "architectures": ["CohereForCausalLM"], "model_type": "cohere", "hidden_size": 8192, "intermediate_size": 22528,
    "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 64, "max_position_embeddings": 8192,
    "layer_norm_eps": 1e-05, "logit_scale": 0.0625, "rope_theta": 8000000.0, "attention_bias": False,
    "use_qk_norm": False, "vocab_size": 256000, "bos_token_id": 5, "eos_token_id": 255001, "pad_token_id": 0,
    "hidden_act": "silu", "torch_dtype": "float16",
}
COMMAND_R7B = {
    "architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192, "layer_norm_eps": 1e-05, "logit_scale": 0.25, "rope_theta": 50000,
    "rope_scaling": None, "sliding_window": 4096, "sliding_window_pattern": 4, "attention_bias": False,
    "order_of_interleaved_layers": "local_attn_first", "position_embedding_type": "rope_gptj", "rotary_pct": 1.0,
    "use_parallel_block": True, "use_gated_activation": True, "use_embedding_sharing": True, "vocab_size": 256000,
    "bos_token_id": 5, "eos_token_id": 255001, "pad_token_id": 0, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
STABLELM2_1_6B = {
    "architectures": ["StableLmForCausalLM"], "model_type": "stablelm", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "layer_norm_eps": 1e-05, "partial_rotary_factor": 0.25, "rope_theta": 10000, "rope_scaling": None,
    "use_qkv_bias": True, "tie_word_embeddings": False, "vocab_size": 100352, "bos_token_id": 100257,
    "eos_token_id": 100257, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
STARCODER2_3B = {
    "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "hidden_size": 3072,
    "intermediate_size": 12288, "num_hidden_layers": 30, "num_attention_heads": 24, "num_key_value_heads": 2,
    "max_position_embeddings": 16384, "norm_epsilon": 1e-05, "norm_type": "layer_norm", "mlp_type": "default",
    "rope_theta": 999999.4420358813, "sliding_window": 4096, "use_bias": True, "hidden_act": "gelu_pytorch_tanh",
    "attention_dropout": 0.1, "residual_dropout": 0.1, "embedding_dropout": 0.1, "vocab_size": 49152,
    "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16",
}
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 4096,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "attention_bias": False, "tie_word_embeddings": False,
    "vocab_size": 50304, "eos_token_id": 50279, "pad_token_id": 1, "hidden_act": "silu", "torch_dtype": "float32",
}
PHI_2 = {
    "architectures": ["PhiForCausalLM"], "model_type": "phi", "hidden_size": 2560, "intermediate_size": 10240,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
    "partial_rotary_factor": 0.4, "qk_layernorm": False, "layer_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "resid_pdrop": 0.1, "embd_pdrop": 0.0, "attention_dropout": 0.0, "hidden_act": "gelu_new",
    "tie_word_embeddings": False, "vocab_size": 51200, "bos_token_id": 50256, "eos_token_id": 50256,
    "torch_dtype": "float16",
}
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944,
    "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
    "moe_intermediate_size": 1408, "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "tie_word_embeddings": False, "vocab_size": 151552, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "hidden_act": "silu", "torch_dtype": "bfloat16",
}
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "vocab_size": 256000,
    "cache_implementation": "hybrid", "torch_dtype": "float32",
}
GRANITE_3_1_2B = {
    "architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rope_theta": 5000000.0, "rms_norm_eps": 1e-05, "attention_bias": False, "mlp_bias": False,
    "embedding_multiplier": 12.0, "attention_multiplier": 0.015625, "residual_multiplier": 0.22,
    "logits_scaling": 8.0, "tie_word_embeddings": True, "vocab_size": 49155, "torch_dtype": "bfloat16",
}


def test_phi3_mini_4k_slides_every_layer_over_2047_tokens():
    c = DecoderConfig.from_dict(PHI3_MINI_4K)
    assert c.family == "phi3" and c.fused_checkpoint and c.head_dim == 96
    assert c.layer_windows == (2047,) * 32 and c.all_layers_sliding
    assert c.rope_scaling is None and c.rotary_dim is None
    assert (c.rms_norm_eps, c.eos_token_ids) == (1e-5, (32000,))


def test_phi4_mini_rotates_96_of_128_with_longrope_and_no_window():
    c = DecoderConfig.from_dict(PHI4_MINI)
    assert c.head_dim == 128 and c.rotary_dim == 96
    s = c.rope_scaling
    assert s.kind == "longrope" and s.original_max_position_embeddings == 4096  # from the top level
    assert len(s.short_factor) == len(s.long_factor) == 48
    # No factor in the file: the ratio of the contexts, 131072 / 4096 = 32.
    assert s.attention_factor == math.sqrt(1 + math.log(32) / math.log(4096))
    assert c.layer_windows == ()  # 262144 >= 131072: the window hides nothing
    assert c.tie_word_embeddings


def test_gemma2_2b_alternates_windows_and_caps_both():
    c = DecoderConfig.from_dict(GEMMA2_2B)
    assert c.family == "gemma2" and not c.qk_norm and c.head_dim == 256
    assert c.layer_windows == tuple(4096 if i % 2 == 0 else None for i in range(26))
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0)
    assert c.attn_scale == 256 ** -0.5 and c.embed_scale == 2304 ** 0.5 and c.norm_offset == 1.0
    assert c.hidden_act == "gelu_tanh" and c.sandwich_norms and c.tie_word_embeddings
    assert c.local_rope_theta is None and c.rope_theta == 10000.0


def test_granite_3_1_reads_its_four_multipliers():
    c = DecoderConfig.from_dict(GRANITE_3_1_2B)
    assert (c.embed_scale, c.attn_scale, c.residual_scale, c.logits_divisor) == (12.0, 0.015625, 0.22, 8.0)
    assert c.rope_theta == 5e6 and c.num_kv_heads == 8 and c.tie_word_embeddings
    assert not c.qkv_bias and not c.o_bias and not c.mlp_bias


def test_gemma_2b_is_gemma_without_gemma_2s_extras():
    c = DecoderConfig.from_dict(GEMMA_2B)
    assert c.family == "gemma" and c.hidden_act == "gelu_tanh"  # the legacy "gelu", as GemmaConfig reads it
    assert c.norm_offset == 1.0 and c.embed_scale == 2048 ** 0.5 and c.tie_word_embeddings
    assert not c.sandwich_norms and c.attn_scale is None and c.final_softcap is None and c.attn_softcap is None
    assert c.layer_windows == () and (c.num_kv_heads, c.head_dim) == (1, 256)


def test_smollm3_3b_has_every_fourth_layer_nope_and_no_window():
    c = DecoderConfig.from_dict(SMOLLM3_3B)
    assert c.nope_layers == tuple(range(3, 36, 4)) and len(c.nope_layers) == 9
    assert c.layer_windows == () and c.rope_theta == 5e6 and c.tie_word_embeddings
    assert not c.qkv_bias and not c.o_bias and not c.mlp_bias and c.eos_token_ids == (128012,)


def test_olmo2_7b_norms_outputs_only_and_q_k_across_heads():
    c = DecoderConfig.from_dict(OLMO2_7B)
    assert c.family == "olmo2" and not c.pre_norms and c.sandwich_norms and c.qk_norm and c.qk_norm_across_heads
    assert c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-6 and not c.tie_word_embeddings
    assert c.attn_scale is None and c.norm_offset == 0.0 and c.final_softcap is None and c.layer_windows == ()


def test_olmo3_7b_slides_three_layers_of_four_with_yarn_on_the_fourth():
    c = DecoderConfig.from_dict(OLMO3_7B)
    assert c.layer_windows == tuple(None if (i + 1) % 4 == 0 else 4096 for i in range(32))
    s = c.rope_scaling
    assert (s.kind, s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow) == ("yarn", 8.0, 8192,
                                                                                                 32.0, 1.0)
    assert s.attention_factor == 1.2079441541679836 and c.rope_theta == 500000.0 and c.local_rope_theta == 500000.0
    assert not c.pre_norms and c.qk_norm_across_heads and c.max_position_embeddings == 65536


def test_qwen3_8b_with_its_model_cards_yarn():
    c = DecoderConfig.from_dict(QWEN3_8B_YARN)
    s = c.rope_scaling
    assert (s.kind, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    assert s.attention_factor == 0.1 * math.log(4.0) + 1 and (s.beta_fast, s.beta_slow, s.truncate) == (32.0, 1.0, True)
    assert c.rope_theta == 1e6 and c.qk_norm and not c.qk_norm_across_heads and c.layer_windows == ()
    assert c.max_position_embeddings == 131072  # 4 x 32768: the context YaRN is set for, past the file's 40960


def test_exaone4_32b_global_layers_are_nope_and_its_string_pattern_unread():
    c = DecoderConfig.from_dict(EXAONE4_32B)
    assert c.nope_layers == tuple(range(3, 64, 4))
    assert c.layer_windows == tuple(None if (i + 1) % 4 == 0 else 4096 for i in range(64))
    assert (c.rope_scaling.kind, c.rope_scaling.factor) == ("llama3", 16.0) and c.rope_theta == 1e6
    assert not c.pre_norms and c.sandwich_norms and c.qk_norm and not c.qk_norm_across_heads


def test_glm4_9b_rotates_half_of_each_head_in_neighbouring_pairs():
    c = DecoderConfig.from_dict(GLM4_9B)
    assert (c.rotary_dim, c.head_dim, c.rope_interleaved, c.fused_checkpoint) == (64, 128, True, ("gate_up_proj",))
    assert c.qkv_bias and not c.o_bias and c.sandwich_norms and c.pre_norms and not c.qk_norm
    assert c.eos_token_ids == (151329, 151336, 151338) and c.rms_norm_eps == 1e-5


def test_command_r_norms_by_layernorm_and_runs_attention_and_the_mlp_in_parallel():
    c = DecoderConfig.from_dict(COMMAND_R)
    assert c.layer_norm and not c.norm_bias and c.parallel_residual and c.rope_interleaved and c.tie_word_embeddings
    assert c.logits_divisor == 16.0 and c.rope_theta == 8e6 and c.rms_norm_eps == 1e-5
    assert not c.qkv_bias and not c.o_bias and c.layer_windows == () and c.nope_layers == ()


def test_command_r7b_slides_three_layers_of_four_and_leaves_the_fourth_unrotated():
    c = DecoderConfig.from_dict(COMMAND_R7B)
    assert c.layer_windows == tuple(None if (i + 1) % 4 == 0 else 4096 for i in range(32))
    assert c.nope_layers == tuple(range(3, 32, 4))
    assert c.layer_norm and c.parallel_residual and c.logits_divisor == 4.0 and c.rope_theta == 50000.0


def test_stablelm2_1_6b_rotates_a_quarter_of_each_head_under_layernorms_with_biases():
    c = DecoderConfig.from_dict(STABLELM2_1_6B)
    assert (c.rotary_dim, c.head_dim, c.rope_interleaved) == (16, 64, False)
    assert c.layer_norm and c.norm_bias and not c.parallel_residual and c.qkv_bias and not c.o_bias
    assert not c.tie_word_embeddings and c.eos_token_ids == (100257,)


def test_starcoder2_3b_has_an_ungated_mlp_biases_everywhere_and_a_window_on_every_layer():
    c = DecoderConfig.from_dict(STARCODER2_3B)
    assert not c.mlp_gated and c.hidden_act == "gelu_tanh" and c.qkv_bias and c.o_bias and c.mlp_bias
    assert c.layer_norm and c.norm_bias and not c.parallel_residual and c.tie_word_embeddings
    assert c.layer_windows == (4096,) * 30 and c.rope_theta == 999999.4420358813 and c.max_position_embeddings == 16384


def test_olmoe_1b_7b_routes_every_layer_to_8_of_64_experts_under_olmos_qk_norms():
    c = DecoderConfig.from_dict(OLMOE_1B_7B)
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (64, 8, 1024, False)
    assert moe.sparse_layers == (True,) * 16 and moe.shared_intermediate_size == 0 and moe.style == "qwen"
    assert c.qk_norm and c.qk_norm_across_heads and c.pre_norms and not c.sandwich_norms


def test_phi_2_rotates_32_of_80_dimensions_and_biases_its_lm_head():
    c = DecoderConfig.from_dict(PHI_2)
    assert (c.rotary_dim, c.head_dim) == (32, 80) and c.hidden_act == "gelu_tanh"
    assert c.layer_norm and c.norm_bias and c.parallel_residual and not c.mlp_gated and c.lm_head_bias
    assert c.qkv_bias and c.o_bias and c.mlp_bias and not c.tie_word_embeddings


def test_glm45_air_routes_by_sigmoid_scores_beside_a_shared_expert_after_one_dense_layer():
    c = DecoderConfig.from_dict(GLM45_AIR)
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (128, 8, 1408, 1408)
    assert (moe.scoring, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == ("sigmoid", 1, 1, 1.0)
    assert moe.sparse_layers == (False,) + (True,) * 45 and not moe.shared_gated and moe.norm_topk_prob
    assert (c.rotary_dim, c.head_dim, c.rope_interleaved, c.qk_norm) == (64, 128, False, False)
    assert c.qkv_bias and not c.o_bias and c.intermediate_size == 10944 and c.rope_theta == 1e6


GEMMA3_4B_IT = {  # the whole file but the vision_config, whose keys the text model does not read
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
    "mm_tokens_per_image": 256, "torch_dtype": "bfloat16", "vision_config": {"model_type": "siglip_vision_model"},
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
}


def test_gemma3_4b_it_serves_its_text_model_with_gemma3_text_configs_defaults():
    """Its text_config lists six keys: the rest are Gemma3TextConfig's (8 heads of 256 over 4 KV
    heads, a 262208-token vocabulary, five sliding layers of every six, the 1e6 and 1e4 bases)."""
    c = DecoderConfig.from_dict(GEMMA3_4B_IT)
    assert c.architecture == "Gemma3ForConditionalGeneration" and c.family == "gemma3" and c.multimodal
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        2560, 34, 8, 4, 256, 262208)
    assert c.layer_windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling.kind, c.rope_scaling.factor) == (1e6, 1e4, "linear", 8.0)
    assert c.tie_word_embeddings and c.eos_token_ids == (1, 106) and c.dtype == "bfloat16"


MINIMAX_M2 = {  # the keys that matter, and those of its own transformers does not read
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": 3072,
    "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "rotary_dim": 64, "max_position_embeddings": 196608, "num_local_experts": 256,
    "num_experts_per_tok": 8, "rms_norm_eps": 1e-06, "rope_theta": 5000000, "scoring_func": "sigmoid",
    "use_qk_norm": True, "qk_norm_type": "per_layer", "use_routing_bias": True, "tie_word_embeddings": False,
    "vocab_size": 200064, "bos_token_id": 200034, "eos_token_id": 200020, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def test_minimax_m2_rotates_64_of_128_and_routes_by_corrected_sigmoid_scores():
    c = DecoderConfig.from_dict(MINIMAX_M2)
    moe = c.moe
    assert (c.rotary_dim, c.head_dim, c.qk_norm, c.qk_norm_across_heads) == (64, 128, True, True)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.scoring) == (256, 8, 1536, "sigmoid")
    assert moe.correction_on_block and moe.norm_topk_prob and moe.n_group == 1 and moe.routed_scaling_factor == 1.0
    assert moe.sparse_layers == (True,) * 62 and moe.style == "mixtral" and c.rope_theta == 5e6


COMMAND_R_PLUS = {**COMMAND_R, "hidden_size": 12288, "intermediate_size": 33792, "num_hidden_layers": 64,
                  "num_attention_heads": 96, "num_key_value_heads": 8, "logit_scale": 0.8333333333333334,
                  "rope_theta": 75000000.0, "use_qk_norm": True}


def test_command_r_plus_norms_q_and_k_by_layernorms_with_a_weight_row_per_head():
    c = DecoderConfig.from_dict(COMMAND_R_PLUS)
    assert c.qk_norm and c.layer_norm and not c.qk_norm_across_heads and c.parallel_residual
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (96, 8, 128, 7.5e7)
    assert abs(c.logits_divisor - 1.2) < 1e-12


QWEN25_VL_7B = {  # transformers 4's flat layout: the text model's keys at the top level, a legacy mrope rope_scaling
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 128000, "max_window_layers": 28, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 152064,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "bos_token_id": 151643,
    "eos_token_id": 151645, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584},
}
QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "tie_word_embeddings": False,
    "image_token_id": 151655, "vision_config": {"depth": 27, "hidden_size": 1152},
    "text_config": {"attention_bias": False, "bos_token_id": 151643, "dtype": "bfloat16", "eos_token_id": 151645,
                    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
                    "max_position_embeddings": 262144, "model_type": "qwen3_vl_text", "num_attention_heads": 32,
                    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "vocab_size": 151936},
}


def test_qwen2_5_vl_7b_flat_config_serves_its_text_model_with_1d_rotation():
    c = DecoderConfig.from_dict(QWEN25_VL_7B)
    assert c.architecture == "Qwen2_5_VLForConditionalGeneration" and c.family == "qwen2" and c.multimodal
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (3584, 28, 28, 4, 128)
    assert c.rope_scaling is None and c.rope_theta == 1e6 and c.layer_windows == () and c.qkv_bias
    assert c.eos_token_ids == (151645,) and not c.tie_word_embeddings and c.max_position_embeddings == 128000


def test_qwen3_vl_8b_serves_its_text_model_with_qk_norms_and_1d_rotation():
    c = DecoderConfig.from_dict(QWEN3_VL_8B)
    assert c.family == "qwen3" and c.qk_norm and c.rope_scaling is None and c.rope_theta == 5e6
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (4096, 36, 32, 8, 151936)


GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


def test_gpt_oss_20b_alternates_128_token_windows_with_sinks_and_routes_to_4_of_32_mxfp4_experts():
    c = DecoderConfig.from_dict(GPT_OSS_20B)
    assert c.attention_sinks and c.qkv_bias and c.o_bias and not c.tie_word_embeddings
    assert c.layer_windows == (128, None) * 12 and c.nope_layers == ()
    assert (c.head_dim, c.num_heads, c.num_kv_heads, c.rope_theta, c.max_position_embeddings) == (64, 64, 8, 1.5e5,
                                                                                                  131072)
    r = c.rope_scaling
    assert (r.kind, r.factor, r.original_max_position_embeddings, r.truncate) == ("yarn", 32.0, 4096, False)
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (32, 4, 2880, True)
    assert moe.stacked and moe.router_name == "router" and (moe.swiglu_limit, moe.swiglu_alpha) == (7.0, 1.702)
    assert moe.sparse_layers == (True,) * 24 and c.eos_token_ids == (200002,)


GRANITE_31_1B_A400M = {
    "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", "attention_bias": False,
    "attention_dropout": 0.1, "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0,
    "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 512,
    "logits_scaling": 6.0, "max_position_embeddings": 131072, "num_attention_heads": 16, "num_experts_per_tok": 8,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 0, "residual_multiplier": 0.22, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000.0, "router_aux_loss_coef": 0.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 49155,
}


def test_granite_3_1_1b_a400m_routes_to_8_of_32_stacked_experts_under_granites_multipliers():
    c = DecoderConfig.from_dict(GRANITE_31_1B_A400M)
    assert (c.embed_scale, c.attn_scale, c.residual_scale, c.logits_divisor) == (12.0, 0.015625, 0.22, 6.0)
    assert c.tie_word_embeddings and not c.qkv_bias and not c.o_bias and c.rope_theta == 1e7
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (32, 8, 512, True)
    assert moe.stacked and not moe.biased and moe.module_name == "block_sparse_moe" and moe.router_name == "router"
    assert moe.shared_intermediate_size == 0 and moe.sparse_layers == (True,) * 24


DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_deepseek_v3_caches_576_numbers_a_token_a_layer_and_reads_its_fp8_blocks():
    c = DecoderConfig.from_dict(DEEPSEEK_V3)
    m = c.mla
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (128, 1, 576)  # the pool's one latent row
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (1536, 512, 128,
                                                                                                      64, 128)
    assert m.interleaved and c.fp8_block == (128, 128) and not c.qkv_bias and not c.o_bias
    assert math.isclose(c.attn_scale, 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    r = c.rope_scaling
    assert (r.kind, r.factor, r.original_max_position_embeddings, r.attention_factor) == ("yarn", 40.0, 4096, 1.0)
    assert c.max_position_embeddings == 163840 and c.rope_view().head_dim == 64
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (256, 8, 8, 4, 2.5)
    assert moe.scoring == "sigmoid" and moe.norm_topk_prob and moe.shared_intermediate_size == 2048
    assert moe.sparse_layers == (False,) * 3 + (True,) * 58 and c.eos_token_ids == (1,)


DEEPSEEK_V2_LITE_CHAT = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                            "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


def test_deepseek_v2_lite_takes_queries_from_q_proj_and_routes_greedily_to_6_of_64_experts():
    c = DecoderConfig.from_dict(DEEPSEEK_V2_LITE_CHAT)
    assert c.mla.q_lora_rank is None and c.head_dim == 576 and c.fp8_block is None
    assert math.isclose(c.attn_scale, 192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.routed_scaling_factor) == (64, 6, 1, 1.0)
    assert moe.scoring == "softmax" and not moe.norm_topk_prob and not moe.grouped
    assert moe.shared_intermediate_size == 2 * 1408 and moe.sparse_layers == (False,) + (True,) * 26
