"""LoRA adapters in PEFT's layout, applied per row of a flat batch (multi-LoRA).

One base model serves many fine-tunes: a step's flat batch mixes sequences of several
adapters and of none, and every adapted projection adds, for the rows of each adapter,
the low-rank delta (x @ A.T) @ B_scaled.T to the base output (executors/lora_batch.py
applies it per step). That is what PEFT's lora.Linear adds in eval mode (dropout is the
identity then), with its scaling (alpha / r, or alpha / sqrt(r) with use_rslora) folded
into B once at load instead of once per call.

Adapters are read from a `save_pretrained` directory or from uploaded bytes and checked
once, at load, against the model: anything PEFT would compute differently from that plain
delta on q/k/v/o/gate/up/down (DoRA and the other variants, trained biases, fully trained
extra modules, per-module rank or alpha patterns...) is refused with a LoraAdapterError
naming it, rather than served wrong.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from executors.config_regex import PatternError, fullmatching
from executors.lora_targets import MODULE_PARENTS, LoraTargets, served_pairs


class LoraAdapterError(ValueError):
    """An adapter refused at load; the message says precisely what does not fit (module, layer, shape, rank...)."""


Refuse = Callable[[str], LoraAdapterError]  # a problem -> the error that names the adapter


TENSOR_PREFIX = "base_model.model."  # PeftModel wrapping the CausalLM, as save_pretrained names tensors
# A multimodal model's text layers are language_model.model.layers (transformers 4) or
# model.language_model.layers (5): PEFT names an adapter's tensors by those module paths.
_LAYER_TENSOR = re.compile(r"(?:model|language_model\.model|model\.language_model)\.layers\.(\d+)\.(\w+)\.(\w+)"
                           r"\.lora_([AB])\.weight")
CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"

# Options under which PEFT computes something other than the plain delta on the seven
# projections (a variant's forward, other modules changed, per-module ranks...): refused.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing (arrow_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (transposed, Conv1D-style weights)",
    "modules_to_save": "modules_to_save (fully trained copies of other modules)",
    "trainable_token_indices": "trainable_token_indices (retrained embedding rows)",
    "layer_replication": "layer_replication (a rearranged layer stack)",
    "target_parameters": "target_parameters (LoRA on bare parameters)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
}


@dataclass(slots=True)
class LoraAdapter:
    name: str
    key: str  # unique per load (e.g. f"{name}@{serial}"), used to tell KV computed under different loads apart
    rank: int  # largest r over its modules
    alpha: float
    target_modules: tuple[str, ...]  # sorted
    # (layer, module) -> (A [r, in], B_scaled [out, r]); the decoder's module names (a fused
    # projection's pair is cut into its parts', which share its A)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scaling: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    num_parameters: int
    nbytes: int
    source: str  # directory path, or "inline"


def read_peft_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json + adapter_model.safetensors of a PEFT save_pretrained directory."""
    path = Path(path)
    if not path.is_dir():
        raise LoraAdapterError(f"{path}: not a directory (expected a PEFT save_pretrained directory)")
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_path.is_file():
        raise LoraAdapterError(f"{path}: no {CONFIG_FILE}")
    if not weights_path.is_file():
        if (path / PICKLE_FILE).is_file():
            # A pickle can run code when loaded; PEFT has saved safetensors by default for years.
            raise LoraAdapterError(f"{path}: only {PICKLE_FILE} (a pickle), which is never loaded; "
                                   f"re-save the adapter with safe_serialization=True to get {WEIGHTS_FILE}")
        raise LoraAdapterError(f"{path}: no {WEIGHTS_FILE}")
    return read_peft_bytes(config_path.read_bytes(), weights_path.read_bytes())


def read_peft_bytes(config_json: bytes, safetensors_bytes: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """The same from in-memory bytes (an adapter uploaded over gRPC)."""
    try:
        config = json.loads(config_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraAdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{CONFIG_FILE} is not a JSON object but {type(config).__name__}")
    try:
        tensors = load_safetensors(safetensors_bytes)
    except SafetensorError as e:
        raise LoraAdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from None
    return config, tensors


def build_adapter(name: str, key: str, config: dict, tensors: dict[str, torch.Tensor], targets: LoraTargets,
                  *, dtype: torch.dtype, device: str | torch.device, max_rank: int, source: str) -> LoraAdapter:
    """Validate an adapter against the model and convert it (weights in the model's dtype and device)."""
    def refuse(problem: str) -> LoraAdapterError:
        return LoraAdapterError(f"adapter {name!r}: {problem}")

    if config.get("peft_type") != "LORA":
        raise refuse(f"peft_type is {config.get('peft_type')!r}, only 'LORA' adapters are supported")
    for option, what in UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise refuse(f"{what} is not supported; only plain LoRA on {_supported(targets)}")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias={config['bias']!r} (trained base biases) is not supported; only bias='none'")
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)  # PEFT's LoraConfig defaults
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r={rank!r}: the rank must be a positive integer")
    if rank > max_rank:
        raise refuse(f"r={rank} exceeds this executor's max_rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha={alpha!r} is not a number")
    try:
        alpha = float(alpha)  # JSON allows integers of any length, and Python's reader NaN and Infinity
    except OverflowError:
        raise refuse(f"lora_alpha, an integer of {len(str(alpha))} digits, is too large for a float") from None
    if not math.isfinite(alpha):
        raise refuse(f"lora_alpha={alpha} is not a finite number")

    expected = _targeted(config, targets, refuse)
    pairs = _pairs(tensors, targets, refuse)
    undeclared = sorted(set(pairs) - expected)
    if undeclared:
        raise refuse(f"has tensors for {_where(undeclared)}, which its target_modules "
                     f"{config.get('target_modules')!r} (with layers_to_transform/exclude_modules) do not target")
    missing = sorted(expected - set(pairs))
    if missing:
        absent = sorted({m for _, m in expected} - {m for _, m in pairs})
        if absent:
            raise refuse(f"has no tensors at all for declared target {', '.join(absent)}")
        raise refuse(f"has no tensors for {_where(missing)}, which its target_modules target")

    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        for half in "AB":
            if half not in ab:
                raise refuse(f"incomplete pair: {_tensor_name(layer, module, half)} is missing "
                             f"(its lora_{'B' if half == 'A' else 'A'} is present)")
        in_features, out_features = targets.shapes[module]
        for half, shape in (("A", (rank, in_features)), ("B", (out_features, rank))):
            got = tuple(ab[half].shape)
            if got != shape:
                raise refuse(f"tensor {_tensor_name(layer, module, half)} has shape {got}, expected {shape} "
                             f"(r={rank}, {module} maps {in_features} -> {out_features} features)")
        # B times the scaling in float32, then one rounding to the model's dtype.
        b_scaled = ab["B"].to(device=device, dtype=torch.float32) * (scaling * targets.output_scales.get(module, 1.0))
        weights[(layer, module)] = (ab["A"].to(device=device, dtype=dtype), b_scaled.to(dtype))
    flat = [t for pair in weights.values() for t in pair]
    return LoraAdapter(
        name=name, key=key, rank=rank, alpha=alpha,
        target_modules=tuple(sorted({m for _, m in weights})),
        weights=served_pairs(weights, targets), scaling=scaling,
        num_parameters=sum(t.numel() for t in flat),
        nbytes=sum(t.numel() * t.element_size() for t in flat),
        source=source,
    )


def _supported(targets: LoraTargets) -> str:
    return ", ".join(targets.shapes)


def _module_path(layer: int, module: str, prefix: str = "model") -> str:
    return f"{prefix}.layers.{layer}.{MODULE_PARENTS[module]}.{module}"


def _tensor_name(layer: int, module: str, half: str) -> str:
    return f"{TENSOR_PREFIX}{_module_path(layer, module)}.lora_{half}.weight"


def _where(pairs: list[tuple[int, str]]) -> str:
    shown = ", ".join(f"layer {layer} {module}" for layer, module in pairs[:6])
    return shown + (f" and {len(pairs) - 6} more" if len(pairs) > 6 else "")


def _targeted(config: dict, targets: LoraTargets, refuse: Refuse) -> set[tuple[int, str]]:
    """The (layer, module) pairs the config targets, resolved against the model's module paths
    the way PEFT's check_target_module_exists resolves them against the base model's."""
    paths = {_module_path(layer, module, prefix): (layer, module) for prefix in targets.module_prefixes
             for layer in range(targets.num_layers) for module in targets.shapes}
    declared = config.get("target_modules")
    if isinstance(declared, str):
        if declared.lower() == "all-linear":  # PEFT's shorthand: every linear layer but the output head
            chosen = set(paths)
        else:
            try:
                chosen = fullmatching(declared, paths)
            except PatternError as e:
                raise refuse(f"target_modules {declared[:200]!r} {e}") from None
            if not chosen:
                raise refuse(f"target_modules regex {declared!r} matches none of the model's projections "
                             f"(module paths like {_module_path(0, 'q_proj', targets.module_prefixes[0])}; "
                             f"supported: {_supported(targets)})")
        # PEFT ignores layers_to_transform when target_modules is a regex: the regex says it all.
    elif isinstance(declared, list | tuple) and declared and all(isinstance(t, str) for t in declared):
        chosen = set()
        for target in declared:
            matched = {p for p in paths if p == target or p.endswith(f".{target}")}
            if not matched:
                raise refuse(f"target module {target!r} is not one this executor can adapt; "
                             f"supported: {_supported(targets)}")
            chosen |= matched
        chosen = _restrict_layers(chosen, config, paths, refuse)
    else:
        raise refuse(f"target_modules must be a non-empty list of module names or a regex string, "
                     f"not {declared!r}")
    excluded = config.get("exclude_modules")
    if excluded:
        if isinstance(excluded, str):
            try:
                chosen -= fullmatching(excluded, chosen)
            except PatternError as e:
                raise refuse(f"exclude_modules {excluded[:200]!r} {e}") from None
        elif isinstance(excluded, list | tuple) and all(isinstance(e, str) for e in excluded):
            chosen = {p for p in chosen if p not in excluded and not any(p.endswith(f".{e}") for e in excluded)}
        else:
            raise refuse(f"exclude_modules must be a list of module names or a regex string, not {excluded!r}")
    if not chosen:
        raise refuse("targets none of the model's projections once layers_to_transform/exclude_modules apply")
    return {paths[p] for p in chosen}


def _restrict_layers(chosen: set[str], config: dict, paths: dict[str, tuple[int, str]], refuse: Refuse) -> set[str]:
    """PEFT's layers_to_transform (an index or a list) and layers_pattern, for list target_modules."""
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return chosen
    pattern = config.get("layers_pattern")
    if isinstance(pattern, str):
        patterns = [pattern]
    elif pattern is None or isinstance(pattern, list | tuple) and all(isinstance(x, str) for x in pattern):
        patterns = list(pattern or [])
    else:
        raise refuse(f"layers_pattern must be a name or a list of names, not {pattern!r}")
    if patterns and "layers" not in patterns:
        # PEFT would find no layer index under these names and adapt nothing.
        raise refuse(f"layers_pattern {pattern!r} does not name this model's layer list ('layers')")
    items = [layers] if not isinstance(layers, list | tuple) else list(layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise refuse(f"layers_to_transform {layers!r} must be a layer index or a list of them")
    wanted = set(items)
    return {p for p in chosen if paths[p][0] in wanted}


def _pairs(tensors: dict[str, torch.Tensor], targets: LoraTargets,
           refuse: Refuse) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """PEFT tensor names -> {(layer, module): {"A": tensor, "B": tensor}}, refusing any other tensor."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        found = None
        if tensor_name.startswith(TENSOR_PREFIX):
            found = _LAYER_TENSOR.fullmatch(tensor_name[len(TENSOR_PREFIX):])
        if found is None:
            raise refuse(_unexpected_tensor(tensor_name, targets))
        layer, parent, module, half = int(found[1]), found[2], found[3], found[4]
        if module not in targets.shapes:
            raise refuse(f"tensor {tensor_name} targets module {module!r}, which this executor cannot adapt; "
                         f"supported: {_supported(targets)}")
        if parent != MODULE_PARENTS[module]:
            raise refuse(f"tensor {tensor_name}: the model has no {parent}.{module} "
                         f"({module} is under {MODULE_PARENTS[module]})")
        if layer >= targets.num_layers:
            raise refuse(f"tensor {tensor_name}: layer {layer} is out of range (the model has "
                         f"{targets.num_layers} layers, 0..{targets.num_layers - 1})")
        pairs.setdefault((layer, module), {})[half] = tensor
    if not pairs:
        raise refuse("has no LoRA tensors")
    return pairs


def _unexpected_tensor(tensor_name: str, targets: LoraTargets) -> str:
    """Why a tensor outside the decoder layers' lora_A/lora_B weights is refused, as precisely as its name allows."""
    path, lora_part, rest = tensor_name.removeprefix(TENSOR_PREFIX).partition(".lora_")
    if not lora_part:
        return (f"tensor {tensor_name} is not a LoRA weight (a fully trained base tensor: modules_to_save "
                f"or bias training?); only lora_A/lora_B weights are supported")
    module = path.rsplit(".", 1)[-1]
    if module in targets.shapes and rest.endswith(".bias"):
        return f"tensor {tensor_name} is a LoRA bias (lora_bias), which is not supported"
    return (f"tensor {tensor_name} targets module {module!r}, which this executor cannot adapt; "
            f"supported: {_supported(targets)}")
