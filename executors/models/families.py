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
}
# The projections each family's checkpoints store fused: Phi-3's q/k/v as one qkv_proj and
# gate/up as one gate_up_proj, GLM-4's gate/up.
FUSED_CHECKPOINT = {"phi3": ("qkv_proj", "gate_up_proj"), "glm4": ("gate_up_proj",)}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")  # (1 + w) norms, scaled embeddings, GELU-tanh
SANDWICH_FAMILIES = ("gemma2", "gemma3")  # and norms around attention's and the MLP's outputs, a query scalar, caps
# Families that norm attention's and the MLP's outputs only, no inputs (EXAONE 4's q/k norms
# are per head, OLMo's span every head).
POST_NORM_FAMILIES = ("olmo2", "olmo3", "exaone4")
OLMO_FAMILIES = ("olmo2", "olmo3", "olmoe")  # q/k norms over every head (OLMoE's with pre-norms)
# LayerNorms (the mean subtracted) in place of RMSNorms; StableLM's with a bias.
LAYER_NORM_FAMILIES = ("cohere", "cohere2", "stablelm", "starcoder2", "phi")
UNGATED_FAMILIES = ("starcoder2", "phi")  # down(act(up(x))), GELU-tanh (Phi's gelu_new)
COHERE_FAMILIES = ("cohere", "cohere2")  # parallel attention and MLP, logits scaled, pairs interleaved


def refuse_unserved_options(cfg: dict[str, Any], family: str) -> None:
    """Options that change the layer in ways the decoder does not compute: q/k LayerNorms
    (Command R+'s and StableLM 2 12B's with a weight per head, Phi's), a tied lm_head beside
    Phi's lm_head bias, OLMoE's clipped q/k/v."""
    for key, fam, what in (("use_qk_norm", "cohere", "q/k LayerNorms with a weight per head"),
                           ("qk_layernorm", "stablelm", "q/k LayerNorms with a weight per head"),
                           ("qk_layernorm", "phi", "q/k LayerNorms")):
        if family == fam and cfg.get(key):
            raise UnsupportedModel(f"{key}: true ({what}) is not supported")
    if family == "phi" and cfg.get("tie_word_embeddings"):  # its lm_head's bias would have no module
        raise UnsupportedModel("tie_word_embeddings: true is not supported for PhiForCausalLM (its lm_head has a bias)")
    if family == "olmoe" and cfg.get("clip_qkv") is not None:
        raise UnsupportedModel(f"clip_qkv: {cfg['clip_qkv']!r} (q, k and v clamped) is not supported; null is")
