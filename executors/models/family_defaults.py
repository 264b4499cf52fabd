"""Per family: the value of each config.json key the loader reads when the file omits it, and
which projections carry a bias, as transformers 5 has them.

Copied as constants from transformers' config classes (LlamaConfig, ..., Gemma3TextConfig:
their field defaults and `default_theta`) and modeling code (which nn.Linear gets `bias=`),
because serving must not import transformers; tests/models/test_config_fidelity.py compares
this table with those classes so that it cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FamilyDefaults:
    rope_theta: float  # the class's default_theta (Gemma 3: its global layers')
    rms_norm_eps: float  # the norms' epsilon, under norm_eps_key
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # read only where the family applies it (layer_kinds.py)
    activation_key: str = "hidden_act"  # the one key the family's MLP reads its activation from
    activation: str = "silu"
    # q/k/v bias: switched by this key (None: fixed at attention_bias, whatever the config says).
    attention_bias_key: str | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False  # o_proj carries the bias whenever q/k/v do
    o_proj_bias_key: str | None = None  # Seed-OSS: o_proj's bias switched by a key of its own
    mlp_bias_key: str | None = None  # None: the MLP never has a bias
    mlp_bias: bool = False  # where the file omits mlp_bias_key (StarCoder2's use_bias: on), or always (Phi)
    # Gemma only (and OLMo 3's sliding_window_pattern).
    local_rope_theta: float | None = None  # Gemma 3's sliding layers
    query_pre_attn_scalar: float | None = None
    sliding_window_pattern: int | None = None  # without layer_types: every n-th layer is global
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # applied on Gemma 2 only (config.py)
    norm_eps_key: str = "rms_norm_eps"  # the LayerNorm families': layer_norm_eps
    logit_scale: float | None = None  # Cohere: the logits times this


FAMILY_DEFAULTS = {
    "llama": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                            attention_bias_key="attention_bias", o_proj_bias=True, mlp_bias_key="mlp_bias"),
    "mistral": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
                              sliding_window=4096),
    "ministral": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
                                sliding_window=4096),
    "mixtral": FamilyDefaults(rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "qwen2": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                            sliding_window=4096, attention_bias=True),
    "qwen3": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                            sliding_window=4096, attention_bias_key="attention_bias", o_proj_bias=True),
    "qwen2_moe": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                sliding_window=4096, attention_bias_key="qkv_bias", attention_bias=True),
    "qwen3_moe": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                sliding_window=4096, attention_bias_key="attention_bias", o_proj_bias=True),
    "phi3": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "granite": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                              attention_bias_key="attention_bias", o_proj_bias=True, mlp_bias_key="mlp_bias"),
    "granitemoe": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                                 attention_bias_key="attention_bias", o_proj_bias=True),
    "granitemoeshared": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                                       attention_bias_key="attention_bias", o_proj_bias=True),
    "olmo2": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
                            attention_bias_key="attention_bias", o_proj_bias=True),
    "helium": FamilyDefaults(rope_theta=100000.0, rms_norm_eps=1e-8, max_position_embeddings=4096,
                             attention_bias_key="attention_bias", mlp_bias_key="mlp_bias"),
    "seed_oss": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=524288,
                               attention_bias_key="attention_bias", attention_bias=True,
                               o_proj_bias_key="attention_out_bias", mlp_bias_key="mlp_bias"),
    "glm4": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1.5625e-07, max_position_embeddings=131072,
                           attention_bias_key="attention_bias", attention_bias=True),
    "exaone4": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
                              sliding_window=4096, sliding_window_pattern=4),
    "olmo3": FamilyDefaults(rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
                            sliding_window=4096, attention_bias_key="attention_bias", o_proj_bias=True,
                            sliding_window_pattern=4),
    "smollm3": FamilyDefaults(rope_theta=2e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                              tie_word_embeddings=True, attention_bias_key="attention_bias", o_proj_bias=True,
                              mlp_bias_key="mlp_bias"),
    "cohere": FamilyDefaults(rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                             tie_word_embeddings=True, attention_bias_key="attention_bias", o_proj_bias=True,
                             norm_eps_key="layer_norm_eps", logit_scale=0.0625),
    "cohere2": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                              tie_word_embeddings=True, sliding_window=4096, attention_bias_key="attention_bias",
                              o_proj_bias=True, sliding_window_pattern=4, norm_eps_key="layer_norm_eps",
                              logit_scale=0.0625),
    "stablelm": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                               attention_bias_key="use_qkv_bias", norm_eps_key="layer_norm_eps"),
    "starcoder2": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                                 tie_word_embeddings=True, activation="gelu_pytorch_tanh", attention_bias_key="use_bias",
                                 attention_bias=True, o_proj_bias=True, mlp_bias_key="use_bias", mlp_bias=True,
                                 norm_eps_key="norm_epsilon"),
    "olmoe": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                            attention_bias_key="attention_bias", o_proj_bias=True),
    "phi": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
                          activation="gelu_new", attention_bias=True, o_proj_bias=True, mlp_bias=True,
                          norm_eps_key="layer_norm_eps"),
    "glm4_moe": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                               attention_bias_key="attention_bias"),
    "gpt_oss": FamilyDefaults(rope_theta=150000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                              sliding_window=128, attention_bias_key="attention_bias", attention_bias=True,
                              o_proj_bias=True, sliding_window_pattern=2),
    "deepseek_v2": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                                  attention_bias_key="attention_bias", o_proj_bias=True, mlp_bias_key="mlp_bias"),
    "deepseek_v3": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
                                  attention_bias_key="attention_bias", o_proj_bias=True),
    "minimax_m2": FamilyDefaults(rope_theta=5000000.0, rms_norm_eps=1e-6, max_position_embeddings=196608),
    "gemma": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192,
                            tie_word_embeddings=True, activation="gelu_pytorch_tanh",
                            attention_bias_key="attention_bias", o_proj_bias=True),
    "gemma2": FamilyDefaults(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192,
                             tie_word_embeddings=True, sliding_window=4096, activation_key="hidden_activation",
                             activation="gelu_pytorch_tanh", attention_bias_key="attention_bias", o_proj_bias=True,
                             query_pre_attn_scalar=256, sliding_window_pattern=2, final_logit_softcapping=30.0,
                             attn_logit_softcapping=50.0),
    "gemma3": FamilyDefaults(rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=131072,
                             tie_word_embeddings=True, sliding_window=4096, activation_key="hidden_activation",
                             activation="gelu_pytorch_tanh", attention_bias_key="attention_bias", o_proj_bias=True,
                             local_rope_theta=10000.0, query_pre_attn_scalar=256, sliding_window_pattern=6),
}
