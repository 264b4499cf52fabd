"""What kind of attention each layer has, read from a config.json as transformers reads it:
its sliding window (Mistral, Mixtral, Phi-3 and StarCoder2 every layer; Gemma 2 and 3, SmolLM3, OLMo 3,
EXAONE 4, Ministral and Cohere 2 by `layer_types`) and whether it rotates q and k at all (SmolLM3's
NoPE layers, EXAONE 4's and Cohere 2's global ones)."""

from __future__ import annotations

from typing import Any

from executors.models.errors import UnsupportedModel
from executors.models.family_defaults import FamilyDefaults

# Families whose every layer sees the same `sliding_window` (when the config sets one).
WINDOWED_FAMILIES = ("mistral", "mixtral", "phi3", "starcoder2")
# Families whose layers slide or not by `layer_types` (or the older keys that stand for it).
LAYER_TYPE_FAMILIES = ("gemma2", "gemma3", "smollm3", "olmo3", "exaone4", "ministral", "cohere2", "gpt_oss")
LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_kinds(cfg: dict[str, Any], family: str, defaults: FamilyDefaults, layers: int,
                max_positions: int) -> tuple[tuple[int | None, ...], tuple[bool, ...]]:
    """(each layer's sliding window, or () when no layer has one; whether each layer rotates q
    and k). A window as long as the positions a sequence can have (Phi-4-mini's 262144 over
    131072) hides no key: none, so that attention takes the global paths."""
    window = cfg.get("sliding_window", defaults.sliding_window)  # null in the file: no window
    rotation = _smollm3_rotation(cfg, layers) if family == "smollm3" else (True,) * layers
    if family in WINDOWED_FAMILIES:
        if window is None or window_size(window) >= max_positions:
            return (), rotation
        return (window_size(window),) * layers, rotation
    if family not in LAYER_TYPE_FAMILIES:
        return (), rotation  # Qwen: sliding windows only with use_sliding_window, refused by config.py
    types = cfg.get("layer_types")
    if types is None:
        types = _implied_layer_types(cfg, family, defaults, layers, window, rotation)
    if not isinstance(types, list) or len(types) != layers:
        raise UnsupportedModel(f"layer_types must list num_hidden_layers ({layers}) layers, got {types!r}")
    unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModel(f"layer types {unknown} are not supported (only sliding_attention, full_attention)")
    if family == "exaone4" and window is not None:  # with a window, its global layers are NoPE
        rotation = tuple(t == "sliding_attention" for t in types)
    if family == "cohere2":  # only its sliding layers rotate (Cohere2Attention: those with a window)
        rotation = tuple(t == "sliding_attention" and window is not None for t in types)
    if "sliding_attention" not in types:
        return (), rotation
    size = window_size(window)
    if size >= max_positions:
        return (), rotation
    return tuple(size if t == "sliding_attention" else None for t in types), rotation


def _implied_layer_types(cfg: dict[str, Any], family: str, defaults: FamilyDefaults, layers: int,
                         window: Any, rotation: tuple[bool, ...]) -> list[str]:
    """layer_types where an older config.json leaves them out, as the config classes derive them."""
    if family == "smollm3":  # SmolLM3Config: the NoPE layers slide, with use_sliding_window and a window
        slides = bool(cfg.get("use_sliding_window")) and window is not None
        return ["sliding_attention" if slides and not rotation[i] else "full_attention" for i in range(layers)]
    if family == "exaone4" and window is None:  # Exaone4Config fails here (a pattern of 0): none slides
        return ["full_attention"] * layers
    if family == "ministral":  # MinistralConfig: every layer slides where there is a window
        return ["full_attention" if window is None else "sliding_attention"] * layers
    # Gemma, OLMo 3, EXAONE 4, Cohere 2 and GPT-OSS: every `sliding_window_pattern`-th layer is
    # global (only Gemma 3, EXAONE 4 and Cohere 2 read the key: Gemma 2's and GPT-OSS's every other
    # layer slides, from the first; OLMo 3's three of four).
    pattern = (cfg.get("sliding_window_pattern", defaults.sliding_window_pattern)
               if family in ("gemma3", "exaone4", "cohere2")
               else defaults.sliding_window_pattern)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise UnsupportedModel(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def window_size(window: Any) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UnsupportedModel(f"sliding_window must be a positive integer, got {window!r}")
    return window


def _smollm3_rotation(cfg: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """SmolLM3: `no_rope_layers` holds 1 for a layer with rotary embeddings and 0 for a NoPE
    one (at least one entry per layer; transformers reads the first ones), or without it every
    `no_rope_layer_interval`-th layer is NoPE."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise UnsupportedModel(f"no_rope_layer_interval must be a positive integer, got {interval!r}")
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if (not isinstance(flags, list) or len(flags) < layers
            or any(f not in (0, 1) or isinstance(f, float) for f in flags[:layers])):
        raise UnsupportedModel(f"no_rope_layers must list 0 (NoPE) or 1 (rotary) for each of the {layers} layers, "
                               f"got {flags!r}")
    return tuple(bool(f) for f in flags[:layers])
