"""Reading a config.json's rotary embedding as transformers 5 reads it: the base, the scaling
(Llama 3, linear, LongRoPE, YaRN), the sliding layers' own base (Gemma 3) and how much of a head
rotates (Phi-3's partial_rotary_factor). A setting transformers would ignore or refuse is
refused with UnsupportedModel naming it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from executors.models.errors import UnsupportedModel
from executors.models.family_defaults import FamilyDefaults

LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")
PER_LAYER_TYPE_FAMILIES = ("gemma3", "olmo3")  # rope_parameters per layer type
PARTIAL_ROTARY_DEFAULTS = {"phi3": 1.0, "glm4": 0.5, "stablelm": 0.25, "phi": 0.5, "glm4_moe": 0.5,
                           "minimax_m2": 1.0}  # families reading partial_rotary_factor, its default


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Frequency scaling: Llama 3 style (kind "llama3"), linear position interpolation (kind
    "linear": every frequency divided by `factor`, as Gemma 3's global layers), LongRoPE
    (kind "longrope", Phi-3.5 and Phi-4-mini: each frequency divided by its short_factor at
    positions below original_max_position_embeddings and by its long_factor from there on,
    cos and sin times attention_factor), or YaRN (kind "yarn", Qwen's and OLMo 3's long
    contexts: the frequencies slower than beta_slow turns over the original context divided
    by `factor`, those faster than beta_fast kept, a linear ramp between; cos and sin times
    attention_factor)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0  # YaRN's ramp: turns over the original context
    beta_slow: float = 1.0
    truncate: bool = True  # YaRN: the ramp's ends rounded outwards to whole dimensions
    # DeepSeek's YaRN: yarn_mscale(factor, mscale_all_dim) squared scales MLA's scores (None: not given)
    mscale_all_dim: float | None = None


def yarn_mscale(factor: float, scale: float) -> float:
    """YaRN's magnitude correction of a context stretched `factor` times: 0.1 scale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def positive_number(cfg: dict[str, Any], key: str, default: float | None) -> float:
    """cfg[key], or the family's default when the key is absent; a positive number either way."""
    value = cfg.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModel(f"{key} must be a positive number, got {value!r}")
    return float(value)


def read_rope(cfg: dict[str, Any], family: str, defaults: FamilyDefaults, max_positions: int,
              rotary_dim: int) -> tuple[float, RopeScaling | None, float | None]:
    """(rope theta, its scaling, the sliding layers' theta where it differs), as transformers 5's
    config classes read them (convert_rope_params_to_dict, standardize_rope_params)."""
    if family in PER_LAYER_TYPE_FAMILIES:
        return _read_per_layer_type_rope(cfg, family, defaults, max_positions, rotary_dim)
    where, rope = _rope_source(cfg)
    nested = [k for k in LAYER_TYPE_KEYS if k in rope]
    if nested:  # transformers ignores them on these families (or fails to build the model)
        raise UnsupportedModel(f"rope_parameters per layer type ({', '.join(nested)}) is only read for Gemma 3")
    theta = positive_number(rope, "rope_theta", cfg.get("rope_theta", defaults.rope_theta))
    if family == "phi3":
        rope = _phi3_rope(rope, where)
    # A top-level original_max_position_embeddings (Phi-3's place for it) overrides the nested one.
    if "original_max_position_embeddings" in cfg:
        rope = {**rope, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    return theta, _rope_scaling(rope, where, max_positions, rotary_dim, rope.get("truncate", True)), None


def _rope_source(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(its key, the rope config): a rope_scaling, when set, is the whole rope config, and a
    rope_parameters beside it is dropped."""
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    return where, _rope_dict(cfg.get(where) or {}, where)


def _phi3_rope(rope: dict[str, Any], where: str) -> dict[str, Any]:
    """Phi3Config's reading: the default rope or longrope, whose older names su and yarn it
    renames (a Phi-3 "yarn" is LongRoPE, not YaRN)."""
    kind = _rope_kind(rope, where)
    if kind in ("su", "yarn"):
        return {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "longrope"}
    if kind not in ("default", "longrope"):
        raise UnsupportedModel(f"Phi-3 rope type {kind!r} ({where}) is not supported; Phi3Config takes the "
                               f"default rope or longrope")
    return rope


def rotary_dim_of(cfg: dict[str, Any], family: str, head_dim: int) -> int | None:
    """How many dimensions of a head rotate, where the family reads partial_rotary_factor
    (Phi-3, GLM-4, StableLM, Phi, GLM-4.5, MiniMax-M2: from rope_parameters, else the top
    level, else the family's default: 1, 0.5, 0.25, 0.5, 0.5, MiniMax-M2's rotary_dim / head_dim
    or 1); None: all of them."""
    if family not in PARTIAL_ROTARY_DEFAULTS:
        return None
    _, rope = _rope_source(cfg)
    default = PARTIAL_ROTARY_DEFAULTS[family]
    if family == "minimax_m2" and isinstance(cfg.get("rotary_dim"), int):  # MiniMax-M2's files' legacy key
        default = cfg["rotary_dim"] / head_dim
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise UnsupportedModel(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}")
    rotary = int(head_dim * factor)
    if rotary == head_dim:
        return None
    if rotary < 2 or rotary % 2:
        raise UnsupportedModel(f"partial_rotary_factor {factor} rotates {rotary} of the {head_dim} dimensions of a "
                               f"head; rotary embeddings need an even number, at least 2")
    return rotary


def _read_per_layer_type_rope(cfg: dict[str, Any], family: str, defaults: FamilyDefaults, max_positions: int,
                              rotary_dim: int) -> tuple[float, RopeScaling | None, float]:
    """Gemma3TextConfig's and Olmo3Config's own reading: rope_parameters per layer type, a
    legacy rope_scaling merged over the full-attention one, rope_theta as the global base.
    The sliding layers' base: Gemma 3's rope_local_base_freq; OLMo 3's class default, not the
    file's rope_theta, which Olmo3Config hands to the full-attention layers only."""
    name = {"gemma3": "Gemma 3", "olmo3": "OLMo 3"}[family]
    per_type = _rope_dict(cfg.get("rope_parameters") or {}, "rope_parameters")
    flat = sorted(set(per_type) - set(LAYER_TYPE_KEYS))
    if flat:  # transformers silently ignores these (or fails on them)
        raise UnsupportedModel(f"{name} rope_parameters must be per layer type (full_attention, sliding_attention); "
                               f"flat keys {flat} are not supported")
    full = dict(_rope_dict(per_type.get("full_attention") or {"rope_type": "default"}, "full_attention"))
    if cfg.get("rope_scaling") is not None:
        full.update(_rope_dict(cfg["rope_scaling"], "rope_scaling"))
    local = _rope_dict(per_type.get("sliding_attention") or {"rope_type": "default"}, "sliding_attention")
    local_kind = _rope_kind(local, "sliding_attention")
    if local_kind != "default":
        raise UnsupportedModel(f"rope type {local_kind!r} on sliding layers is not supported")
    theta = positive_number(full, "rope_theta", cfg.get("rope_theta", defaults.rope_theta))
    local_default = (cfg.get("rope_local_base_freq", defaults.local_rope_theta) if family == "gemma3"
                     else defaults.rope_theta)
    local_theta = positive_number(local, "rope_theta", local_default)
    scaling = _rope_scaling(full, "full_attention rope (with rope_scaling over it)", max_positions, rotary_dim)
    return theta, scaling, local_theta


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


def _rope_scaling(s: dict[str, Any], where: str, max_positions: int, rotary_dim: int,
                  truncate: bool = True) -> RopeScaling | None:
    """`truncate`: YaRN's, which transformers reads from the top-level rope dict (True under a
    per-layer-type one, whatever its entries say)."""
    kind = _rope_kind(s, where)
    if kind == "default":
        return None
    if kind == "longrope":
        return _longrope(s, max_positions, rotary_dim)
    if kind == "yarn":
        return _yarn(s, max_positions, truncate)
    if kind == "linear":
        factor = s.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise UnsupportedModel(f"linear rope scaling needs a positive factor, got {factor!r}")
        return RopeScaling(factor=float(factor), kind="linear")
    if kind != "llama3":
        raise UnsupportedModel(f"rope scaling type {kind!r} is not supported (only llama3, linear, longrope "
                               f"and yarn)")
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


def _longrope(s: dict[str, Any], max_positions: int, rotary_dim: int) -> RopeScaling:
    """transformers' _compute_longrope_parameters: a factor per frequency (rotary_dim / 2 of
    them) for short and for long positions; attention_factor, when absent, from the ratio of
    the context to the original one."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = s.get(key)
        if (not isinstance(value, list) or len(value) != rotary_dim // 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value)):
            raise UnsupportedModel(f"longrope {key} must list {rotary_dim // 2} positive numbers (one per frequency "
                                   f"of the {rotary_dim} rotated dimensions), got {str(value)[:80]}")
        factors[key] = tuple(float(x) for x in value)
    original = s.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 2:
        raise UnsupportedModel(f"longrope needs original_max_position_embeddings, an integer >= 2, got {original!r}")
    factor = s.get("factor") or max_positions / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if not isinstance(attention, (int, float)) or isinstance(attention, bool) or attention <= 0:
        raise UnsupportedModel(f"longrope attention_factor must be a positive number, got {attention!r}")
    return RopeScaling(factor=float(factor), original_max_position_embeddings=original, kind="longrope",
                       short_factor=factors["short_factor"], long_factor=factors["long_factor"],
                       attention_factor=float(attention))


def _number(s: dict[str, Any], key: str, what: str) -> float | None:
    value = s.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModel(f"{what} {key} must be a positive number, got {value!r}")
    return float(value)


def _yarn(s: dict[str, Any], max_positions: int, truncate: bool) -> RopeScaling:
    """transformers' _compute_yarn_parameters: factor (null: the context over the original
    one), attention_factor from it where absent (0.1 ln(factor) + 1, or DeepSeek's ratio of
    two such with mscale and mscale_all_dim), beta_fast / beta_slow 32 / 1 where null."""
    if "factor" not in s:  # transformers fails on it (a required key)
        raise UnsupportedModel("yarn rope scaling lacks 'factor'")
    original = s.get("original_max_position_embeddings", max_positions)
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise UnsupportedModel(f"yarn original_max_position_embeddings must be a positive integer, got {original!r}")
    factor = _number(s, "factor", "yarn") or max_positions / original
    attention = _number(s, "attention_factor", "yarn")
    mscale, mscale_all_dim = _number(s, "mscale", "yarn"), _number(s, "mscale_all_dim", "yarn")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else yarn_mscale(factor, 1.0))
    return RopeScaling(factor=float(factor), original_max_position_embeddings=original, kind="yarn",
                       attention_factor=float(attention), beta_fast=_number(s, "beta_fast", "yarn") or 32.0,
                       beta_slow=_number(s, "beta_slow", "yarn") or 1.0, truncate=bool(truncate),
                       mscale_all_dim=mscale_all_dim)
