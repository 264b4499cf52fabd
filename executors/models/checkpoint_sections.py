"""Checkpoint tensors that hold several of the decoder's parameters, and where each one sits.

Phi-3 stores each layer's q, k and v projections as one `qkv_proj` ([q; k; v] rows, in that
order) and the MLP's gate and up projections as one `gate_up_proj` ([gate; up]); GLM-4 the
latter. The decoder keeps one set of parameter names for every family (tensor parallelism,
LoRA and the weights digest all go by them), so the loader cuts such a tensor into its row
ranges as it reads it; the fast forward fuses q/k/v and gate/up again anyway
(fused_weights.py). A tensor whose one part is all of it is a rename: GLM-4's norms around
attention and the MLP, whose names mean other norms in the decoder's (Gemma's) layout, and
StarCoder2's ungated MLP (c_fc, c_proj: the decoder's up_proj and down_proj) and Phi's
(fc1, fc2), its attention output (dense) and final norm, with their biases. Granite's MoE
checkpoints' experts and router are read under transformers' names for them (its
conversion mapping's), its shared MLP's fused input cut into gate and up. A multimodal
checkpoint's text model is read under the decoder's names, its other towers skipped.
"""

from __future__ import annotations

from executors.models.config import DecoderConfig

# checkpoint tensor -> ((parameter, first row, end row), ...)
Sections = dict[str, tuple[tuple[str, int, int], ...]]
# A multimodal checkpoint's text model under the decoder's names (transformers 4's layout, and
# 5's), and the prefixes of what else it holds (the vision tower, the projector): not served.
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                "visual.", "model.visual.")  # (Qwen VL's vision tower)
# A family's module names -> the decoder's. GLM-4's norms: of attention's output, before the
# MLP, of its output; StarCoder2's MLP; Phi's MLP and attention output.
RENAMED = {"glm4": {"post_self_attn_layernorm": "post_attention_layernorm",
                    "post_attention_layernorm": "pre_feedforward_layernorm",
                    "post_mlp_layernorm": "post_feedforward_layernorm"},
           "starcoder2": {"mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"},
           "phi": {"self_attn.dense": "self_attn.o_proj", "mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj"}}
# And outside the layers: Phi's final norm.
RENAMED_TOP = {"phi": {"model.final_layernorm": "model.norm"}}
# Granite MoE's tensors -> the decoder's (stacked_experts.py), in a layer.
GRANITE_MOE = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
               "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
               "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
               "shared_mlp.output_linear.weight": "block_sparse_moe.shared_mlp.down_proj.weight"}


def fused_sections(config: DecoderConfig) -> Sections:
    """Each fused (or renamed) checkpoint tensor of `config`'s family and the rows of each
    parameter in it (empty for families that store every parameter under its own name)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    sections: Sections = {}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
        if "qkv_proj" in config.fused_checkpoint:
            sections[f"{attn}qkv_proj.weight"] = ((f"{attn}q_proj.weight", 0, q),
                                                  (f"{attn}k_proj.weight", q, q + kv),
                                                  (f"{attn}v_proj.weight", q + kv, q + 2 * kv))
        if "gate_up_proj" in config.fused_checkpoint:
            sections[f"{mlp}gate_up_proj.weight"] = ((f"{mlp}gate_proj.weight", 0, inter),
                                                     (f"{mlp}up_proj.weight", inter, 2 * inter))
        for theirs, ours in RENAMED.get(config.family, {}).items():
            _rename(sections, config, f"{prefix}{theirs}", f"{prefix}{ours}")
        if config.moe is not None and config.moe.style == "granite":
            _granite_moe(sections, config, prefix)
    for theirs, ours in RENAMED_TOP.get(config.family, {}).items():
        _rename(sections, config, theirs, ours)
    return sections


def _granite_moe(sections: Sections, config: DecoderConfig, prefix: str) -> None:
    """A Granite MoE layer's tensors, each whole under its new name but the shared MLP's input."""
    experts, shared = config.moe.num_experts, config.moe.shared_intermediate_size
    for theirs, ours in GRANITE_MOE.items():
        if ours.startswith("block_sparse_moe.shared_mlp.") and not shared:
            continue
        sections[f"{prefix}{theirs}"] = ((f"{prefix}{ours}", 0, config.hidden_size if "shared" in ours else experts),)
    if shared:
        mlp = f"{prefix}block_sparse_moe.shared_mlp."
        sections[f"{prefix}shared_mlp.input_linear.weight"] = ((f"{mlp}gate_proj.weight", 0, shared),
                                                               (f"{mlp}up_proj.weight", shared, 2 * shared))


def _rename(sections: Sections, config: DecoderConfig, theirs: str, ours: str) -> None:
    """A module's weight, and its bias where the decoder's module has one, under another name."""
    rows = config.intermediate_size if ours.endswith("up_proj") else config.hidden_size
    biased = config.norm_bias if "norm" in ours else config.o_bias if ours.endswith("o_proj") else config.mlp_bias
    for kind in ("weight", "bias") if biased else ("weight",):
        sections[f"{theirs}.{kind}"] = ((f"{ours}.{kind}", 0, rows),)


class RowWindow:
    """Rows [lo, hi) of a tensor read lazily (a safetensors slice), indexed as if they were
    the whole tensor: a tensor-parallel rank reads only its rows of each part of a fused
    tensor (ShardPlan.read), not the whole fused tensor per rank."""

    def __init__(self, piece, lo: int, hi: int) -> None:
        self.piece, self.lo, self.hi = piece, lo, hi

    def __getitem__(self, index):
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        start, stop, step = rows.indices(self.hi - self.lo)
        if step != 1:
            raise ValueError("a RowWindow reads contiguous rows only")
        return self.piece[(slice(self.lo + start, self.lo + stop), *rest)]


def fused_shape(parts: tuple[tuple[str, int, int], ...], expected: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape the fused tensor must have: its parts' rows stacked, their columns."""
    return (parts[-1][2], *expected[parts[0][0]][1:])


def text_tensor_name(stored: str, config: DecoderConfig) -> str | None:
    """A checkpoint tensor's name as the decoder's (or its sections') names read it: a multimodal
    checkpoint's text model without its prefix, its other towers None; other names as stored."""
    if not config.multimodal:
        return stored
    if stored.startswith(OTHER_TOWERS):
        return None
    for theirs, ours in TEXT_PREFIXES:
        if stored.startswith(theirs):
            return ours + stored[len(theirs):]
    return stored
