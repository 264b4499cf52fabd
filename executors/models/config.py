"""DecoderConfig: the flags one decoder implementation needs, read from a HF config.json.

Accepts both the older keys (`rope_theta`, `rope_scaling`, `torch_dtype`,
`rope_local_base_freq`, `sliding_window_pattern`) and transformers 5's (`rope_parameters`,
`dtype`, `layer_types`). Anything the decoder cannot serve raises UnsupportedModel naming
the problem, at start-up rather than at the first request. A key the file omits takes its
family's transformers default (family_defaults.py), and the rope keys are read in transformers'
order of precedence (rope_config.py).

A family is a set of flags on the one decoder: mixtures of experts (moe_config.py) replace
the MLP of some layers; each layer's window and whether it rotates at all (NoPE layers)
are read in layer_kinds.py; Gemma's norms, scaled embeddings, soft-capping,
per-layer rope bases, partial rotary embeddings and Phi-3's fused checkpoint projections
are fields here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executors.models.errors import UnsupportedModel
from executors.models.families import (
    ACROSS_HEADS_QK_NORM_FAMILIES,
    ARCHITECTURES,
    COHERE_FAMILIES,
    FUSED_CHECKPOINT,
    GELU_TANH,
    GEMMA_FAMILIES,
    GPT_OSS_ROPE,
    GRANITE_FAMILIES,
    LAYER_NORM_FAMILIES,
    MULTIMODAL_TEXT,
    POST_NORM_FAMILIES,
    SANDWICH_FAMILIES,
    UNGATED_FAMILIES,
    refuse_unserved_options,
    text_config,
)
from executors.models.family_defaults import FAMILY_DEFAULTS
from executors.models.fp8_blocks import block_size
from executors.models.layer_kinds import layer_kinds
from executors.models.mla_config import MlaConfig, mla_from_dict
from executors.models.moe_config import MoeConfig, moe_from_dict
from executors.models.rope_config import RopeScaling, positive_number, read_rope, rotary_dim_of

__all__ = ["ARCHITECTURES", "DecoderConfig", "MlaConfig", "MoeConfig", "RopeScaling", "UnsupportedModel"]

@dataclass(frozen=True, slots=True)
class DecoderConfig:
    architecture: str
    family: str  # a value of ARCHITECTURES: llama, qwen2, qwen3, ..., gemma, gemma2, gemma3, phi3, granite, smollm3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q, k and v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before RoPE
    rope_scaling: RopeScaling | None = None
    # Phi-4-mini: only the first rotary_dim dimensions of each head rotate (partial_rotary_factor);
    # None: all of them. The loader reorders q's and k's head dimensions (partial_rotary.py).
    rotary_dim: int | None = None
    dtype: str = "float32"  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts: which layers route to experts and how (None: a dense model).
    moe: MoeConfig | None = None
    # Sliding-window attention, per layer: a query at position p sees keys p-W+1..p; None
    # (or an empty tuple for every layer): all earlier keys.
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # sliding layers' rope base, where it differs (Gemma 3)
    # The layers whose q and k are not rotated (NoPE: SmolLM3's, EXAONE 4's global ones); ()
    # where every layer rotates.
    nope_layers: tuple[int, ...] = ()
    # Gemma: RMSNorm weights stored as w - 1 (the norm multiplies by 1 + w), embeddings
    # scaled by sqrt(hidden), GELU-tanh MLPs; Gemma 2 and 3 also norms around attention's and the
    # MLP's outputs, an attention scale from query_pre_attn_scalar, optional tanh
    # soft-capping of the final logits and (Gemma 2) of the attention scores. (Gemma 3's
    # reference implementation does not apply an attn_logit_softcapping; neither does this.)
    norm_offset: float = 0.0
    embed_scale: float | None = None
    hidden_act: str = "silu"  # silu or gelu_tanh
    sandwich_norms: bool = False
    # OLMo 2 and 3, EXAONE 4: no norm before attention or the MLP, only the output norms of
    # sandwich_norms; OLMo's q_norm / k_norm over every head's dimensions at once (weights
    # [H * D] and [KVH * D]), where Qwen3's, Gemma 3's and EXAONE's norm each head alone ([D]).
    pre_norms: bool = True
    qk_norm_across_heads: bool = False
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    final_softcap: float | None = None
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    # Phi-3: the checkpoint holds q/k/v as one qkv_proj and gate/up as one gate_up_proj (GLM-4:
    # gate_up_proj), which the loader splits into the decoder's parameters (checkpoint_sections.py).
    fused_checkpoint: tuple[str, ...] = ()
    # GLM-4, Helium: rotary pairs are neighbouring dimensions (2i, 2i + 1), not i and i + D/2; the
    # loader reorders q's and k's dimensions into the NeoX pairs every path rotates
    # (partial_rotary.py).
    rope_interleaved: bool = False
    # Granite: each attention and MLP output is scaled before its residual add (folded into
    # o_proj and down_proj as they load, served_tensors.py), the logits divided by this.
    residual_scale: float | None = None
    logits_divisor: float | None = None  # Cohere's logit_scale too, as its inverse
    # Cohere, Cohere 2, StableLM, StarCoder2 and Phi: LayerNorms (the mean subtracted, in
    # float32) where the others have RMSNorms (rms_norm_eps is then their epsilon), with a bias
    # on all but Cohere's.
    layer_norm: bool = False
    norm_bias: bool = False
    # Cohere, Cohere 2, Phi, StableLM with use_parallel_residual: attention and the MLP both read
    # the input norm's output, and both add to the residual: x + attn(h) + mlp(h), no second norm.
    parallel_residual: bool = False
    # StarCoder2, Phi: an ungated MLP, down(act(up(x))) (c_fc and c_proj, fc1 and fc2 in their
    # checkpoints); gate_up is then up's weight alone ([I, hidden]).
    mlp_gated: bool = True
    lm_head_bias: bool = False  # Phi: the logits plus a bias per token
    # GPT-OSS: each attention layer's `sinks`, a logit per query head that its softmax also
    # normalises over (a key with no value), so a head can attend to nothing.
    attention_sinks: bool = False
    # The text model of a multimodal checkpoint (`architecture` names the whole; the loader
    # reads language_model.* under the decoder's names and skips the vision tower).
    multimodal: bool = False
    # DeepSeek V2 and V3: multi-head latent attention (mla_config.py, mla.py). head_dim is then a
    # cached latent row's width and num_kv_heads 1: what the pool and the attention paths see.
    mla: MlaConfig | None = None
    # Block-wise FP8 checkpoints (DeepSeek V3's, Qwen3's FP8 releases): the (rows, columns) of
    # each scale's block, dequantized as the weights load (fp8_blocks.py); None: unquantized.
    fp8_block: tuple[int, int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def rotates(self, layer: int) -> bool:
        """Whether the layer applies rotary embeddings to q and k (not on a NoPE layer)."""
        return layer not in self.nope_layers

    def rope_view(self) -> DecoderConfig:
        """The config the rotary tables are built from: MLA rotates the qk_rope_head_dim
        dimensions of its queries and its shared key, not the latent rows."""
        if self.mla is None:
            return self
        return dataclasses.replace(self, head_dim=self.mla.qk_rope_head_dim, rotary_dim=None, rope_interleaved=False)

    @property
    def values_are_keys(self) -> bool:
        """The cached rows are their own values (MLA's latent rows): the pool holds K alone."""
        return self.mla is not None

    @property
    def all_layers_sliding(self) -> bool:
        """Every layer has a window: positions that left it are read by none."""
        return bool(self.layer_windows) and all(w is not None for w in self.layer_windows)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> DecoderConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModel(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise UnsupportedModel(f"{path}: not valid JSON: {e}") from None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DecoderConfig:
        archs = cfg.get("architectures") or []
        wrapper = next((a for a in archs if a in MULTIMODAL_TEXT), None)
        if wrapper is not None:  # Gemma 3 4B-27B, Mistral Small 3.1: their text model
            cfg = text_config(cfg, wrapper)
            archs = cfg["architectures"]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(
                f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join([*ARCHITECTURES, *MULTIMODAL_TEXT])}")
        family, qk_norm = ARCHITECTURES[arch]
        # GLM-4.5's per-head q/k RMSNorms, Command R+'s q/k LayerNorms (a weight row per head)
        qk_norm = qk_norm or (family in ("glm4_moe", "cohere") and bool(cfg.get("use_qk_norm")))

        def need(key: str) -> Any:
            if key not in cfg:
                raise UnsupportedModel(f"config.json lacks {key!r}, which {arch} needs")
            return cfg[key]

        defaults = FAMILY_DEFAULTS[family]
        if family == "gpt_oss" and not cfg.get("rope_scaling") and not cfg.get("rope_parameters"):
            cfg = {**cfg, "rope_parameters": GPT_OSS_ROPE}  # as GptOssConfig defaults it
        if cfg.get("use_sliding_window") and family != "smollm3":
            raise UnsupportedModel(f"sliding-window attention (use_sliding_window: true) is not supported for {arch}")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModel("bidirectional attention (use_bidirectional_attention: true) is not supported")
        # Only the family's own key: transformers' Llama ignores a hidden_activation, Gemma 3 a hidden_act.
        act = cfg.get(defaults.activation_key, defaults.activation)
        if family == "gemma" and act == "gelu":  # GemmaConfig: the official files' legacy name for GELU-tanh
            act = "gelu_pytorch_tanh"
        allowed = (*GELU_TANH, "gelu_new") if family == "phi" else GELU_TANH if family in (
            *GEMMA_FAMILIES, "starcoder2") else ("silu",)
        if act not in allowed:
            raise UnsupportedModel(f"activation {act!r} ({defaults.activation_key}) is not supported for {arch}")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        # A missing key here falls back to the checkpoint's own shape, not transformers' class
        # default: a wrong guess is refused by the loader's shape check, never served.
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        mla = mla_from_dict(cfg, family)  # (whose one KV head is its latent rows: num_key_value_heads not read)
        if heads % kv_heads and mla is None:
            raise UnsupportedModel(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        max_positions = int(cfg.get("max_position_embeddings", defaults.max_position_embeddings))
        if mla is None:
            rotary_dim = rotary_dim_of(cfg, family, head_dim)
            rotated = rotary_dim or head_dim
        else:  # the pool holds one latent row a token; the rotation is of the rope dimensions alone
            head_dim, kv_heads, rotary_dim, rotated = mla.latent_dim, 1, None, mla.qk_rope_head_dim
        theta, scaling, local_theta = read_rope(cfg, family, defaults, max_positions, rotated)
        if scaling is not None and scaling.kind == "yarn":
            # YaRN stretches the original context by its factor: the positions it is made for
            # (Qwen3's model cards set 4 x 32768 over a max_position_embeddings of 40960), as
            # vLLM derives such a model's length; transformers rotates any position alike.
            max_positions = max(max_positions, int(scaling.original_max_position_embeddings * scaling.factor))
        eos = cfg.get("eos_token_id")
        if defaults.attention_bias_key is None:
            attention_bias = defaults.attention_bias
        else:
            attention_bias = bool(cfg.get(defaults.attention_bias_key, defaults.attention_bias))
        gemma, sandwich = family in GEMMA_FAMILIES, family in SANDWICH_FAMILIES

        def granite(key: str) -> float | None:
            """Granite's multipliers (1.0 when absent, as GraniteConfig has them); None elsewhere."""
            return positive_number(cfg, key, 1.0) if family in GRANITE_FAMILIES else None

        refuse_unserved_options(cfg, family)
        layers = int(need("num_hidden_layers"))
        windows, rotation = layer_kinds(cfg, family, defaults, layers, max_positions)
        return cls(
            architecture=wrapper or arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=positive_number(cfg, defaults.norm_eps_key, defaults.rms_norm_eps),
            rope_theta=theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", defaults.tie_word_embeddings)),
            qkv_bias=attention_bias,
            o_bias=(bool(cfg.get(defaults.o_proj_bias_key, False)) if defaults.o_proj_bias_key
                    else attention_bias and defaults.o_proj_bias),
            mlp_bias=(bool(cfg.get(defaults.mlp_bias_key, defaults.mlp_bias)) if defaults.mlp_bias_key
                      else defaults.mlp_bias),
            qk_norm=qk_norm,
            rope_scaling=scaling,
            rotary_dim=rotary_dim,
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            moe=moe_from_dict(cfg, family, layers),
            layer_windows=windows,
            local_rope_theta=local_theta,
            nope_layers=tuple(i for i, rotates in enumerate(rotation) if not rotates),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=hidden ** 0.5 if gemma else granite("embedding_multiplier"),
            hidden_act="gelu_tanh" if gemma or family in UNGATED_FAMILIES else "silu",
            sandwich_norms=sandwich or family in POST_NORM_FAMILIES or family == "glm4",
            pre_norms=family not in POST_NORM_FAMILIES,
            qk_norm_across_heads=family in ACROSS_HEADS_QK_NORM_FAMILIES,
            attn_scale=(positive_number(cfg, "query_pre_attn_scalar", defaults.query_pre_attn_scalar) ** -0.5
                        if sandwich else mla.score_scale(scaling) if mla is not None
                        else granite("attention_multiplier")),
            final_softcap=(_positive(cfg, "final_logit_softcapping", defaults.final_logit_softcapping) if sandwich
                           else None),
            attn_softcap=(_positive(cfg, "attn_logit_softcapping", defaults.attn_logit_softcapping)
                          if family == "gemma2" else None),
            fused_checkpoint=FUSED_CHECKPOINT.get(family, ()),
            rope_interleaved=family in ("glm4", "helium", *COHERE_FAMILIES),
            residual_scale=granite("residual_multiplier"),
            logits_divisor=(1 / positive_number(cfg, "logit_scale", defaults.logit_scale) if family in COHERE_FAMILIES
                            else granite("logits_scaling")),
            layer_norm=family in LAYER_NORM_FAMILIES,
            norm_bias=family in ("stablelm", "starcoder2", "phi"),
            parallel_residual=family in (*COHERE_FAMILIES, "phi") or bool(family == "stablelm"
                                                                          and cfg.get("use_parallel_residual")),
            mlp_gated=family not in UNGATED_FAMILIES,
            lm_head_bias=family == "phi",
            attention_sinks=family == "gpt_oss",
            multimodal=wrapper is not None,
            mla=mla,
            fp8_block=block_size(cfg),
            raw=cfg,
        )


def _positive(cfg: dict[str, Any], key: str, default: float | None = None) -> float | None:
    value = cfg.get(key, default)  # null in the file: none
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise UnsupportedModel(f"{key} must be a positive number or null, got {value!r}")
    return float(value)
