"""Tiny random checkpoints built with transformers (the test oracle): the dense Qwen3, Llama
and Qwen2; the mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral; the sliding-window
Mistral, Gemma 2 (soft-capped attention scores), Gemma 3 and Phi-3 (whose checkpoint fuses
q/k/v and gate/up); Phi-4-mini's rope; Granite's multipliers; Gemma (1); SmolLM3's NoPE layers;
OLMo 2's norms; OLMo 3's windows and YaRN; EXAONE 4's NoPE global layers; GLM-4's interleaved half rotation and renamed norms; Ministral's sliding and global layers; Helium's interleaved rotation; Seed-OSS's biases; Cohere's
and Cohere 2's LayerNorms and parallel layers; StableLM's LayerNorms with biases; StarCoder2's
ungated MLP; OLMoE's experts under OLMo's q/k norms; Phi's parallel layers, ungated MLP and
lm_head bias; GLM-4.5's grouped sigmoid router and shared experts; the text models of Gemma 3's and
Mistral Small 3.1's multimodal checkpoints (a tiny vision tower beside them); MiniMax-M2's sigmoid
router under q/k norms over every head; Qwen2.5-VL's and Qwen3-VL's text models (their mrope);
GPT-OSS's attention sinks and stacked, biased experts; Granite MoE's stacked experts under
Granite's multipliers, with a shared MLP (GraniteMoeShared); DeepSeek V3's and V2's latent
attention and grouped routers."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320


def build(family: str, out_dir: Path, **save_kwargs):
    """Save a tiny random model of `family` to out_dir; return the transformers model (fp32, eval)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed({"qwen3": 1, "llama": 2, "qwen2": 3, **SEEDS}[family])
    if family in SEEDS:
        model = _new_family(tf, family, common)
    elif family == "qwen3":
        # Qwen3: explicit head_dim larger than hidden/heads, q/k norms, separate lm_head.
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
    elif family == "llama":
        # Llama 3: rope scaling, tied embeddings (as SmolLM2).
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_scaling=scaling, rope_theta=50000.0,
                                                   tie_word_embeddings=True))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False))
    else:
        raise ValueError(family)
    # Random init leaves biases at zero; make them count.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("sinks"):  # GPT-OSS's: as large as the scores, so that they bite
                p.copy_(torch.randn_like(p) * 2)
        for name, b in model.named_buffers():  # GLM-4.5's and MiniMax-M2's router correction (a buffer there)
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.eval()
    model.save_pretrained(out_dir, **save_kwargs)
    return model


SEEDS = {"qwen3_moe": 4, "qwen2_moe": 5, "mixtral": 6, "mistral": 7, "gemma3": 8, "phi3": 9, "phi4_mini": 10,
         "granite": 11, "gemma2": 12, "gemma": 13, "smollm3": 14, "olmo2": 15, "olmo3": 16, "exaone4": 17, "glm4": 18, "ministral": 19, "helium": 20, "seed_oss": 21,
         "cohere": 22, "cohere2": 23, "stablelm": 24, "starcoder2": 25,
         "olmoe": 26, "phi": 27, "glm4_moe": 28,
         "gemma3_multimodal": 29, "mistral3": 30, "minimax_m2": 31,
         "command_r_plus": 32, "qwen2_5_vl": 33, "qwen3_vl": 34, "gpt_oss": 35,
         "granitemoe": 36, "granitemoeshared": 37, "deepseek_v3": 38, "deepseek_v2": 39}
# phi4_mini's LongRoPE: short factors up to this many positions, long ones from there.
LONGROPE_ORIGINAL = 24
WINDOW = 8  # the sliding families' window: prompts of 30+ tokens span it several times


def _new_family(tf, family: str, common: dict):
    if family == "qwen3_moe":
        # 8 experts, top 2, renormalised; layer 1 dense (mlp_only_layers).
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False))
    if family == "qwen2_moe":
        # Shared expert beside 8 routed ones, weights not renormalised; layers 1 and 3 sparse.
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **dict(common, num_hidden_layers=4), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, decoder_sparse_step=2, tie_word_embeddings=False))
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**dict(common, intermediate_size=48), num_local_experts=4,
                                                      num_experts_per_tok=2, sliding_window=None))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False))
    if family == "gemma3":
        # Sliding layers around a global one, their own rope base, linear scaling on the global
        # one, a query scale that is not 1/sqrt(head_dim), both soft-caps. Eager attention: the
        # SDPA one of transformers ignores attn_logit_softcapping.
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        config = tf.Gemma3TextConfig(
            **dict(common, num_hidden_layers=4), head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters=rope, final_logit_softcapping=30.0, attn_logit_softcapping=20.0)
        config._attn_implementation = "eager"
        return tf.Gemma3ForCausalLM(config)
    if family == "phi3":
        # Phi-3-mini's layout: one qkv_proj, one gate_up_proj, a window over every layer.
        return tf.Phi3ForCausalLM(tf.Phi3Config(**common, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1,
                                                eos_token_id=2, tie_word_embeddings=False))
    if family == "phi4_mini":
        # Phi-4-mini's rope: 3/4 of each head rotates (12 of 16 dimensions here), LongRoPE with
        # a factor per frequency, short and long, and the attention factor of a 512/24 context.
        gen = torch.Generator().manual_seed(10)
        rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                "short_factor": (1 + 3 * torch.rand(6, generator=gen)).tolist(),
                "long_factor": (2 + 6 * torch.rand(6, generator=gen)).tolist(),
                "original_max_position_embeddings": LONGROPE_ORIGINAL}
        return tf.Phi3ForCausalLM(tf.Phi3Config(**dict(common, num_attention_heads=4, num_key_value_heads=2),
                                                rope_parameters=rope, original_max_position_embeddings=LONGROPE_ORIGINAL,
                                                pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                tie_word_embeddings=True))
    if family == "gemma2":
        # Every other layer sliding, both soft-caps small enough to bite on a tiny model's
        # scores (std ~0.02: a cap of 0.05) and logits, a query scale that is not 1/sqrt(head_dim).
        config = tf.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                 attn_logit_softcapping=0.05, final_logit_softcapping=2.0, pad_token_id=0)
        config._attn_implementation = "eager"
        return tf.Gemma2ForCausalLM(config)
    if family == "granite":
        # Granite 3's multipliers (none of them 1), biases on attention (o_proj's scaled with
        # its weight), tied embeddings.
        return tf.GraniteForCausalLM(tf.GraniteConfig(
            **common, embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.45,
            logits_scaling=2.5, attention_bias=True, tie_word_embeddings=True))
    if family == "gemma":
        # Gemma (1): (1 + w) norms, scaled embeddings and GELU-tanh, without Gemma 2's extra
        # norms, caps or windows; a head_dim that is not hidden / heads.
        return tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=16, pad_token_id=0))
    if family == "smollm3":
        # SmolLM3: Llama with NoPE layers (1 and 3 rotate neither q nor k); layer 1 also slides,
        # so a NoPE layer is tested with and without a window; biases on attention.
        return tf.SmolLM3ForCausalLM(tf.SmolLM3Config(
            **dict(common, num_hidden_layers=4), no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
            sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention", "full_attention",
                                                "full_attention"],
            attention_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if family == "olmo2":
        # OLMo 2: norms after attention and the MLP only, q/k norms over all heads at once;
        # biases on attention (o_proj's too); one KV head, which two tensor-parallel ranks
        # each hold (their k norm statistics then the same head's twice).
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**dict(common, num_key_value_heads=1), attention_bias=True,
                                                  pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if family == "olmo3":
        # OLMo 3: OLMo 2's layer, three of every four layers sliding, YaRN on the global one
        # (its ramp inside the 8 frequencies of a 16-dimension head) and its own base on the
        # sliding ones.
        rope = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                                   "rope_theta": 1e4, "beta_fast": 16},
                "sliding_attention": {"rope_type": "default", "rope_theta": 3e3}}
        return tf.Olmo3ForCausalLM(tf.Olmo3Config(**dict(common, num_hidden_layers=4), sliding_window=WINDOW,
                                                  rope_parameters=rope, pad_token_id=0, bos_token_id=1,
                                                  eos_token_id=2))
    if family == "exaone4":
        # EXAONE 4: output norms only, per-head q/k norms, three of four layers sliding and
        # rotating, the fourth global and NoPE; Llama 3 rope scaling as EXAONE-4.0-32B's.
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 1e6}
        return tf.Exaone4ForCausalLM(tf.Exaone4Config(**dict(common, num_hidden_layers=4), sliding_window=WINDOW,
                                                      rope_parameters=rope, pad_token_id=0))
    if family == "glm4":
        # GLM-4: half of each head rotates, in neighbouring pairs; gate/up fused in the checkpoint;
        # q/k/v biases; norms around attention's and the MLP's outputs under names of their own.
        return tf.Glm4ForCausalLM(tf.Glm4Config(**common, head_dim=16, partial_rotary_factor=0.5,
                                                attention_bias=True, pad_token_id=0))
    if family == "ministral":
        # Ministral: Mistral's layer, sliding and global layers by layer_types (head_dim given:
        # MinistralConfig leaves it None, which its attention cannot take).
        return tf.MinistralForCausalLM(tf.MinistralConfig(
            **common, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False))
    if family == "helium":
        # Helium: every dimension of a head rotates, in neighbouring pairs; q/k/v biases.
        return tf.HeliumForCausalLM(tf.HeliumConfig(**common, head_dim=16, attention_bias=True, pad_token_id=0))
    if family == "seed_oss":
        # Seed-OSS: q/k/v biases, o_proj's switched by attention_out_bias.
        return tf.SeedOssForCausalLM(tf.SeedOssConfig(**common, head_dim=16, attention_bias=True,
                                                      attention_out_bias=True))
    if family == "cohere":
        # Command-R: LayerNorms without a bias, attention and the MLP in parallel on one norm's
        # output, rotary pairs interleaved, the logits scaled; biases on attention.
        return tf.CohereForCausalLM(tf.CohereConfig(**common, logit_scale=0.25, attention_bias=True,
                                                    pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if family == "cohere2":
        # Command R7B: Cohere's layer, three of every four sliding and rotating, the fourth
        # global and NoPE.
        return tf.Cohere2ForCausalLM(tf.Cohere2Config(**dict(common, num_hidden_layers=4), sliding_window=WINDOW,
                                                      logit_scale=0.5, pad_token_id=0, bos_token_id=1,
                                                      eos_token_id=2))
    if family == "stablelm":
        # StableLM 2: LayerNorms with biases, a quarter of each head rotating, q/k/v biases,
        # attention and the MLP in sequence (use_parallel_residual is a config case).
        return tf.StableLmForCausalLM(tf.StableLmConfig(**common, use_qkv_bias=True, pad_token_id=0,
                                                        bos_token_id=1, eos_token_id=2))
    if family == "starcoder2":
        # StarCoder2: LayerNorms with biases, an ungated GELU-tanh MLP (c_fc, c_proj), biases on
        # every projection, a window over every layer.
        return tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**common, sliding_window=WINDOW, use_bias=True,
                                                            pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if family == "olmoe":
        # OLMoE: Llama's pre-norms, OLMo's q/k norms over every head, 8 experts (top 2, weights
        # not renormalised) in every layer; biases on attention.
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(**dict(common, intermediate_size=32), num_experts=8,
                                                  num_experts_per_tok=2, attention_bias=True, pad_token_id=0,
                                                  bos_token_id=1, eos_token_id=2))
    if family == "phi":
        # Phi-2: LayerNorms with biases, attention and an ungated MLP in parallel, 0.4 of each
        # head rotating (4 of 16 dimensions here: 0.25), biases everywhere, the lm_head's too.
        return tf.PhiForCausalLM(tf.PhiConfig(**common, partial_rotary_factor=0.25, pad_token_id=0,
                                              bos_token_id=1, eos_token_id=2))
    if family == "glm4_moe":
        # GLM-4.5: 8 experts in 4 groups of 2, the 3 best chosen from the 2 best groups by
        # sigmoid scores plus a correction, weighed renormalised and times 2.5; one shared expert;
        # layer 0 dense; half of each head rotating (NeoX pairs), q/k/v biases, per-head q/k norms.
        return tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(
            **common, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
            attention_bias=True, use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if family == "gemma3_multimodal":
        # Gemma 3 4B-27B's layout: Gemma3ForConditionalGeneration, the text model's config in
        # text_config, its weights under language_model.*, a vision tower and projector beside.
        text = dict(common, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        config.text_config._attn_implementation = "eager"
        return tf.Gemma3ForConditionalGeneration(config)
    if family == "mistral3":
        # Mistral Small 3.1's layout: Mistral3ForConditionalGeneration over a Mistral text model
        # (a window here; the lm_head untied by the whole model's key, under language_model.lm_head),
        # a Pixtral tower beside.
        text = dict(common, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False, model_type="mistral")
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14, head_dim=16)
        return tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(text_config=text, vision_config=vision,
                                                                     tie_word_embeddings=False))
    if family == "minimax_m2":
        # MiniMax-M2: q/k norms over every head, half of each head rotating (its legacy rotary_dim
        # is a config case), 8 experts in every layer chosen by sigmoid scores plus a correction
        # on the block, top 3 renormalised.
        return tf.MiniMaxM2ForCausalLM(tf.MiniMaxM2Config(
            **dict(common, intermediate_size=32), head_dim=16, num_local_experts=8, num_experts_per_tok=3,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if family == "command_r_plus":
        # Command R+: Cohere's layer with q/k LayerNorms, a weight row per head (normed before the
        # interleaved rotation, their weights reordered with it); one KV head, which two
        # tensor-parallel ranks each hold.
        return tf.CohereForCausalLM(tf.CohereConfig(**dict(common, num_key_value_heads=1), use_qk_norm=True,
                                                    logit_scale=0.25, pad_token_id=0, bos_token_id=1,
                                                    eos_token_id=2))
    if family in ("qwen2_5_vl", "qwen3_vl"):
        # Qwen2.5-VL and Qwen3-VL (its mrope interleaved): text models whose rotation has
        # time/height/width sections, a tiny vision tower beside; token ids alone give every
        # section the same position.
        rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        if family == "qwen2_5_vl":
            text = dict(common, rope_parameters=rope, **ids)
            return tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision))
        text = dict(common, head_dim=16, rope_parameters={**rope, "mrope_interleaved": True}, **ids)
        return tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(
            text_config=text, vision_config={**vision, "deepstack_visual_indexes": [0]}))
    if family == "gpt_oss":
        # GPT-OSS: attention sinks, biases on q/k/v/o, every other layer sliding (from the first),
        # YaRN unclipped (truncate: false); 4 experts in every layer, top 2 by the softmax of a
        # biased router's top logits; the experts stacked with biases, their clamped SwiGLU with a
        # limit low enough that the clamps bite at these weights' scale.
        rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 16, "rope_theta": 1.5e5}
        config = tf.GptOssConfig(**dict(common, intermediate_size=32), head_dim=16, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=0.1,
                                 rope_parameters=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        config._attn_implementation = "eager"
        return tf.GptOssForCausalLM(config)
    if family in ("granitemoe", "granitemoeshared"):
        # Granite MoE: Granite's four multipliers, 4 stacked experts in every layer (top 2 by the
        # softmax of the router's top logits), q/k/v/o biases; GraniteMoeShared a gated shared
        # MLP beside them.
        shared = family == "granitemoeshared"
        cls, config_cls = ((tf.GraniteMoeSharedForCausalLM, tf.GraniteMoeSharedConfig) if shared
                           else (tf.GraniteMoeForCausalLM, tf.GraniteMoeConfig))
        return cls(config_cls(**dict(common, intermediate_size=32), num_local_experts=4, num_experts_per_tok=2,
                              attention_bias=True, embedding_multiplier=3.0, attention_multiplier=0.2,
                              residual_multiplier=0.5, logits_scaling=2.0, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, **({"shared_intermediate_size": 48} if shared else {})))
    if family in ("deepseek_v3", "deepseek_v2"):
        return _deepseek(tf, family, common)
    raise ValueError(family)


def _deepseek(tf, family: str, common: dict):
    """DeepSeek V3: latent attention through a q_lora_rank (biases on q_a_proj, kv_a_proj_with_mqa
    and o_proj), its rope pairs interleaved, YaRN whose mscale_all_dim scales the scores; 8
    experts in 4 groups, 3 chosen from the best 2 groups by sigmoid scores plus a correction,
    renormalised, times 2.5; one shared expert; layer 0 dense. DeepSeek V2: V2-Lite's queries
    straight from q_proj; a softmax router choosing 2 within the best 2 of 4 groups
    (group_limited_greedy), weights times 1.5; two shared experts. Values as wide as 24,
    keys' non-rotary part 16: what reads one as the other fails. (transformers repeats the
    expanded keys by num_attention_heads / num_key_value_heads: one KV head per head.)"""
    common = {**common, "num_key_value_heads": common["num_attention_heads"]}
    mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, moe_intermediate_size=32,
               n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=1, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)
    if family == "deepseek_v3":
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 1e4}
        config = tf.DeepseekV3Config(**common, **mla, q_lora_rank=48, num_experts_per_tok=3, n_shared_experts=1,
                                     routed_scaling_factor=2.5, attention_bias=True, rope_parameters=rope)
        config._attn_implementation = "eager"
        return tf.DeepseekV3ForCausalLM(config)
    config = tf.DeepseekV2Config(**common, **mla, q_lora_rank=None, num_experts_per_tok=2, n_shared_experts=2,
                                 topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    config._attn_implementation = "eager"
    return tf.DeepseekV2ForCausalLM(config)
