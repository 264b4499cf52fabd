"""config.json variants read as transformers 5 reads them, or refused by name.

Each case saves a tiny random model with transformers, rewrites its config.json, reloads the
transformers model from that same file (the oracle) and loads it in LlmExecutor: the logits of
a whole sequence must agree within 1e-4 (fp32), or the load must fail with UnsupportedModel
naming the problem. The per-family defaults table (executors/models/family_defaults.py) is
checked against transformers' config classes and modeling code.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from executors.models.checkpoint_sections import RENAMED
from executors.models.config import DecoderConfig
from executors.models.errors import UnsupportedModel
from executors.models.family_defaults import FAMILY_DEFAULTS
from executors.models.moe_config import MOE_FAMILIES

tf = pytest.importorskip("transformers")

VOCAB, TOL = 320, 1e-4
DEL = object()  # in an edit: remove the key
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
PHI3 = {**COMMON, "pad_token_id": 0}  # Phi3Config's (and Glm4Config's) default pad id is outside the tiny vocabulary
SMOLLM3 = {**COMMON, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # the same (128004, ...)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "rope_theta": 1e4,
            "original_max_position_embeddings": 256}
GEMMA = {**COMMON, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
         "layer_types": ["sliding_attention", "full_attention"]}
# Small caps, so that capping changes the tiny model's scores and logits.
GEMMA2 = {**GEMMA, "attn_logit_softcapping": 0.05, "final_logit_softcapping": 2.0}
# transformers 4's Gemma 3 layout, as google/gemma-3-* ship it.
GEMMA_LEGACY = {"rope_parameters": DEL, "layer_types": DEL, "sliding_window_pattern": 2,
                "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32, "rope_theta": 50000.0}
L3_TYPE_KEY = {("type" if k == "rope_type" else k): v for k, v in L3.items()}
L3_NO_ORIGINAL_MAX = {k: v for k, v in L3.items() if k != "original_max_position_embeddings"}
GEMMA_PER_TYPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
QWEN3_MOE = {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MINIMAX_M2 = {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}
GPT_OSS = {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}
# DeepSeek: every head its own KV head for transformers (it repeats the expanded keys by the ratio).
DSV3 = {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 12, "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
DSV2 = {**DSV3, "q_lora_rank": None, "num_experts_per_tok": 3}
GLM4_MOE = {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "use_qk_norm": True, "attention_bias": True}

# name: (family, config class kwargs, config.json edits, tokens, None or the refusal's text)
CASES = {
    # 1. The legacy "type" key inside rope_parameters.
    "type_key_linear": (
        "llama", {}, {"rope_parameters": {"type": "linear", "factor": 4.0, "rope_theta": 1e4}}, 40, None),
    "type_key_llama3": ("llama", {}, {"rope_parameters": L3_TYPE_KEY}, 40, None),
    "type_key_yarn": (
        "llama", {}, {"rope_parameters": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                          "rope_theta": 1e4}}, 40, None),
    "type_key_dynamic": ("llama", {}, {"rope_parameters": {"type": "dynamic", "factor": 4.0}}, 40, "'dynamic'"),
    # 2. A top-level original_max_position_embeddings wins over the nested one; neither means
    # max_position_embeddings.
    "llama3_toplevel_original_max": (
        "llama", {}, {"rope_parameters": L3, "original_max_position_embeddings": 256}, 40, None),
    "llama3_no_original_max": ("llama", {}, {"rope_parameters": L3_NO_ORIGINAL_MAX}, 40, None),
    # 3. rope_scaling beside rope_parameters is the whole rope config, its base from it or from
    # the top-level rope_theta; on Gemma 3 it is merged over full_attention.
    "rope_scaling_beside_rope_parameters": (
        "llama", {}, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
                      "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 1e4}, 40, None),
    "gemma3_rope_scaling_over_full_attention": (
        "gemma3", {"rope_parameters": GEMMA_PER_TYPE}, {"rope_scaling": {"factor": 4.0}}, 40, None),
    # There transformers keeps rope_type "default" and drops a "type" scaling: refused.
    "gemma3_rope_scaling_type_key": (
        "gemma3", {}, {**GEMMA_LEGACY, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 8.0}},
        40, "legacy type 'linear'"),
    # transformers ignores rope parameters per layer type on Llama.
    "llama_rope_per_layer_type": (
        "llama", {}, {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
        40, "per layer type"),
    # 4. Keys left out take each family's transformers defaults.
    "mixtral_no_theta_no_eps": (
        "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5},
        {"rope_parameters": {"rope_type": "default"}, "rms_norm_eps": DEL}, 40, None),
    "mistral_no_sliding_window": (  # 4096 by default: the sequence must pass it
        "mistral", {"num_hidden_layers": 1, "max_position_embeddings": 4200, "sliding_window": 8},
        {"sliding_window": DEL}, 4200, None),
    "gemma3_legacy_no_theta_scalar_tie": (
        "gemma3", {}, {**GEMMA_LEGACY, "query_pre_attn_scalar": DEL, "tie_word_embeddings": DEL}, 40, None),
    # 5. The activation from the family's own key only.
    "llama_hidden_activation_ignored": ("llama", {"hidden_act": "gelu"}, {"hidden_activation": "silu"}, 20, "'gelu'"),
    "llama_hidden_activation_ignored_silu": ("llama", {}, {"hidden_activation": "gelu"}, 20, None),
    "gemma3_hidden_act_ignored": ("gemma3", {}, {"hidden_act": "silu", "hidden_activation": DEL}, 20, None),
    # 6. A flat rope_parameters on Gemma 3 (transformers ignores it): refused.
    "gemma3_flat_rope_parameters": (
        "gemma3", {}, {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
        40, "per layer type"),
    # 7. Biases where each family's modeling code puts them (Qwen3: on o_proj too).
    "qwen3_attention_bias": ("qwen3", {"head_dim": 16, "attention_bias": True}, {}, 20, None),
    "qwen3_moe_attention_bias": ("qwen3_moe", {**QWEN3_MOE, "attention_bias": True}, {}, 20, None),
    "mistral_attention_bias_ignored": (
        "mistral", {"sliding_window": None}, {"attention_bias": True, "mlp_bias": True}, 20, None),
    # 8. Phi-3: fused qkv_proj and gate_up_proj (cut by the loader), a window over every layer,
    # its own defaults, partial rotary (Phi-4-mini: 0.75; q and k reordered by the loader),
    # LongRoPE (and its older names su and yarn) within the original context, where it is
    # the short factors throughout (tests/models/test_longrope.py goes past it).
    "phi3": ("phi3", {}, {}, 40, None),
    "phi3_sliding_window_no_eps": ("phi3", {"sliding_window": 8, "rms_norm_eps": 1e-5}, {"rms_norm_eps": DEL}, 40, None),
    "phi3_gqa_head_dim": ("phi3", {"num_key_value_heads": 1, "head_dim": 8}, {}, 40, None),
    "phi3_longrope": ("phi3", {}, {"rope_parameters": LONGROPE, "original_max_position_embeddings": 256}, 40, None),
    "phi3_su": ("phi3", {}, {"rope_scaling": {**LONGROPE, "rope_type": "su"}}, 40, None),
    "phi3_partial_rotary": ("phi3", {}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.75}}, 40, None),
    "phi3_partial_rotary_top_level": ("phi3", {}, {"rope_parameters": DEL, "partial_rotary_factor": 0.5}, 40, None),
    "phi3_partial_longrope": (
        "phi3", {}, {"rope_parameters": {**LONGROPE, "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 3.0, 4.0],
                                         "partial_rotary_factor": 0.375, "attention_factor": 1.3}}, 40, None),
    "phi3_partial_rotary_rounded_down": ("phi3", {}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                          "partial_rotary_factor": 0.3}}, 40, None),
    "llama_longrope": ("llama", {}, {"rope_parameters": {**LONGROPE, "factor": 4.0}}, 40, None),
    # 9. Gemma 2: soft-capped scores; its defaults (caps 50 and 30, every other layer
    # sliding from the first) where the file leaves them out; a null cap is none.
    "gemma2": ("gemma2", {}, {}, 40, None),
    "gemma2_defaults": ("gemma2", {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
                        {"attn_logit_softcapping": DEL, "final_logit_softcapping": DEL, "layer_types": DEL}, 40, None),
    "gemma2_no_caps": ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None}, {}, 40, None),
    # A sliding_window_pattern is Gemma 3's key: Gemma2Config ignores it.
    "gemma2_pattern_ignored": ("gemma2", {}, {"sliding_window_pattern": 3, "layer_types": DEL}, 40, None),
    # 10. Granite: each multiplier read (and 1.0 where the file leaves it out).
    "granite": ("granite", {"embedding_multiplier": 2.0, "attention_multiplier": 0.3, "residual_multiplier": 0.6,
                            "logits_scaling": 4.0, "mlp_bias": True}, {}, 40, None),
    "granite_no_multipliers": ("granite", {"embedding_multiplier": 2.0, "residual_multiplier": 0.6},
                               {"embedding_multiplier": DEL, "residual_multiplier": DEL, "logits_scaling": DEL}, 40, None),
    # 14. YaRN (Qwen's and OLMo 3's long contexts): the ramp between beta_fast and beta_slow
    # turns over the original context (4096 here, so that the ramp lies inside the 8
    # frequencies), the attention factor from the factor (or DeepSeek's mscale ratio), the
    # factor from the contexts where null (512 / 64), truncate off.
    "qwen3_yarn": ("qwen3", {"head_dim": 16}, {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1e4}}, 40, None),
    "llama_yarn_mscale_betas_untruncated": ("llama", {}, {"rope_parameters": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "rope_theta": 1e4,
        "mscale": 0.8, "mscale_all_dim": 0.6, "beta_fast": 16, "beta_slow": 2, "truncate": False}}, 40, None),
    "mistral_yarn_null_factor_attention_factor": ("mistral", {"sliding_window": None}, {
        "rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64,
                         "attention_factor": 1.3}, "rope_theta": 5e4}, 40, None),
    "granite_negative_multiplier": ("granite", {}, {"residual_multiplier": -0.5}, 20, "residual_multiplier must be"),
    # 11. Gemma (1): the official files' legacy hidden_act "gelu" is GELU-tanh to GemmaConfig.
    "gemma": ("gemma", {"head_dim": 16}, {}, 40, None),
    "gemma_legacy_gelu": ("gemma", {"head_dim": 16}, {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"},
                          40, None),
    "gemma_silu": ("gemma", {"head_dim": 16}, {"hidden_act": "silu"}, 20, "activation 'silu'"),
    # 12. SmolLM3: NoPE layers from no_rope_layers, or every no_rope_layer_interval-th layer
    # (4 by default) without it; with use_sliding_window the NoPE layers slide unless
    # layer_types says otherwise; the default rope base 2e6.
    "smollm3_default_interval_and_theta": (
        "smollm3", {"num_hidden_layers": 4}, {"no_rope_layers": DEL, "rope_parameters": DEL}, 40, None),
    "smollm3_interval": ("smollm3", {"num_hidden_layers": 4, "no_rope_layer_interval": 2},
                         {"no_rope_layers": DEL, "layer_types": DEL}, 40, None),
    "smollm3_nope_layers_slide": (
        "smollm3", {"num_hidden_layers": 4, "no_rope_layers": [1, 0, 0, 1], "use_sliding_window": True,
                    "sliding_window": 8}, {"layer_types": DEL}, 40, None),
    # 13. OLMo 2: its defaults (eps 1e-5, rope base 1e4), biases on attention and o_proj.
    "olmo2_defaults": ("olmo2", {"rms_norm_eps": 1e-5}, {"rms_norm_eps": DEL, "rope_parameters": DEL}, 40, None),
    "olmo2_attention_bias_gqa": ("olmo2", {"attention_bias": True, "num_key_value_heads": 1}, {}, 40, None),
    # 15. OLMo 3: transformers 4's layout (top-level rope_theta, a yarn rope_scaling, no
    # layer_types: three of four layers slide), where Olmo3Config gives the file's rope_theta
    # to the global layers only and the sliding ones its default 5e5; per layer type.
    "olmo3_legacy_layout": ("olmo3", {"num_hidden_layers": 4, "sliding_window": 8}, {
        "rope_parameters": DEL, "layer_types": DEL, "rope_theta": 1e4,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                         "beta_fast": 16}}, 40, None),
    "olmo3_per_layer_type": ("olmo3", {"num_hidden_layers": 4, "sliding_window": 8, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 2e3}}}, {}, 40, None),
    "olmo3_flat_rope_parameters": ("olmo3", {"num_hidden_layers": 4}, {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 20, "OLMo 3 rope_parameters must be per"),
    # 16. EXAONE 4: every sliding_window_pattern-th layer global and NoPE (4 by default, 3 here);
    # without a window every layer global and rotating (layer_types as the file lists them).
    "exaone4_pattern": ("exaone4", {"num_hidden_layers": 6, "sliding_window": 8, "sliding_window_pattern": 3},
                        {"layer_types": DEL}, 40, None),
    "exaone4_no_window": ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 2}, {}, 40,
                          None),
    # 17. GLM-4: half of each head rotating in neighbouring pairs by default (Glm4Config's
    # 0.5 where neither rope_parameters nor the top level says), all of it, or three quarters.
    "glm4_default_half": ("glm4", {"head_dim": 16}, {"rope_parameters": DEL, "partial_rotary_factor": DEL,
                                                     "rope_theta": 1e4}, 40, None),
    "glm4_whole_head": ("glm4", {"head_dim": 16, "partial_rotary_factor": 1.0}, {}, 40, None),
    "glm4_three_quarters_no_bias": ("glm4", {"head_dim": 16, "partial_rotary_factor": 0.75, "attention_bias": False},
                                    {}, 40, None),
    # 18. Ministral: without layer_types every layer slides (transformers' Ministral fails without a window).
    "ministral_every_layer_slides": ("ministral", {"head_dim": 16, "sliding_window": 8}, {"layer_types": DEL}, 40,
                                     None),
    # 19. Helium: every dimension rotating in neighbouring pairs; Seed-OSS: o_proj's bias by
    # attention_out_bias, q/k/v's by attention_bias (on by default).
    "helium": ("helium", {"head_dim": 16, "attention_bias": True}, {}, 40, None),
    "seed_oss_out_bias": ("seed_oss", {"head_dim": 16, "attention_out_bias": True}, {"attention_bias": DEL}, 40, None),
    "seed_oss_no_biases": ("seed_oss", {"head_dim": 16, "attention_bias": False}, {}, 40, None),
    "smollm3_longer_no_rope_layers": ("smollm3", {"num_hidden_layers": 3}, {"no_rope_layers": [0, 1, 0, 0, 0]},
                                      40, None),
    # 20. Cohere: its defaults (LayerNorm eps 1e-5, logits times 0.0625, rope base 5e5); Command
    # R+'s q/k LayerNorms with a weight row per head. Cohere 2: every sliding_window_pattern-th layer
    # global and NoPE without layer_types. StableLM: a quarter of each head rotating by default
    # (or the top-level factor of older files), biases on its LayerNorms, attention and the MLP
    # in parallel by use_parallel_residual; its per-head q/k LayerNorms refused.
    "cohere_defaults": ("cohere", {}, {"layer_norm_eps": DEL, "logit_scale": DEL, "rope_parameters": DEL}, 40, None),
    "cohere_qk_norm": ("cohere", {"use_qk_norm": True, "attention_bias": True}, {}, 40, None),
    "cohere2_pattern": ("cohere2", {"num_hidden_layers": 4, "sliding_window": 8},
                        {"layer_types": DEL, "sliding_window_pattern": 2}, 40, None),
    "stablelm_defaults": ("stablelm", {}, {"rope_parameters": DEL, "layer_norm_eps": DEL}, 40, None),
    "stablelm_top_level_half_rotary": ("stablelm", {"use_qkv_bias": True}, {
        "rope_parameters": DEL, "partial_rotary_factor": 0.5, "rope_theta": 3e3}, 40, None),
    "stablelm_parallel": ("stablelm", {"use_parallel_residual": True}, {}, 40, None),
    "stablelm_qk_layernorm": ("stablelm", {"qk_layernorm": True}, {}, 20, "qk_layernorm: true"),
    # 21. StarCoder2: its defaults (biases everywhere, LayerNorm eps 1e-5, no window), without
    # biases, with a window over every layer; an activation other than GELU-tanh refused.
    "starcoder2_defaults": ("starcoder2", {}, {"use_bias": DEL, "norm_epsilon": DEL, "sliding_window": DEL,
                                               "rope_parameters": DEL}, 40, None),
    "starcoder2_no_bias_window": ("starcoder2", {"use_bias": False, "sliding_window": 8}, {}, 40, None),
    "starcoder2_gelu": ("starcoder2", {}, {"hidden_act": "gelu"}, 20, "activation 'gelu'"),
    # 22. OLMoE: its defaults (weights not renormalised, eps 1e-5), renormalised; clip_qkv refused.
    "olmoe_defaults": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
                       {"norm_topk_prob": DEL, "rms_norm_eps": DEL, "rope_parameters": DEL}, 40, None),
    "olmoe_renormalised": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 3, "intermediate_size": 32,
                                     "norm_topk_prob": True}, {}, 40, None),
    "olmoe_clip_qkv": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0}, {}, 20,
                       "clip_qkv: 8.0"),
    # 23. Phi: half of each head rotating by default, or phi-2's top-level 0.4-style factor
    # (a quarter here); gelu_new; q/k LayerNorms and a tied lm_head (whose bias has no module) refused.
    "phi_defaults": ("phi", {}, {"rope_parameters": DEL, "layer_norm_eps": DEL, "rope_theta": 1e4}, 40, None),
    "phi_top_level_quarter_rotary": ("phi", {}, {"rope_parameters": DEL, "partial_rotary_factor": 0.25,
                                                 "rope_theta": 3e3}, 40, None),
    "phi_qk_layernorm": ("phi", {"qk_layernorm": True}, {}, 20, "qk_layernorm: true"),
    "phi_tied": ("phi", {}, {"tie_word_embeddings": True}, 20, "tie_word_embeddings: true is not supported"),
    # 24. GLM-4.5: its router's defaults (one group, weights renormalised, factor 1, one shared
    # expert, layer 0 dense) without those keys; two dense layers, two experts' width of shared
    # expert, weights as scored, no q/k norms; a group split that cannot be served refused.
    "glm4_moe_defaults": ("glm4_moe", GLM4_MOE, {"n_group": DEL, "topk_group": DEL, "norm_topk_prob": DEL,
                                                 "routed_scaling_factor": DEL, "n_shared_experts": DEL,
                                                 "first_k_dense_replace": DEL, "rope_parameters": DEL}, 40, None),
    "glm4_moe_variant": ("glm4_moe", {**GLM4_MOE, "num_hidden_layers": 3, "first_k_dense_replace": 2,
                                      "n_shared_experts": 2, "norm_topk_prob": False, "n_group": 2, "topk_group": 1,
                                      "use_qk_norm": False, "routed_scaling_factor": 1.5}, {}, 40, None),
    "glm4_moe_bad_groups": ("glm4_moe", GLM4_MOE, {"n_group": 3}, 20, "n_group 3 must divide n_routed_experts 8"),
    # 25. MiniMax-M2: its files' legacy rotary_dim (a quarter of each head here) and its defaults.
    "minimax_m2_rotary_dim": ("minimax_m2", MINIMAX_M2, {"rope_parameters": DEL, "rotary_dim": 4, "rope_theta": 3e3},
                              40, None),
    "minimax_m2_defaults": ("minimax_m2", MINIMAX_M2, {"rope_parameters": DEL, "rms_norm_eps": DEL}, 40, None),
    # 26. GPT-OSS: its defaults (YaRN over 4096 original positions, unclipped; base 1.5e5; every
    # other layer sliding over 128 tokens, which 140 tokens pass; the SwiGLU's limit 7 and gain
    # 1.702) without those keys; a window of 8 without layer_types, another limit and gain.
    "gpt_oss_defaults": ("gpt_oss", GPT_OSS, {"rope_parameters": DEL, "layer_types": DEL, "sliding_window": DEL,
                                              "rms_norm_eps": DEL, "swiglu_limit": DEL, "swiglu_alpha": DEL}, 140, None),
    # 27. Granite MoE: its multipliers' defaults (1.0) and experts' (8, top 2) without those keys;
    # GraniteMoeShared without a shared MLP (its default width 0), and with one.
    "granitemoe_defaults": ("granitemoe", {"intermediate_size": 32}, {
        "embedding_multiplier": DEL, "attention_multiplier": DEL, "residual_multiplier": DEL, "logits_scaling": DEL,
        "num_local_experts": DEL, "num_experts_per_tok": DEL, "rms_norm_eps": DEL, "rope_parameters": DEL}, 40, None),
    "granitemoeshared_none": ("granitemoeshared", {"intermediate_size": 32, "num_local_experts": 4},
                              {"shared_intermediate_size": DEL}, 40, None),
    "granitemoeshared_multipliers": ("granitemoeshared", {
        "intermediate_size": 32, "num_local_experts": 4, "shared_intermediate_size": 16, "residual_multiplier": 0.3,
        "embedding_multiplier": 5.0, "attention_multiplier": 0.1, "logits_scaling": 3.0}, {}, 40, None),
    "gpt_oss_window_and_clamp": ("gpt_oss", {**GPT_OSS, "sliding_window": 8, "swiglu_limit": 0.05,
                                             "swiglu_alpha": 1.0}, {"layer_types": DEL}, 40, None),
    # 28. DeepSeek V3: its router's defaults (8 groups, the best 4 kept, renormalised, times 2.5,
    # one shared expert, layers 0-2 dense) and rope_interleave's (true) without those keys; rope
    # pairs as halves, YaRN whose mscale_all_dim scales the scores. DeepSeek V2: greedy top k
    # (its groups not read), weights as scored; group_limited_greedy; settings it cannot serve.
    "deepseek_v3_defaults": ("deepseek_v3", {**DSV3, "num_hidden_layers": 4}, {
        "n_group": DEL, "topk_group": DEL, "norm_topk_prob": DEL, "routed_scaling_factor": DEL,
        "n_shared_experts": DEL, "first_k_dense_replace": DEL, "rope_interleave": DEL, "rms_norm_eps": DEL,
        "rope_parameters": DEL}, 40, None),
    "deepseek_v3_halves_yarn": ("deepseek_v3", {**DSV3, "rope_interleave": False, "first_k_dense_replace": 1,
                                                "n_group": 2, "topk_group": 1, "rope_parameters": {
                                                    "rope_type": "yarn", "factor": 8.0, "mscale": 0.9,
                                                    "mscale_all_dim": 1.3, "original_max_position_embeddings": 64,
                                                    "rope_theta": 1e4}}, {}, 40, None),
    "deepseek_v2_greedy": ("deepseek_v2", {**DSV2, "n_group": 4, "topk_group": 1, "routed_scaling_factor": 2.0},
                           {"first_k_dense_replace": DEL, "n_shared_experts": DEL, "rope_parameters": DEL}, 40, None),
    "deepseek_v2_grouped": ("deepseek_v2", {**DSV2, "topk_method": "group_limited_greedy", "n_group": 4,
                                            "topk_group": 2, "first_k_dense_replace": 1}, {}, 40, None),
    "deepseek_v2_renormalised": ("deepseek_v2", DSV2, {"norm_topk_prob": True}, 20, "norm_topk_prob: true"),
    "deepseek_v2_noaux": ("deepseek_v2", DSV2, {"topk_method": "noaux_tc"}, 20, "topk_method 'noaux_tc'"),
    "deepseek_v2_layer_freq": ("deepseek_v2", DSV2, {"moe_layer_freq": 2}, 20, "moe_layer_freq 2"),
    "deepseek_v3_bad_groups": ("deepseek_v3", DSV3, {"n_group": 3}, 20, "n_group 3 must divide n_routed_experts 16"),
}

MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"), "mistral": ("MistralForCausalLM", "MistralConfig"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"), "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"), "granite": ("GraniteForCausalLM", "GraniteConfig"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"), "gemma": ("GemmaForCausalLM", "GemmaConfig"),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config"), "olmo2": ("Olmo2ForCausalLM", "Olmo2Config"),
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config"), "exaone4": ("Exaone4ForCausalLM", "Exaone4Config"),
    "glm4": ("Glm4ForCausalLM", "Glm4Config"), "ministral": ("MinistralForCausalLM", "MinistralConfig"),
    "helium": ("HeliumForCausalLM", "HeliumConfig"), "seed_oss": ("SeedOssForCausalLM", "SeedOssConfig"),
    "cohere": ("CohereForCausalLM", "CohereConfig"), "cohere2": ("Cohere2ForCausalLM", "Cohere2Config"),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig"),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config"), "olmoe": ("OlmoeForCausalLM", "OlmoeConfig"),
    "phi": ("PhiForCausalLM", "PhiConfig"), "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig"),
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config"), "gpt_oss": ("GptOssForCausalLM", "GptOssConfig"),
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig"),
    "granitemoeshared": ("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config"),
}


def save_tiny(family: str, kwargs: dict, edits: dict, out):
    """Save a random tiny model, apply `edits` to its config.json, return transformers' reading of it."""
    model_cls, config_cls = (getattr(tf, n) for n in MODELS[family])
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**{"gemma2": GEMMA2, "gemma3": GEMMA, "phi3": PHI3, "smollm3": SMOLLM3, "glm4": PHI3, "helium": PHI3,
                                     "cohere": SMOLLM3, "cohere2": SMOLLM3, "stablelm": SMOLLM3,
                                     "starcoder2": SMOLLM3, "olmoe": SMOLLM3, "phi": SMOLLM3,
                                     "glm4_moe": SMOLLM3, "minimax_m2": SMOLLM3, "gpt_oss": SMOLLM3,
                                     "granitemoe": SMOLLM3, "granitemoeshared": SMOLLM3,
                                     "deepseek_v2": SMOLLM3, "deepseek_v3": SMOLLM3}.get(
        family, COMMON), **kwargs}))
    with torch.no_grad():  # random init leaves biases at zero and norms at one: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(out)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in edits.items():
        if value is DEL:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return model_cls.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(CASES))
def test_config_read_as_transformers_reads_it(name, tmp_path):
    from executors.llm import LlmExecutor, LlmExecutorConfig

    family, kwargs, edits, n, refusal = CASES[name]
    oracle = save_tiny(family, kwargs, edits, tmp_path)
    config = LlmExecutorConfig(model_dir=str(tmp_path), block_size=4, num_blocks=64)
    if refusal is not None:
        with pytest.raises(UnsupportedModel, match=refusal):
            LlmExecutor(config)
        return
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=n).tolist()
    with torch.no_grad():
        ref = oracle(torch.tensor([tokens])).logits[0].float().numpy()
    executor = LlmExecutor(config)
    try:
        ours = executor._forward_sequence(tokens, hidden=False).float().numpy()
    finally:
        executor.close()
    diff = np.abs(ours - ref).max(axis=1)
    assert diff.max() <= TOL, f"max |diff| {diff.max():.3g}, first position over {TOL}: {int(np.argmax(diff > TOL))}"


PHI3_CONFIG = {"architectures": ["Phi3ForCausalLM"], **COMMON}


@pytest.mark.parametrize("edit, refusal", [
    ({"rope_parameters": {**LONGROPE, "partial_rotary_factor": 0.5}}, "longrope short_factor must list 4 positive"),
    ({"rope_parameters": {**LONGROPE, "long_factor": [1.0] * 7 + [0]}}, "long_factor must list 8 positive"),
    ({"rope_parameters": {k: v for k, v in LONGROPE.items() if k != "original_max_position_embeddings"}},
     "original_max_position_embeddings"),
    ({"rope_parameters": {**LONGROPE, "attention_factor": -1}}, "attention_factor must be a positive"),
    ({"partial_rotary_factor": 0.3125}, "rotates 5 of the 16 dimensions"),
    ({"partial_rotary_factor": 0}, r"must be a number in \(0, 1\]"),
    ({"rope_parameters": L3}, "Phi3Config takes the default rope or longrope"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "Phi3Config takes the default rope or longrope"),
])
def test_phi3_rope_settings_transformers_refuses_are_refused(edit, refusal):
    """What Phi3Config's own validation (or its model) fails on: refused at start-up too."""
    with pytest.raises(UnsupportedModel, match=refusal):
        DecoderConfig.from_dict({**PHI3_CONFIG, **edit})


SMOLLM3_CONFIG = {"architectures": ["SmolLM3ForCausalLM"], **COMMON}


@pytest.mark.parametrize("edit, refusal", [
    ({"no_rope_layers": [1]}, r"no_rope_layers must list 0 \(NoPE\) or 1 \(rotary\) for each of the 2 layers"),
    ({"no_rope_layers": [1, 2]}, "no_rope_layers must list 0"),
    ({"no_rope_layers": "1,0"}, "no_rope_layers must list 0"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive integer"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window must be a positive integer, got None"),
    ({"layer_types": ["full_attention"]}, "layer_types must list num_hidden_layers"),
    ({"layer_types": ["chunked_attention", "full_attention"], "sliding_window": 8}, "chunked_attention"),
])
def test_smollm3_layer_settings_that_cannot_be_served_are_refused(edit, refusal):
    """What transformers' SmolLM3 fails on (an index past no_rope_layers, a sliding mask
    without a window) or this executor does not serve: refused at start-up, by name."""
    with pytest.raises(UnsupportedModel, match=refusal):
        DecoderConfig.from_dict({**SMOLLM3_CONFIG, **edit})


def test_exaone4_layer_types_transformers_cannot_derive_are_refused():
    """Exaone4Config derives layer_types from an integer pattern only (a string one fails in
    it): without layer_types, "LLLG" is refused by name; with them it is not read."""
    config = {"architectures": ["Exaone4ForCausalLM"], **COMMON, "sliding_window": 8, "sliding_window_pattern": "LLLG"}
    with pytest.raises(UnsupportedModel, match="sliding_window_pattern must be a positive integer, got 'LLLG'"):
        DecoderConfig.from_dict(config)
    listed = DecoderConfig.from_dict({**config, "layer_types": ["sliding_attention", "full_attention"]})
    assert listed.layer_windows == (8, None) and listed.nope_layers == (1,)


def test_gemma2_caps_default_to_gemma2configs_and_null_is_none():
    """Caps of 50 and 30 barely move a tiny model's scores: read them here, not by their effect."""
    base = {"architectures": ["Gemma2ForCausalLM"], **GEMMA}
    config = DecoderConfig.from_dict(base)
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    none = DecoderConfig.from_dict({**base, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (none.attn_softcap, none.final_softcap) == (None, None)
    gemma3 = DecoderConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], **GEMMA, "attn_logit_softcapping": 50.0})
    assert gemma3.attn_softcap is None  # Gemma 3's reference does not apply it


def test_phi3_yarn_is_longrope_and_its_factor_comes_from_the_context():
    """Phi3Config renames su and yarn to longrope; without attention_factor or factor, the
    attention factor is sqrt(1 + ln(max / original) / ln(original)), as transformers computes it."""
    config = DecoderConfig.from_dict({**PHI3_CONFIG, "max_position_embeddings": 1024,
                                      "rope_scaling": {**LONGROPE, "rope_type": "yarn"}})
    scaling = config.rope_scaling
    assert scaling.kind == "longrope" and scaling.original_max_position_embeddings == 256
    assert scaling.short_factor == (1.0,) * 8 and scaling.long_factor == (2.0,) * 8
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))


def test_family_defaults_match_transformers_config_classes():
    for family, ours in FAMILY_DEFAULTS.items():
        config_cls = getattr(tf, MODELS[family][1])
        fields = {f.name: f.default for f in dataclasses.fields(config_cls)}
        theta = config_cls.default_theta
        expected = {
            "rope_theta": theta["global"] if isinstance(theta, dict) else theta,
            "local_rope_theta": theta["local"] if isinstance(theta, dict) else None,
            "rms_norm_eps": fields[ours.norm_eps_key], "max_position_embeddings": fields["max_position_embeddings"],
            "logit_scale": fields.get("logit_scale"),
            "tie_word_embeddings": fields["tie_word_embeddings"], "sliding_window": fields.get("sliding_window"),
            "activation": fields[ours.activation_key], "query_pre_attn_scalar": fields.get("query_pre_attn_scalar"),
            "final_logit_softcapping": fields.get("final_logit_softcapping"),
            "attn_logit_softcapping": fields.get("attn_logit_softcapping") if family == "gemma2" else None}
        if ours.attention_bias_key is not None:
            expected["attention_bias"] = fields[ours.attention_bias_key]
        if ours.mlp_bias_key is not None:
            expected["mlp_bias"] = fields[ours.mlp_bias_key]
        got = {k: getattr(ours, k) for k in expected}
        assert got == expected, family
        # The one activation key the family reads: the other is not a field of its class.
        other = {"hidden_act": "hidden_activation", "hidden_activation": "hidden_act"}[ours.activation_key]
        assert other not in fields, family
        if ours.sliding_window_pattern is not None:
            types = config_cls(num_hidden_layers=2 * ours.sliding_window_pattern).layer_types
            assert types.index("full_attention") == ours.sliding_window_pattern - 1, family


@pytest.mark.parametrize("family", list(FAMILY_DEFAULTS))
def test_family_bias_layout_matches_transformers_modeling(family):
    """Every bias switch on: which of q/o/MLP projections transformers gives a bias."""
    ours = FAMILY_DEFAULTS[family]
    model_cls, config_cls = (getattr(tf, n) for n in MODELS[family])
    moe = {"num_experts": 2, "num_local_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
           "shared_expert_intermediate_size": 8, "mlp_only_layers": [0]}  # layer 0 dense, layer 1 sparse
    switches = {key: True for key in ("attention_bias", "qkv_bias", "mlp_bias", ours.attention_bias_key,
                                      ours.o_proj_bias_key) if key}
    config = config_cls(**{**COMMON, "pad_token_id": 0, "hidden_size": 16, "intermediate_size": 8, "head_dim": 4,
                           **switches, **(moe if family in MOE_FAMILIES else {})})
    with torch.device("meta"):
        names = {n for n, _ in model_cls(config).named_parameters()}
    renames = RENAMED.get(family, {})  # Phi's dense, fc1, fc2: read as the decoder's o_proj, up_proj, down_proj
    names = {next((n.replace(t, o) for t, o in renames.items() if f".{t}." in n), n) for n in names}
    switchable = ours.attention_bias_key is not None
    # Phi-3: qkv_proj; DeepSeek's latent attention: q_a_proj's and kv_a_proj_with_mqa's
    q_bias = {f"model.layers.0.self_attn.{p}.bias" for p in ("q_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa")
              } & names
    assert bool(q_bias) == (switchable or ours.attention_bias), family
    assert ("model.layers.0.self_attn.o_proj.bias" in names) == (ours.o_proj_bias or bool(ours.o_proj_bias_key)), family
    mlp_biases = {n for n in names if n.endswith("bias") and ("mlp" in n or "sparse_moe" in n)}
    if family == "gpt_oss":  # its experts' and router's biases: its MoeConfig's (stacked experts), not mlp_bias
        assert {n.split(".mlp.")[1] for n in mlp_biases} == {"router.bias", "experts.gate_up_proj_bias",
                                                            "experts.down_proj_bias"}
        mlp_biases = set()
    assert bool(mlp_biases) == (ours.mlp_bias_key is not None or ours.mlp_bias), (family, mlp_biases)


@pytest.mark.parametrize("family, extra", [*((f, {}) for f in FAMILY_DEFAULTS if f not in MOE_FAMILIES),
                                           ("stablelm", {"use_parallel_residual": True}),
                                           ("cohere", {"use_qk_norm": True})])
def test_parameter_names_match_transformers_modeling(family, extra):
    """Every bias switch on: the decoder holds the parameters transformers' model has, by
    name (the norms' biases, a parallel layer's one norm), a fused checkpoint tensor counting
    as its parts. (transformers 5 stacks a mixture's experts in its modules, not in its files.)"""
    from executors.models.checkpoint_sections import fused_sections
    from executors.models.decoder import DecoderLM

    ours = FAMILY_DEFAULTS[family]
    model_cls, config_cls = (getattr(tf, n) for n in MODELS[family])
    switches = {key: True for key in ("attention_bias", "mlp_bias", ours.attention_bias_key, ours.o_proj_bias_key)
                if key}
    config = config_cls(**{**SMOLLM3, "hidden_size": 32, "intermediate_size": 8, "head_dim": 8, **switches, **extra})
    with torch.device("meta"):
        theirs = {n for n, _ in model_cls(config).named_parameters()}
        decoder = DecoderConfig.from_dict({**config.to_dict(), "architectures": [MODELS[family][0]]})
        mine = {n for n, _ in DecoderLM(decoder).named_parameters()}
    sections = fused_sections(decoder)
    assert {part for n in theirs for part, _, _ in sections.get(n, ((n, 0, 0),))} == mine, family


def test_multimodal_text_defaults_match_transformers_config_classes():
    from executors.models.config import ARCHITECTURES

    """The text model's shape where a multimodal file's text_config leaves it out, and the
    whole model's tie_word_embeddings where its top level does: their classes' defaults."""
    from executors.models.families import MULTIMODAL_TEXT, MULTIMODAL_TEXT_DEFAULTS, MULTIMODAL_TIED

    text_classes = {"Gemma3ForConditionalGeneration": tf.Gemma3TextConfig,
                    "Mistral3ForConditionalGeneration": tf.MistralConfig,
                    "Qwen2_5_VLForConditionalGeneration": tf.Qwen2_5_VLTextConfig,
                    "Qwen3VLForConditionalGeneration": tf.Qwen3VLTextConfig}
    for wrapper in MULTIMODAL_TEXT:
        text_cls = text_classes[wrapper]
        theta = text_cls.default_theta  # Gemma 3's: per layer type, its global one read as rope_theta
        fields = {**{f.name: f.default for f in dataclasses.fields(text_cls)},
                  "rope_theta": theta["global"] if isinstance(theta, dict) else theta}
        ours = MULTIMODAL_TEXT_DEFAULTS[wrapper]
        assert ours == {k: fields[k] for k in ours}, wrapper
        assert "head_dim" in ours or fields.get("head_dim") is None, wrapper
        family = FAMILY_DEFAULTS[ARCHITECTURES[MULTIMODAL_TEXT[wrapper]][0]]  # where ours says nothing, the family's
        for key in ("rope_theta", "rms_norm_eps", "max_position_embeddings"):
            assert ours.get(key, getattr(family, key)) == fields[key], (wrapper, key)
        whole = {f.name: f.default for f in dataclasses.fields(getattr(tf, wrapper.replace("ForConditionalGeneration",
                                                                                            "Config")))}
        assert MULTIMODAL_TIED[wrapper] == whole["tie_word_embeddings"], wrapper


def test_every_family_has_a_model_type():
    from executors.llm import FAMILY_TYPES
    from executors.models.config import ARCHITECTURES

    assert {family for family, _ in ARCHITECTURES.values()} == set(FAMILY_TYPES) == set(FAMILY_DEFAULTS)
    assert set(MODELS) == set(FAMILY_DEFAULTS)  # each family checked against its transformers classes
