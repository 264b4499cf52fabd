"""DecoderConfig: the flags one decoder implementation needs, read from a HF config.json.

Accepts both the older keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and transformers
5's (`rope_parameters`, `dtype`). Anything the decoder cannot serve raises
UnsupportedModel naming the problem, at start-up rather than at the first request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class UnsupportedModel(ValueError):
    """A model directory or config this decoder cannot serve."""


# architecture -> (family, q/k/v bias by default, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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
            raise UnsupportedModel("sliding-window attention (use_sliding_window: true) is not supported")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise UnsupportedModel(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        attention_bias = bool(cfg.get("attention_bias", default_qkv_bias))
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
            # Qwen2 always has q/k/v bias and no o bias; Llama's attention_bias covers all four.
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias if family == "llama" else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            rope_scaling=_rope_scaling(scaling),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            raw=cfg,
        )


def _rope_scaling(s: dict[str, Any] | None) -> RopeScaling | None:
    if not s:
        return None
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModel(f"rope scaling type {kind!r} is not supported (only llama3)")
    try:
        return RopeScaling(
            factor=float(s["factor"]),
            low_freq_factor=float(s["low_freq_factor"]),
            high_freq_factor=float(s["high_freq_factor"]),
            original_max_position_embeddings=int(s["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise UnsupportedModel(f"llama3 rope scaling lacks {e.args[0]!r}") from None
