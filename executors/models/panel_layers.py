"""The modules a float32 CPU model's matmul weights become once packed as the CPU kernels'
panels (panel_modules.py packs them): PanelLinear for an nn.Linear, PanelEmbedding for a tied
embedding, PanelStack for stacked experts' matrix. Each keeps its module's name and logical
shape, and gives its weight back on request, unpacked (a new tensor), for what reads it
outside the fast forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executors.cpu_kernels.panels import Panels
from executors.cpu_kernels.qpanels import QPanels


class _OverPanels(nn.Module):
    """What PanelLinear and PanelEmbedding share: a state_dict loads into row-major modules only."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        error_msgs.append(f"{prefix.rstrip('.')}: the weights are stored as panels; load a state_dict before "
                          "fuse(), or call panel_modules.unpack_model() first")


def stored(panels: nn.Parameter, scales: nn.Parameter | None, n: int) -> Panels | QPanels:
    """The weight a module's parameters hold: float32 panels, or int8 ones with their scales."""
    if scales is None:
        return Panels(panels.detach(), n)
    return QPanels(panels.detach(), scales.detach(), n)


class PanelLinear(_OverPanels):
    """nn.Linear over rows [lo, hi) of panels shared with its siblings (q/k/v, gate/up)."""

    def __init__(self, panels: nn.Parameter, n: int, lo: int, hi: int, bias: nn.Parameter | None,
                 scales: nn.Parameter | None = None) -> None:
        super().__init__()
        self.panels = panels  # the same Parameter in every sibling: counted once
        self.scales = scales  # int8 panels' scales (the same Parameter in every sibling), else None
        self.n, self.lo, self.hi = n, lo, hi
        self.bias = bias
        self.in_features, self.out_features = panels.shape[1], hi - lo

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight (unpacked, dequantized where int8: a new tensor on each access)."""
        return stored(self.panels, self.scales, self.n).unpack(self.lo, self.hi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()


class PanelEmbedding(_OverPanels):
    """nn.Embedding over a tied embedding stored as the lm_head's panels."""

    def __init__(self, panels: nn.Parameter, n: int, scales: nn.Parameter | None = None) -> None:
        super().__init__()
        self.panels = panels
        self.scales = scales
        self.num_embeddings, self.embedding_dim = n, panels.shape[1]

    @property
    def weight(self) -> torch.Tensor:
        return stored(self.panels, self.scales, self.num_embeddings).unpack()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings})")
        return stored(self.panels, self.scales, self.num_embeddings).embedding(ids)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight


class PanelStack(_OverPanels):
    """Stacked experts' matrix [E, n, k] (GPT-OSS's and Granite's `experts.gate_up_proj` or
    `down_proj`) as E experts' panels, consecutive in one region: `expert(e)` the kernels'
    weight of expert e, `[e]` its [n, k] matrix and `weight` the stack (unpacked, new tensors)
    for the reference forward and the digest."""

    def __init__(self, panels: nn.Parameter, scales: nn.Parameter | None, n: int) -> None:
        super().__init__()
        self.panels, self.scales, self.n = panels, scales, n  # [E, *one expert's panels' shape]

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.panels.shape[0], self.n, self.panels.shape[2]

    def expert(self, e: int) -> Panels | QPanels:
        return Panels(self.panels[e], self.n) if self.scales is None else QPanels(self.panels[e], self.scales[e], self.n)

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.expert(e).unpack()

    @property
    def weight(self) -> torch.Tensor:
        return torch.stack([self[e] for e in range(self.shape[0])])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix.removesuffix(".")] = self.weight
