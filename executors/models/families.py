"""The families the one decoder serves: each architecture's family, and the sets of families
that share a layer kind (config.py turns them into DecoderConfig's flags); the options of a
family that change its layer in ways the decoder does not compute, refused by name.
"""

from __future__ import annotations

from typing import Any

from executors.models.errors import UnsupportedModel

# architecture -> (family, per-head q/k RMSNorm); biases and defaults: family_defaults.py
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", True),
    "MistralForCausalLM": ("mistral", False),
    "MixtralForCausalLM": ("mixtral", False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", True),
    "Gemma2ForCausalLM": ("gemma2", False),
    "Gemma3ForCausalLM": ("gemma3", True),
    "Phi3ForCausalLM": ("phi3", False),
    "GraniteForCausalLM": ("granite", False),
    "GemmaForCausalLM": ("gemma", False),
    "SmolLM3ForCausalLM": ("smollm3", False),
    "Olmo2ForCausalLM": ("olmo2", True),
    "Olmo3ForCausalLM": ("olmo3", True),
    "Exaone4ForCausalLM": ("exaone4", True),
    "Glm4ForCausalLM": ("glm4", False),
    "MinistralForCausalLM": ("ministral", False),
    "HeliumForCausalLM": ("helium", False),
    "SeedOssForCausalLM": ("seed_oss", False),
    "CohereForCausalLM": ("cohere", False),
    "Cohere2ForCausalLM": ("cohere2", False),
    "StableLmForCausalLM": ("stablelm", False),
    "Starcoder2ForCausalLM": ("starcoder2", False),
    "OlmoeForCausalLM": ("olmoe", True),
    "PhiForCausalLM": ("phi", False),
    "Glm4MoeForCausalLM": ("glm4_moe", False),  # per-head q/k norms where use_qk_norm says
    "MiniMaxM2ForCausalLM": ("minimax_m2", True),
    "GptOssForCausalLM": ("gpt_oss", False),
    "GraniteMoeForCausalLM": ("granitemoe", False),
    "GraniteMoeSharedForCausalLM": ("granitemoeshared", False),
    "DeepseekV2ForCausalLM": ("deepseek_v2", False),  # multi-head latent attention (mla_config.py)
    "DeepseekV3ForCausalLM": ("deepseek_v3", False),  # and Kimi K2's, Moonlight's
}
# Granite's multipliers (embedding, attention, residual, logits): its dense and MoE models.
GRANITE_FAMILIES = ("granite", "granitemoe", "granitemoeshared")
# GptOssConfig's rope where a file has none: YaRN over an original 4096 positions.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
# Multimodal architectures whose text model the decoder serves, and that model's architecture
# (its config in text_config, or Qwen2.5-VL's older top level; its weights under
# language_model.* or model.*, read by checkpoint_sections.text_tensor_name, the towers skipped).
MULTIMODAL_TEXT = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                   "Mistral3ForConditionalGeneration": "MistralForCausalLM",
                   "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
                   "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM"}
# Their config class's tie_word_embeddings: the whole model's, which transformers 5 ties by
# (over text_config's) where the file's top level has none.
MULTIMODAL_TIED = {"Gemma3ForConditionalGeneration": True, "Mistral3ForConditionalGeneration": True,
                   "Qwen2_5_VLForConditionalGeneration": False, "Qwen3VLForConditionalGeneration": False}
# Their text config class's defaults where they differ from the text family's (shapes the
# published files' text_config leaves out in part: gemma-3-4b-it lists 6 keys; the Qwen VL
# text configs' own rope bases and epsilons): Gemma3TextConfig's, MistralConfig's,
# Qwen2_5_VLTextConfig's and Qwen3VLTextConfig's.
MULTIMODAL_TEXT_DEFAULTS = {
    "Gemma3ForConditionalGeneration": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                                       "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                                       "head_dim": 256},
    "Mistral3ForConditionalGeneration": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8},
    "Qwen2_5_VLForConditionalGeneration": {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                                           "num_hidden_layers": 80, "num_attention_heads": 64,
                                           "num_key_value_heads": 8, "max_position_embeddings": 32768,
                                           "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "Qwen3VLForConditionalGeneration": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                                        "head_dim": 128, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                                        "rope_theta": 5e5},
}
# Qwen2.5-VL's files before transformers 5 hold the text model's keys at the top level.
FLAT_TEXT_CONFIG = ("Qwen2_5_VLForConditionalGeneration",)
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
# The projections each family's checkpoints store fused: Phi-3's q/k/v as one qkv_proj and
# gate/up as one gate_up_proj, GLM-4's gate/up.
FUSED_CHECKPOINT = {"phi3": ("qkv_proj", "gate_up_proj"), "glm4": ("gate_up_proj",)}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")  # (1 + w) norms, scaled embeddings, GELU-tanh
SANDWICH_FAMILIES = ("gemma2", "gemma3")  # and norms around attention's and the MLP's outputs, a query scalar, caps
# Families that norm attention's and the MLP's outputs only, no inputs (EXAONE 4's q/k norms
# are per head, OLMo's span every head).
POST_NORM_FAMILIES = ("olmo2", "olmo3", "exaone4")
# q/k norms over every head at once (OLMoE's and MiniMax-M2's with pre-norms)
ACROSS_HEADS_QK_NORM_FAMILIES = ("olmo2", "olmo3", "olmoe", "minimax_m2")
# LayerNorms (the mean subtracted) in place of RMSNorms; all but Cohere's with a bias.
LAYER_NORM_FAMILIES = ("cohere", "cohere2", "stablelm", "starcoder2", "phi")
UNGATED_FAMILIES = ("starcoder2", "phi")  # down(act(up(x))), GELU-tanh (Phi's gelu_new)
COHERE_FAMILIES = ("cohere", "cohere2")  # parallel attention and MLP, logits scaled, pairs interleaved


def text_config(cfg: dict[str, Any], wrapper: str) -> dict[str, Any]:
    """A multimodal config.json's text model as a config of its own: its text_config over its
    class's defaults, mrope read as 1-D rotation, the text architecture, the top level's dtype and token ids where text_config
    has none (gemma-3-4b-it's end of turn is there), and the whole model's tie_word_embeddings,
    as transformers ties the lm_head."""
    text = cfg.get("text_config")
    if text is None and wrapper in FLAT_TEXT_CONFIG:
        text = {k: v for k, v in cfg.items() if k not in ("vision_config", "architectures")}
    if not isinstance(text, dict):
        raise UnsupportedModel(f"{wrapper}'s config.json has no text_config object, which its text model needs")
    top = {k: cfg[k] for k in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id") if k in cfg and k not in text}
    tied = cfg.get("tie_word_embeddings", MULTIMODAL_TIED[wrapper])
    return {**MULTIMODAL_TEXT_DEFAULTS[wrapper], **top, **_without_mrope(text), "tie_word_embeddings": tied,
            "architectures": [MULTIMODAL_TEXT[wrapper]]}


def _without_mrope(text: dict[str, Any]) -> dict[str, Any]:
    """The Qwen VL models' multimodal rotation (mrope) as the 1-D one it is for token ids alone:
    a text position is the same on its time, height and width axes, so every frequency section
    turns by it (transformers' get_rope_index gives text the same three positions)."""
    out = dict(text)
    for key in ("rope_scaling", "rope_parameters"):
        rope = out.get(key)
        if isinstance(rope, dict) and (set(rope) & set(MROPE_KEYS) or rope.get("type") == "mrope"
                                       or rope.get("rope_type") == "mrope"):
            rest = {k: v for k, v in rope.items() if k not in (*MROPE_KEYS, "type", "rope_type")}
            kind = rope.get("rope_type", rope.get("type", "default"))
            out[key] = {**rest, "rope_type": "default" if kind == "mrope" else kind}
    return out


def refuse_unserved_options(cfg: dict[str, Any], family: str) -> None:
    """Options that change the layer in ways the decoder does not compute: q/k LayerNorms
    (StableLM 2 12B's, a LayerNorm module per head; Phi's), a tied lm_head beside
    Phi's lm_head bias, OLMoE's clipped q/k/v; weights quantized by a method the loader does
    not read (all but GPT-OSS's MXFP4 experts and block-wise FP8 weights, which it dequantizes)."""
    quant = cfg.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if not (family == "gpt_oss" and method == "mxfp4") and method != "fp8":
            raise UnsupportedModel(f"quantization_config with quant_method {method!r} is not supported: the loader "
                                   "reads unquantized safetensors (and GPT-OSS's MXFP4 experts, block-wise FP8 "
                                   "weights); --quantization int8 quantizes float32 weights as they load")
    for key, fam, what in (("qk_layernorm", "stablelm", "q/k LayerNorms with a weight per head"),
                           ("qk_layernorm", "phi", "q/k LayerNorms")):
        if family == fam and cfg.get(key):
            raise UnsupportedModel(f"{key}: true ({what}) is not supported")
    if family == "phi" and cfg.get("tie_word_embeddings"):  # its lm_head's bias would have no module
        raise UnsupportedModel("tie_word_embeddings: true is not supported for PhiForCausalLM (its lm_head has a bias)")
    if family in ("deepseek_v2", "deepseek_v3") and cfg.get("attention_bias") and cfg.get("q_lora_rank", 1) is None:
        raise UnsupportedModel("attention_bias: true with q_lora_rank: null is not supported (q_proj has no bias, "
                               "kv_a_proj_with_mqa would)")
    if family == "deepseek_v2" and cfg.get("mlp_bias"):  # the shared experts would carry it too
        raise UnsupportedModel("mlp_bias: true is not supported for DeepseekV2ForCausalLM")
    if family == "olmoe" and cfg.get("clip_qkv") is not None:
        raise UnsupportedModel(f"clip_qkv: {cfg['clip_qkv']!r} (q, k and v clamped) is not supported; null is")
