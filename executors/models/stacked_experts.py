"""Experts stacked in tensors, as GPT-OSS's and Granite's checkpoints hold them, and GPT-OSS's
clamped SwiGLU.

GPT-OSS's checkpoints hold a layer's experts as four tensors: `mlp.experts.gate_up_proj`
[E, hidden, 2I] (x @ it, the gate's and up's output columns interleaved: gate j at 2j, up j
at 2j + 1), `gate_up_proj_bias` [E, 2I] (interleaved alike), `down_proj` [E, I, hidden] and
`down_proj_bias` [E, hidden]; its published files quantize the two matrices to MXFP4
(mxfp4.py). The decoder holds them under those names in the layout its grouped compute reads
(moe_grouped.py), the one every other family's experts are stacked into: `gate_up_proj`
[E, 2I, hidden], rows [gate; up]; `gate_up_proj_bias` [E, 2I] likewise; `down_proj`
[E, hidden, I]. `served` turns the checkpoint's tensors (or a tensor-parallel rank's part of
them, `rank_part`) into these as they load, and the weights digest reads them the same way.

Granite's MoE checkpoints hold `block_sparse_moe.input_linear` [E, 2I, hidden] (rows [gate;
up]) and `output_linear` [E, hidden, I], without biases: the decoder's layout already, read
under transformers' names (`experts.gate_up_proj`, `experts.down_proj`;
checkpoint_sections.py renames them).

On a CPU in float32 (or int8) the two matrices become PanelStacks (panel_layers.py): each
expert's matrices as the CPU kernels' panels, the stack given back unpacked on request.

The activation (GptOssExperts._apply_gate): the gate clamped above at `limit`, up clamped to
[-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# The stacked tensors' names under a sparse layer, and which of them are matrices stored
# transposed (x @ w) in the checkpoint.
STACKED = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")
TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")


class StackedExperts(nn.Module):
    """A sparse layer's E experts as two tensors (and GPT-OSS's two biases), in the decoder's
    layout (module docstring); `glu` their activation-and-multiply (`gated`)."""

    def __init__(self, hidden: int, inter: int, experts: int, bias: bool,
                 glu: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * inter)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden)) if bias else None
        self.glu = glu

    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.gate_up_proj_bias is None:
            return None
        return self.gate_up_proj_bias.detach(), self.down_proj_bias.detach()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The reference: each expert in turn over the rows that picked it (weights, experts [M, k])."""
        out = torch.zeros_like(x)
        biased = self.gate_up_proj_bias is not None
        for e in range(self.gate_up_proj.shape[0]):
            rows, slot = torch.where(experts == e)
            if rows.numel() == 0:
                continue
            gu = F.linear(x[rows], self.gate_up_proj[e], self.gate_up_proj_bias[e] if biased else None)
            y = F.linear(self.glu(gu), self.down_proj[e], self.down_proj_bias[e] if biased else None)
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


def clamped_swiglu(gu: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[n, 2I] gate/up rows ([gate; up]) -> [n, I], GPT-OSS's activation (module docstring)."""
    inter = gu.shape[1] // 2
    gate = gu[:, :inter].clamp(max=limit)
    up = gu[:, inter:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gated(act: Callable[[torch.Tensor], torch.Tensor], clamp: tuple[float, float] | None
          ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The experts' activation-and-multiply of [n, 2I] gate/up rows: act(gate) * up, or GPT-OSS's
    clamped SwiGLU where `clamp` is its (limit, alpha)."""
    if clamp is not None:
        limit, alpha = clamp
        return lambda gu: clamped_swiglu(gu, limit, alpha)

    def glu(gu: torch.Tensor) -> torch.Tensor:
        inter = gu.shape[1] // 2
        return act(gu[:, :inter]).mul_(gu[:, inter:])

    return glu


def is_stacked(name: str) -> bool:
    return name.endswith(STACKED) and (".mlp." in name or ".block_sparse_moe." in name)


def served(name: str, tensor: torch.Tensor, style: str) -> torch.Tensor:
    """A checkpoint tensor (or a rank's part of it, `rank_part`) in the decoder's layout."""
    if style != "gpt_oss":  # Granite's: as stored
        return tensor
    if name.endswith(TRANSPOSED):
        tensor = tensor.transpose(1, 2)
    if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):  # interleaved -> [gate; up]
        tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
    return tensor.contiguous()


def checkpoint_shape(name: str, shape: tuple[int, ...], style: str) -> tuple[int, ...]:
    """The shape the checkpoint stores a parameter of this (decoder-layout) shape in."""
    return (shape[0], shape[2], shape[1]) if style == "gpt_oss" and name.endswith(TRANSPOSED) else shape


def rank_part(name: str, piece, lo: int, hi: int, inter: int, first_rank: bool, style: str) -> torch.Tensor:
    """A tensor-parallel rank's part of a stored tensor (a safetensors slice, or any tensor),
    the rank holding each expert's intermediate rows [lo, hi) of `inter`. GPT-OSS's: gate/up's
    interleaved columns 2lo..2hi (one contiguous run), down's rows lo..hi; down's bias whole on
    the first rank, zero elsewhere (added once after the all-reduce, as every row-parallel
    bias). Granite's: gate's rows lo..hi and up's inter + lo..inter + hi, down's columns lo..hi."""
    if style != "gpt_oss":
        if name.endswith("experts.gate_up_proj"):
            return torch.cat([piece[:, lo:hi], piece[:, inter + lo:inter + hi]], dim=1)
        return piece[:, :, lo:hi]
    if name.endswith("experts.gate_up_proj"):
        return piece[:, :, 2 * lo:2 * hi]
    if name.endswith("experts.gate_up_proj_bias"):
        return piece[:, 2 * lo:2 * hi]
    if name.endswith("experts.down_proj"):
        return piece[:, lo:hi, :]
    whole = piece[:]
    return whole if first_rank else torch.zeros_like(whole)
