"""int8 matmul weights for the CPU kernels: panels of 16 output columns, a byte a weight, with
a float32 scale for each QGROUP (32) inputs of each output column (weight_q8.h).

The grouping is llama.cpp's Q8_0: a weight w[j, g*32 : g*32 + 32] is q * scale[j, g], q an
int8 in [-127, 127] and scale = max |w| of the group / 127. A decode row streams 1.125 bytes
a weight instead of 4, and batch-1 decode on a CPU is bound by that stream.

The kernels turn each weight into the float (float)q * scale as they load it, and from there
compute exactly what the float32 kernels compute for the panels of those dequantized weights,
bit for bit, on every path. So `dequantized()` is the model these weights serve, and the tests
hold the int8 path to it exactly (and to transformers, loaded with the same dequantized
weights, within 1e-4).

A GGUF Q8_0 checkpoint converted to float32 (executors/gguf_import.py) quantizes back to its
own q and scales exactly: each dequantized value is q * d with d a float16, the group's
largest |q| is 127, so max |w| / 127 is d again and w / d is q again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from executors.cpu_kernels.panels import Panels, pack, panels_numel

Q8PANEL = 16  # weight_q8.h's Q8PANEL: output columns of a panel (every lane of a load used)
QGROUP = 32  # weight_q8.h's QGROUP: inputs that share a scale
QMAX = 127


class QPanels(NamedTuple):
    """A weight [n, k] as int8 panels: data [ceil(n / 16), k, 16] int8 and scales
    [ceil(n / 16), ceil(k / 32), 16] float32, each contiguous."""

    data: torch.Tensor
    scales: torch.Tensor
    n: int

    @property
    def k(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * 4

    def unpack(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi) of the dequantized [n, k] matrix ((float)q * scale, as the kernels
        compute each weight), as a new contiguous tensor."""
        hi = self.n if hi is None else hi
        first, last = lo // Q8PANEL, -(-hi // Q8PANEL)
        scales = self.scales[first:last].repeat_interleave(QGROUP, dim=1)[:, :self.k]
        block = (self.data[first:last].float() * scales).transpose(1, 2).reshape(-1, self.k)
        return block[lo - first * Q8PANEL:hi - first * Q8PANEL].contiguous()

    def dequantized(self) -> Panels:
        """The dequantized weight as float32 panels (panels.pack): what the kernels compute with."""
        return pack(self.unpack())

    def rows(self, lo: int, hi: int) -> QPanels:
        """Rows [lo, hi) as panels sharing this storage (lo a multiple of 16): the panels past
        hi compute columns that are never stored."""
        if lo % Q8PANEL:
            raise ValueError(f"an int8 panel view starts at a multiple of {Q8PANEL} rows, not {lo}")
        first, last = lo // Q8PANEL, -(-hi // Q8PANEL)
        return QPanels(self.data[first:last], self.scales[first:last], hi - lo)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized [n, k] matrix ([m] -> [m, k]): a tied embedding's lookup."""
        panel, column = ids // Q8PANEL, ids % Q8PANEL
        scales = self.scales[panel, :, column].repeat_interleave(QGROUP, dim=-1)[:, :self.k]
        return self.data[panel, :, column].float() * scales


def qpanels_numel(n: int, k: int) -> tuple[int, int]:
    """(bytes of int8 panels, floats of scales) of a weight [n, k]."""
    return panels_numel(n, k, Q8PANEL), panels_numel(n, -(-k // QGROUP), Q8PANEL)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k] (finite) as (q [n, k] int8, scales [n, ceil(k / QGROUP)] float32)."""
    if not bool(torch.isfinite(w).all()):
        raise ValueError("int8 quantization needs finite weights; this matrix holds NaN or infinity")
    n, k = w.shape
    groups = -(-k // QGROUP)
    padded = torch.zeros(n, groups * QGROUP, dtype=torch.float32)
    padded[:, :k] = w
    blocks = padded.view(n, groups, QGROUP)
    scales = blocks.abs().amax(dim=-1) / QMAX
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: q 0, scale 0
    q = (blocks / divisor[..., None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(n, groups * QGROUP)[:, :k], scales


def quantize(w: torch.Tensor, data_out: torch.Tensor | None = None,
             scales_out: torch.Tensor | None = None) -> QPanels:
    """w [n, k] as int8 panels, into data_out (int8) and scales_out (float32), contiguous and
    of qpanels_numel(n, k) elements (slices of arenas), where given; else new tensors."""
    q, scales = quantize_rows(w.detach().to(torch.float32))
    data = pack(q, data_out, Q8PANEL).data
    scale_panels = pack(scales, scales_out, Q8PANEL).data
    return QPanels(data, scale_panels, w.shape[0])
