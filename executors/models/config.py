"""DecoderConfig: the flags one decoder implementation needs, read from a HF config.json.

Accepts both the older keys (`rope_theta`, `rope_scaling`, `torch_dtype`,
`rope_local_base_freq`, `sliding_window_pattern`) and transformers 5's (`rope_parameters`,
`dtype`, `layer_types`). Anything the decoder cannot serve raises UnsupportedModel naming
the problem, at start-up rather than at the first request.

A family is a set of flags on the one decoder: mixtures of experts (moe_config.py) replace
the MLP of some layers; sliding windows, Gemma's norms, scaled embeddings, soft-capping and
per-layer rope bases are fields here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executors.models.errors import UnsupportedModel
from executors.models.moe_config import MoeConfig, moe_from_dict

__all__ = ["DecoderConfig", "MoeConfig", "RopeScaling", "UnsupportedModel"]

# architecture -> (family, q/k/v bias by default, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "MistralForCausalLM": ("mistral", False, False),
    "MixtralForCausalLM": ("mixtral", False, False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", True, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
    "Gemma3ForCausalLM": ("gemma3", False, True),
}
# Families whose every layer sees the same `sliding_window` (when the config sets one).
WINDOWED_FAMILIES = ("mistral", "mixtral")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Frequency scaling: Llama 3 style (kind "llama3") or linear position interpolation
    (kind "linear": every frequency divided by `factor`, as Gemma 3's global layers)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    architecture: str
    family: str  # llama, qwen2, qwen3
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
    dtype: str = "float32"  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts: which layers route to experts and how (None: a dense model).
    moe: MoeConfig | None = None
    # Sliding-window attention, per layer: a query at position p sees keys p-W+1..p; None
    # (or an empty tuple for every layer): all earlier keys.
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # sliding layers' rope base, where it differs (Gemma 3)
    # Gemma 3: RMSNorm weights stored as w - 1 (the norm multiplies by 1 + w), embeddings
    # scaled by sqrt(hidden), GELU-tanh MLPs, norms around attention's and the MLP's outputs,
    # an attention scale from query_pre_attn_scalar, optional tanh soft-capping of the final
    # logits. (Its attn_logit_softcapping is a Gemma 2 key that Gemma 3's reference
    # implementation does not apply; neither does this one.)
    norm_offset: float = 0.0
    embed_scale: float | None = None
    hidden_act: str = "silu"  # silu or gelu_tanh
    sandwich_norms: bool = False
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    final_softcap: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

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
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(
                f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}")
        family, default_qkv_bias, qk_norm = ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in cfg:
                raise UnsupportedModel(f"config.json lacks {key!r}, which {arch} needs")
            return cfg[key]

        if cfg.get("use_sliding_window"):
            raise UnsupportedModel(f"sliding-window attention (use_sliding_window: true) is not supported for {arch}")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModel("bidirectional attention (use_bidirectional_attention: true) is not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if family == "gemma3" else "silu")
        if act not in (GELU_TANH if family == "gemma3" else ("silu",)):
            raise UnsupportedModel(f"activation {act!r} is not supported for {arch}")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise UnsupportedModel(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        rope = cfg.get("rope_parameters") or {}
        local_rope = None
        if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5, per layer type
            local_rope = rope.get("sliding_attention") or {}
            rope = rope.get("full_attention") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        attention_bias = bool(cfg.get("attention_bias", default_qkv_bias))
        if family == "qwen2_moe":  # transformers 5 names it qkv_bias; Qwen2-MoE checkpoints have it
            attention_bias = bool(cfg.get("qkv_bias", True))
        gemma = family == "gemma3"
        windows = _layer_windows(cfg, family, int(need("num_hidden_layers")))
        local_theta = None
        if gemma:
            if local_rope and local_rope.get("rope_type", "default") != "default":
                raise UnsupportedModel(f"rope type {local_rope['rope_type']!r} on sliding layers is not supported")
            local_theta = float((local_rope or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o bias; Llama's and Gemma's attention_bias
            # covers all four.
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias if family in ("llama", "gemma3") else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            rope_scaling=_rope_scaling(scaling),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            moe=moe_from_dict(cfg, family, int(need("num_hidden_layers"))),
            layer_windows=windows,
            local_rope_theta=local_theta,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=hidden ** 0.5 if gemma else None,
            hidden_act="gelu_tanh" if gemma else "silu",
            sandwich_norms=gemma,
            attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5 if gemma else None,
            final_softcap=_positive(cfg, "final_logit_softcapping") if gemma else None,
            raw=cfg,
        )


def _positive(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise UnsupportedModel(f"{key} must be a positive number or null, got {value!r}")
    return float(value)


def _layer_windows(cfg: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global), or () when no layer has one."""
    window = cfg.get("sliding_window")
    if family in WINDOWED_FAMILIES:
        if window is None:
            return ()
        return (_window_size(window),) * layers
    if family != "gemma3":
        return ()  # Qwen: sliding windows only with use_sliding_window, refused above
    types = cfg.get("layer_types")
    if types is None:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise UnsupportedModel(f"layer_types lists {len(types)} layers, num_hidden_layers is {layers}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedModel(f"layer types {unknown} are not supported (only sliding_attention, full_attention)")
    if "sliding_attention" not in types:
        return ()
    size = _window_size(window)
    return tuple(size if t == "sliding_attention" else None for t in types)


def _window_size(window: Any) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UnsupportedModel(f"sliding_window must be a positive integer, got {window!r}")
    return window


def _rope_scaling(s: dict[str, Any] | None) -> RopeScaling | None:
    if not s:
        return None
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        if not isinstance(s.get("factor"), (int, float)) or s["factor"] <= 0:
            raise UnsupportedModel(f"linear rope scaling needs a positive factor, got {s.get('factor')!r}")
        return RopeScaling(factor=float(s["factor"]), kind="linear")
    if kind != "llama3":
        raise UnsupportedModel(f"rope scaling type {kind!r} is not supported (only llama3 and linear)")
    try:
        return RopeScaling(
            factor=float(s["factor"]),
            low_freq_factor=float(s["low_freq_factor"]),
            high_freq_factor=float(s["high_freq_factor"]),
            original_max_position_embeddings=int(s["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise UnsupportedModel(f"llama3 rope scaling lacks {e.args[0]!r}") from None
