"""Partial (Phi-4-mini, GLM-4) and interleaved (GLM-4) rotary embeddings on the one full-head
rotation every path runs.

transformers rotates only the first R of a head's D dimensions, pairing dimension i with
i + R/2, and passes the other D - R through. Every attention path here (torch, the CPU
kernels, the Triton prologue) rotates whole heads, pairing j with j + D/2, from tables of
cos and sin per position. So the loader moves q's and k's head dimensions: the R/2 pairs to
the first R/2 places of each half, the passed-through dimensions after them, where the
tables hold cos 1 and sin 0 (layers.rope_tables). Scores are dot products of q and k, which
the same reordering of both leaves as they were, and v is not touched, so the logits are
transformers'. What changes is the order of K's dimensions in the cache, which only this
executor (or another of the same model, reordered alike) reads. GLM-4 pairs neighbouring
dimensions (2i, 2i + 1) of its rotated part: its even ones go where the first of each pair
belongs, its odd ones where the second does.
"""

from __future__ import annotations

import torch

from executors.models.config import DecoderConfig

# The tensors whose rows are q's or k's head dimensions: the projections, and the q/k norms'
# weights (GLM-4.5's per-head ones norm the dimensions before they rotate, in the served order).
ROTATED = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
           "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def head_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> list[int]:
    """new position -> checkpoint dimension, within one head. `interleaved` (GLM-4): the
    checkpoint's rotated pairs are (2i, 2i + 1), rather than (i, i + rotary_dim / 2)."""
    half, rest = rotary_dim // 2, list(range(rotary_dim, head_dim))
    keep = len(rest) // 2
    firsts, seconds = (range(0, rotary_dim, 2), range(1, rotary_dim, 2)) if interleaved else (
        range(half), range(half, rotary_dim))
    return [*firsts, *rest[:keep], *seconds, *rest[keep:]]


def reorders(config: DecoderConfig) -> bool:
    return config.rope_interleaved or (config.rotary_dim is not None and config.rotary_dim != config.head_dim)


def row_order(rows: int, config: DecoderConfig) -> torch.Tensor:
    """served row -> checkpoint row, over `rows` rows of whole heads (q's or k's)."""
    d = config.head_dim
    if rows % d:
        raise ValueError(f"{rows} rows are not whole heads of {d}")
    within = torch.tensor(head_order(d, config.rotary_dim or d, config.rope_interleaved))
    return (torch.arange(0, rows, d)[:, None] + within[None, :]).reshape(-1)


def reorder_rows(tensor: torch.Tensor, config: DecoderConfig) -> torch.Tensor:
    """q's or k's rows (a weight, a bias or a LoRA B) in the served order."""
    return tensor[row_order(tensor.shape[0], config)].contiguous()
