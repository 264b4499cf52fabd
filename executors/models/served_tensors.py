"""A checkpoint tensor as the decoder holds it, where a family's checkpoint means something
the one decoder computes another way: the loader, each tensor-parallel rank and the weights
digest (loader.checkpoint_parameters) all pass every tensor through `served`, so that they
agree on what is served.

- Partial rotary embeddings (Phi-4-mini, GLM-4.5): q's and k's head dimensions reordered
  (partial_rotary.py), their norms' weights with them.
- Granite's residual_multiplier: the attention and MLP outputs are scaled before each
  residual add, which is o_proj's and down_proj's weights and biases scaled (in float32,
  then rounded once to the serving dtype), and costs nothing per step; in its MoE models,
  every expert's down projection and the shared MLP's.
- GPT-OSS's stacked experts: transposed, gate and up de-interleaved (stacked_experts.py).
- DeepSeek's latent attention: the rope rows of the queries and of the shared key, from
  interleaved pairs to halves (mla.py).
"""

from __future__ import annotations

import torch

from executors.models import mla, stacked_experts
from executors.models.config import DecoderConfig
from executors.models.partial_rotary import ROTATED, reorder_rows, reorders

RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias",
                    "experts.down_proj")  # (and Granite MoE's experts, and shared_mlp.down_proj.weight)


def served(name: str, tensor: torch.Tensor, config: DecoderConfig) -> torch.Tensor:
    """Checkpoint tensor `name` (or one rank's part of it: whole heads, any columns) as served."""
    if config.mla is not None:
        tensor = mla.served(name, tensor, config)
    elif reorders(config) and name.endswith(ROTATED):
        # Command R+'s q/k norm weights hold a row per head: reordered as one row of all heads
        per_head = tensor.dim() == 2 and name.endswith("norm.weight")
        tensor = reorder_rows(tensor.reshape(-1), config).view(tensor.shape) if per_head else reorder_rows(tensor, config)
    if config.residual_scale not in (None, 1.0) and name.endswith(RESIDUAL_OUTPUTS):
        tensor = tensor.float() * config.residual_scale
    if _stacked(name, config):
        tensor = stacked_experts.served(name, tensor, config.moe.style)
    return tensor


def stored_shape(name: str, shape: tuple[int, ...], config: DecoderConfig) -> tuple[int, ...]:
    """The shape the checkpoint stores parameter `name` of this shape in (GPT-OSS's experts: transposed)."""
    return stacked_experts.checkpoint_shape(name, shape, config.moe.style) if _stacked(name, config) else shape


def _stacked(name: str, config: DecoderConfig) -> bool:
    return config.moe is not None and config.moe.stacked and stacked_experts.is_stacked(name)
