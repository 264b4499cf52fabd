"""The fast forward's weights: each decoder layer's tensors fused, with no copy.

`fuse_layers` concatenates each layer's q/k/v weights into one [(H + 2 KVH) D, hidden]
matrix and its gate/up weights into one [2 I, hidden] matrix (one matmul each instead of
three and two), and makes the modules' q_proj/k_proj/... parameters views into them: the
fused tensors are the storage, so fusing costs no memory and parameter counts do not change.
The other tensors (o, down, the norms' weights, a sparse layer's stacked experts) are taken
as they are. The result, one FusedLayer per layer, is what DecoderLM.fuse() then relays out
for the CPU (cpu_layout.py, panel_modules.py, step_ops.py) and what fast_forward.py walks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from executors.models.config import DecoderConfig
from executors.models.decoder_modules import DecoderModel
from executors.models.moe import MoeWeights, stack


class FusedLayer(NamedTuple):
    """One decoder layer's tensors for the fast forward (views of, or the same as, its parameters)."""

    # The norms: RMSNorm weights, or a LayerNorm's weight and bias stacked [2, hidden] (StableLM).
    input_norm: torch.Tensor | None  # None: OLMo 2 norms no layer's input
    qkv: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D], or [H * D] where the norm spans every head (OLMo 2)
    k_norm: torch.Tensor | None
    # Gemma 2 and 3, OLMo 2 (post_ff_norm set): of attention's output; else before the MLP;
    # None in a parallel layer (Cohere), whose MLP reads the input norm's output.
    post_norm: torch.Tensor | None
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden] (ungated: up's [intermediate, hidden]); None: sparse
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    pre_ff_norm: torch.Tensor | None = None  # Gemma's norms before and after the MLP (OLMo 2: after only)
    post_ff_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None  # a sparse layer's router and stacked experts
    # DeepSeek's latent attention (qkv: q_a_proj's and kv_a_proj_with_mqa's rows): q_b_proj's
    # weight, the layer's one other plain matmul (kv_b_proj's is read per head, mla.py).
    q_b: torch.Tensor | None = None

    def matmuls(self) -> list[torch.Tensor]:
        """The layer's dense matmul weights (q/k/v, DeepSeek's q_b_proj, o, gate/up, down; not a
        sparse layer's experts): what the CPU kernels pack, oneDNN prepacks, few-row matmuls time."""
        return [t for t in (self.qkv, self.q_b, self.o, self.gate_up, self.down) if t is not None]


def _fuse(modules: list[nn.Linear], bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the modules' weights (and biases) and make each module's parameters views of the result."""
    weight = torch.cat([m.weight.detach() for m in modules], dim=0)
    fused_bias = torch.cat([m.bias.detach() for m in modules], dim=0) if bias else None
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias:
            m.bias = nn.Parameter(fused_bias[row:row + n], requires_grad=False)
        row += n
    return weight, fused_bias


def fuse_layers(model: DecoderModel, config: DecoderConfig) -> list[FusedLayer]:
    """Each layer's FusedLayer, its modules' q/k/v and gate/up parameters made views of the fused tensors."""
    c = config
    fused = []
    for layer in model.layers:
        a, ffn = layer.self_attn, layer.ffn
        # (DeepSeek's latent attention: q_a_proj and kv_a_proj_with_mqa, mla.py)
        qkv, qkv_bias = _fuse([getattr(a, name) for name in a.fused_names], c.qkv_bias)
        dense = {"gate_up": None, "gate_up_bias": None, "down": None, "down_bias": None}
        if not layer.sparse:
            # An ungated MLP (StarCoder2): up alone, in gate_up's place.
            gate_up, gate_up_bias = _fuse([getattr(ffn, name) for name in ffn.gate_up_names], c.mlp_bias)
            dense = {"gate_up": gate_up, "gate_up_bias": gate_up_bias, "down": ffn.down_proj.weight.detach(),
                     "down_bias": ffn.down_proj.bias.detach() if c.mlp_bias else None}
        pre, post = hasattr(layer, "pre_feedforward_layernorm"), hasattr(layer, "post_feedforward_layernorm")
        fused.append(FusedLayer(
            input_norm=layer.input_layernorm.fused_weight() if c.pre_norms else None,
            qkv=qkv, qkv_bias=qkv_bias,
            o=a.o_proj.weight.detach(), o_bias=a.o_proj.bias.detach() if c.o_bias else None,
            q_norm=a.q_norm.fused_weight() if c.qk_norm else None,
            k_norm=a.k_norm.fused_weight() if c.qk_norm else None,
            post_norm=None if layer.parallel else layer.post_attention_layernorm.fused_weight(),
            **dense,
            pre_ff_norm=layer.pre_feedforward_layernorm.fused_weight() if pre else None,
            post_ff_norm=layer.post_feedforward_layernorm.fused_weight() if post else None,
            moe=stack(ffn) if layer.sparse else None,
            q_b=a.q_b_proj.weight.detach() if hasattr(a, "q_b_proj") else None,
        ))
    return fused
