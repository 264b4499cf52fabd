"""What a model offers to LoRA adapters, in PEFT's names, and how an adapter's pairs become
the decoder's: a fused projection's (Phi-3) cut into its parts, q's and k's rows reordered
as partial rotary embeddings reorder the weights, deltas scaled as Granite's residual
multiplier scales the outputs they add to. Reading and checking adapters is lora.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from executors.models.config import DecoderConfig
from executors.models.partial_rotary import reorders, row_order

# The adaptable projections and the submodule of a decoder layer that holds each
# (Hugging Face names, which PEFT's tensor names and target_modules use).
MODULE_PARENTS = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
    "qkv_proj": "self_attn", "gate_up_proj": "mlp",  # Phi-3's fused projections (GLM-4's gate_up_proj)
    "c_fc": "mlp", "c_proj": "mlp",  # StarCoder2's ungated MLP: the decoder's up_proj and down_proj
    "dense": "self_attn", "fc1": "mlp", "fc2": "mlp",  # Phi's o_proj, up_proj and down_proj
}
# Families whose transformers modules (so PEFT's targets) have other names than the decoder's.
PEFT_NAMES = {"starcoder2": {"c_fc": "up_proj", "c_proj": "down_proj"},
              "phi": {"dense": "o_proj", "fc1": "up_proj", "fc2": "down_proj"}}
QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True, slots=True)
class LoraTargets:
    """What a model offers to adapters: its layer count and each projection's (in_features, out_features)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]  # "q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"
    # Phi-3: a fused projection (qkv_proj, gate_up_proj) -> the decoder's projections in its
    # output rows, as (module, first row, end row). An adapter on it is cut into theirs; one
    # part of all the rows is a rename (StarCoder2's c_fc and c_proj, Phi's dense, fc1 and fc2).
    splits: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    # Partial rotary embeddings: q's and k's rows in the order the loader served them
    # (served row -> checkpoint row, partial_rotary.py); B's rows follow it.
    row_orders: dict[str, torch.Tensor] = field(default_factory=dict)
    # Granite: the outputs of o_proj and down_proj are scaled before the residual add, their
    # adapters' deltas with them (folded into B, as the loader folds it into the weights).
    output_scales: dict[str, float] = field(default_factory=dict)
    # Where the layers are in the transformers model PEFT adapted (its regex target_modules
    # match the module paths there): a multimodal checkpoint's text model's under transformers
    # 5's name or 4's.
    module_prefixes: tuple[str, ...] = ("model",)

    @classmethod
    def from_config(cls, config: DecoderConfig) -> LoraTargets:
        targets = cls._for_text_model(config)
        if config.multimodal:
            return dataclasses.replace(targets, module_prefixes=("model.language_model", "language_model.model"))
        return targets

    @classmethod
    def _for_text_model(cls, config: DecoderConfig) -> LoraTargets:
        hidden, inter = config.hidden_size, config.intermediate_size
        if config.mla is not None:  # DeepSeek: o_proj alone (the latent projections take none, mla.py)
            return cls(config.num_layers, {"o_proj": (config.num_heads * config.mla.v_head_dim, hidden)})
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        orders = {"q_proj": row_order(q, config), "k_proj": row_order(kv, config)} if reorders(config) else {}
        scale = config.residual_scale
        scales = {"o_proj": scale, "down_proj": scale} if scale not in (None, 1.0) else {}
        attention = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
        if config.fused_checkpoint:  # the projections PEFT sees on this family's transformers model
            shapes = {**attention, "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}
            splits = {"gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))}
            if "qkv_proj" in config.fused_checkpoint:  # Phi-3's; GLM-4 fuses gate/up only
                shapes = {"qkv_proj": (hidden, q + 2 * kv), **{k: v for k, v in shapes.items() if k not in QKV}}
                splits["qkv_proj"] = (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv))
            return cls(config.num_layers, shapes, splits, orders, scales)
        if config.family in PEFT_NAMES:  # PEFT's names, renamed as the loader renames the weights
            peft_name = {mine: theirs for theirs, mine in PEFT_NAMES[config.family].items()}
            ours = {**attention, "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
            shapes = {peft_name.get(name, name): shape for name, shape in ours.items()}
            splits = {theirs: ((mine, 0, ours[mine][1]),) for mine, theirs in peft_name.items()}
            return cls(config.num_layers, shapes, splits, orders, scales)
        if config.moe is not None:  # a mixture of experts: adapters on attention only
            return cls(config.num_layers, attention, row_orders=orders, output_scales=scales)
        return cls(config.num_layers, {
            **attention, "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        }, row_orders=orders, output_scales=scales)


def served_pairs(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                 targets: LoraTargets) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's pairs as the decoder's projections take them. A fused projection's (A, B) as
    its parts' (A, rows of B): the delta x A^T B^T of the fused output, column block by
    column block, is exactly the parts' deltas. B's rows of q and k in the served order."""
    out = {}
    for (layer, module), (a, b) in weights.items():
        for part, lo, hi in targets.splits.get(module, ((module, 0, b.shape[0]),)):
            rows = b[lo:hi]
            out[(layer, part)] = (a, rows[targets.row_orders[part]] if part in targets.row_orders else rows)
    return out
