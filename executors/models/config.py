"""DecoderConfig: the flags one decoder implementation needs, read from a HF config.json.

Accepts both the older keys (`rope_theta`, `rope_scaling`, `torch_dtype`,
`rope_local_base_freq`, `sliding_window_pattern`) and transformers 5's (`rope_parameters`,
`dtype`, `layer_types`). Anything the decoder cannot serve raises UnsupportedModel naming
the problem, at start-up rather than at the first request. A key the file omits takes its
family's transformers default (family_defaults.py), and the rope keys are read in transformers'
order of precedence.

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
from executors.models.family_defaults import FAMILY_DEFAULTS, FamilyDefaults
from executors.models.moe_config import MoeConfig, moe_from_dict

__all__ = ["DecoderConfig", "MoeConfig", "RopeScaling", "UnsupportedModel"]

# architecture -> (family, per-head q/k RMSNorm); biases and defaults: family_defaults.py
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", True),
    "MistralForCausalLM": ("mistral", False),
    "MixtralForCausalLM": ("mixtral", False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", True),
    "Gemma3ForCausalLM": ("gemma3", True),
    "Phi3ForCausalLM": ("phi3", False),
}
# Families whose every layer sees the same `sliding_window` (when the config sets one).
WINDOWED_FAMILIES = ("mistral", "mixtral", "phi3")
# Families whose checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj.
FUSED_CHECKPOINT_FAMILIES = ("phi3",)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")


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
    # Phi-3: the checkpoint holds q/k/v as one qkv_proj and gate/up as one gate_up_proj, which
    # the loader splits into the decoder's parameters (checkpoint_sections.py).
    fused_checkpoint: bool = False
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
        family, qk_norm = ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in cfg:
                raise UnsupportedModel(f"config.json lacks {key!r}, which {arch} needs")
            return cfg[key]

        defaults = FAMILY_DEFAULTS[family]
        if cfg.get("use_sliding_window"):
            raise UnsupportedModel(f"sliding-window attention (use_sliding_window: true) is not supported for {arch}")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModel("bidirectional attention (use_bidirectional_attention: true) is not supported")
        # Only the family's own key: transformers' Llama ignores a hidden_activation, Gemma 3 a hidden_act.
        act = cfg.get(defaults.activation_key, defaults.activation)
        if act not in (GELU_TANH if family == "gemma3" else ("silu",)):
            raise UnsupportedModel(f"activation {act!r} ({defaults.activation_key}) is not supported for {arch}")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        # A missing key here falls back to the checkpoint's own shape, not transformers' class
        # default: a wrong guess is refused by the loader's shape check, never served.
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise UnsupportedModel(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        max_positions = int(cfg.get("max_position_embeddings", defaults.max_position_embeddings))
        theta, scaling, local_theta = _read_rope(cfg, family, defaults, max_positions)
        eos = cfg.get("eos_token_id")
        if defaults.attention_bias_key is None:
            attention_bias = defaults.attention_bias
        else:
            attention_bias = bool(cfg.get(defaults.attention_bias_key, defaults.attention_bias))
        gemma = family == "gemma3"
        windows = _layer_windows(cfg, family, defaults, int(need("num_hidden_layers")))
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
            rms_norm_eps=_number(cfg, "rms_norm_eps", defaults.rms_norm_eps),
            rope_theta=theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", defaults.tie_word_embeddings)),
            qkv_bias=attention_bias,
            o_bias=attention_bias and defaults.o_proj_bias,
            mlp_bias=bool(cfg.get(defaults.mlp_bias_key, False)) if defaults.mlp_bias_key else False,
            qk_norm=qk_norm,
            rope_scaling=scaling,
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
            attn_scale=_number(cfg, "query_pre_attn_scalar", defaults.query_pre_attn_scalar) ** -0.5 if gemma else None,
            final_softcap=_positive(cfg, "final_logit_softcapping") if gemma else None,
            fused_checkpoint=family in FUSED_CHECKPOINT_FAMILIES,
            raw=cfg,
        )


def _positive(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise UnsupportedModel(f"{key} must be a positive number or null, got {value!r}")
    return float(value)


def _number(cfg: dict[str, Any], key: str, default: float | None) -> float:
    """cfg[key], or the family's default when the key is absent; a positive number either way."""
    value = cfg.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModel(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _layer_windows(cfg: dict[str, Any], family: str, defaults: FamilyDefaults, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global), or () when no layer has one."""
    window = cfg.get("sliding_window", defaults.sliding_window)  # null in the file: no window
    if family in WINDOWED_FAMILIES:
        if window is None:
            return ()
        return (_window_size(window),) * layers
    if family != "gemma3":
        return ()  # Qwen: sliding windows only with use_sliding_window, refused above
    types = cfg.get("layer_types")
    if types is None:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = cfg.get("sliding_window_pattern", defaults.sliding_window_pattern)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise UnsupportedModel(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
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


def _read_rope(cfg: dict[str, Any], family: str, defaults: FamilyDefaults,
               max_positions: int) -> tuple[float, RopeScaling | None, float | None]:
    """(rope theta, its scaling, the sliding layers' theta where it differs), as transformers 5's
    config classes read them (convert_rope_params_to_dict, standardize_rope_params)."""
    if family == "gemma3":
        return _read_gemma3_rope(cfg, defaults, max_positions)
    # A rope_scaling, when set, is the whole rope config: rope_parameters beside it is dropped.
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = _rope_dict(cfg.get(where) or {}, where)
    nested = [k for k in LAYER_TYPE_KEYS if k in rope]
    if nested:  # transformers ignores them on these families (or fails to build the model)
        raise UnsupportedModel(f"rope_parameters per layer type ({', '.join(nested)}) is only read for Gemma 3")
    theta = _number(rope, "rope_theta", cfg.get("rope_theta", defaults.rope_theta))
    if family == "phi3":
        _check_phi3_rope(cfg, rope, where)
    # A top-level original_max_position_embeddings (Phi-3's place for it) overrides the nested one.
    if "original_max_position_embeddings" in cfg:
        rope = {**rope, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    return theta, _rope_scaling(rope, where, max_positions), None


def _check_phi3_rope(cfg: dict[str, Any], rope: dict[str, Any], where: str) -> None:
    """Phi3Config accepts only the default rope and longrope (su, yarn: older names for it),
    and rotates partial_rotary_factor of each head (Phi-4-mini: 0.75)."""
    kind = _rope_kind(rope, where)
    if kind != "default":
        raise UnsupportedModel(f"Phi-3 rope type {kind!r} ({where}) is not supported; only the default rope "
                               f"(longrope, su and yarn are not)")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModel(f"partial_rotary_factor {partial!r} is not supported; only rotary embeddings over "
                               f"the whole head (1.0)")


def _read_gemma3_rope(cfg: dict[str, Any], defaults: FamilyDefaults,
                      max_positions: int) -> tuple[float, RopeScaling | None, float]:
    """Gemma3TextConfig's own reading: rope_parameters per layer type, a legacy rope_scaling
    merged over the full-attention one, rope_theta / rope_local_base_freq as the bases."""
    per_type = _rope_dict(cfg.get("rope_parameters") or {}, "rope_parameters")
    flat = sorted(set(per_type) - set(LAYER_TYPE_KEYS))
    if flat:  # transformers silently ignores these on Gemma 3
        raise UnsupportedModel(f"Gemma 3 rope_parameters must be per layer type (full_attention, sliding_attention); "
                               f"flat keys {flat} are not supported")
    full = dict(_rope_dict(per_type.get("full_attention") or {"rope_type": "default"}, "full_attention"))
    if cfg.get("rope_scaling") is not None:
        full.update(_rope_dict(cfg["rope_scaling"], "rope_scaling"))
    local = _rope_dict(per_type.get("sliding_attention") or {"rope_type": "default"}, "sliding_attention")
    local_kind = _rope_kind(local, "sliding_attention")
    if local_kind != "default":
        raise UnsupportedModel(f"rope type {local_kind!r} on sliding layers is not supported")
    theta = _number(full, "rope_theta", cfg.get("rope_theta", defaults.rope_theta))
    local_theta = _number(local, "rope_theta", cfg.get("rope_local_base_freq", defaults.local_rope_theta))
    return theta, _rope_scaling(full, "full_attention rope (with rope_scaling over it)", max_positions), local_theta


def _rope_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UnsupportedModel(f"{where} must be an object, got {value!r}")
    return value


def _rope_kind(s: dict[str, Any], where: str) -> str:
    """rope_type, or the legacy key type when rope_type is absent (transformers' order)."""
    kind = s.get("rope_type", s.get("type", "default"))
    if "type" in s and s["type"] != kind:
        raise UnsupportedModel(f"{where}: rope_type {kind!r} and the legacy type {s['type']!r} disagree")
    return kind


def _rope_scaling(s: dict[str, Any], where: str, max_positions: int) -> RopeScaling | None:
    kind = _rope_kind(s, where)
    if kind == "default":
        return None
    if kind == "linear":
        factor = s.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise UnsupportedModel(f"linear rope scaling needs a positive factor, got {factor!r}")
        return RopeScaling(factor=float(factor), kind="linear")
    if kind != "llama3":
        raise UnsupportedModel(f"rope scaling type {kind!r} is not supported (only llama3 and linear)")
    try:
        return RopeScaling(
            factor=float(s["factor"]),
            low_freq_factor=float(s["low_freq_factor"]),
            high_freq_factor=float(s["high_freq_factor"]),
            original_max_position_embeddings=int(s.get("original_max_position_embeddings", max_positions)),
        )
    except KeyError as e:
        raise UnsupportedModel(f"llama3 rope scaling lacks {e.args[0]!r}") from None
    except (TypeError, ValueError):
        raise UnsupportedModel(f"llama3 rope scaling has a non-numeric field: {s!r}") from None
