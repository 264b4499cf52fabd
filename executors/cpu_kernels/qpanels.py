"""int8 matmul weights for the CPU kernels: the 6-column panels of panels.py, a byte a weight,
with a float32 scale for each QGROUP (32) inputs of each output column.

The grouping is llama.cpp's Q8_0: a weight w[j, g*32 : g*32 + 32] is q * scale[j, g], q an
int8 in [-127, 127] and scale = max |w| of the group / 127. A decode row streams 1.125 bytes
a weight instead of 4, and batch-1 decode on a CPU is bound by that stream.

The kernels (weight_panel.h) turn each weight into the float (float)q * scale as they load
it, and from there compute exactly what the float32 kernels compute for the panels of those
dequantized weights, bit for bit, on every path. So `dequantized()` is the model these
weights serve, and the tests hold the int8 path to it exactly (and to transformers, loaded
with the same dequantized weights, within 1e-4).

A GGUF Q8_0 checkpoint converted to float32 (executors/gguf_import.py) quantizes back to its
own q and scales exactly: each dequantized value is q * d with d a float16, the group's
largest |q| is 127, so max |w| / 127 is d again and w / d is q again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from executors.cpu_kernels.panels import PANEL, Panels, pack, panels_numel

QGROUP = 32  # weight_panel.h's QGROUP: inputs that share a scale
QMAX = 127
# The kernels load whole vectors: two bytes past the last panel of int8 weights and two
# floats past the last group of their scales (weight_panel.h's Q8_SLACK_*); every buffer
# the weights are cut from ends with this much room.
SLACK_BYTES = 8
SLACK_FLOATS = 8


class QPanels(NamedTuple):
    """A weight [n, k] as int8 panels: data [ceil(n / PANEL), k, PANEL] int8 and scales
    [ceil(n / PANEL), ceil(k / QGROUP), PANEL] float32, each contiguous and followed by its
    buffer's slack."""

    data: torch.Tensor
    scales: torch.Tensor
    n: int

    @property
    def k(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * 4

    def _expanded_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """Scales [..., groups, X] as one per input [..., k, X]."""
        return scales.repeat_interleave(QGROUP, dim=-2)[..., :self.k, :]

    def dequantized(self, lo: int = 0, hi: int | None = None) -> Panels:
        """Panels [lo, hi) (all by default) as float32 panels of the weights they serve:
        (float)q * scale, as the kernels compute each weight."""
        hi = self.data.shape[0] if hi is None else hi
        data = self.data[lo:hi].float() * self._expanded_scales(self.scales[lo:hi])
        return Panels(data, min(self.n - lo * PANEL, (hi - lo) * PANEL))

    def unpack(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi) of the dequantized [n, k] matrix, as a new contiguous tensor."""
        hi = self.n if hi is None else hi
        first, last = lo // PANEL, -(-hi // PANEL)
        return self.dequantized(first, last).unpack(lo - first * PANEL, hi - first * PANEL)

    def rows(self, lo: int, hi: int) -> QPanels:
        """Rows [lo, hi) as panels sharing this storage (lo a multiple of PANEL); the buffers'
        slack still follows them."""
        if lo % PANEL:
            raise ValueError(f"a panel view starts at a multiple of {PANEL} rows, not {lo}")
        first, last = lo // PANEL, -(-hi // PANEL)
        return QPanels(self.data[first:last], self.scales[first:last], hi - lo)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized [n, k] matrix ([m] -> [m, k]): a tied embedding's lookup."""
        panel, column = ids // PANEL, ids % PANEL
        scales = self.scales[panel, :, column].repeat_interleave(QGROUP, dim=-1)[:, :self.k]
        return self.data[panel, :, column].float() * scales


def qpanels_numel(n: int, k: int) -> tuple[int, int]:
    """(bytes of int8 panels, floats of scales) of a weight [n, k], without the slack."""
    return panels_numel(n, k), panels_numel(n, -(-k // QGROUP))


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
    """w [n, k] as int8 panels, into data_out (int8) and scales_out (float32) where given:
    each at least qpanels_numel(n, k) elements followed by the slack, contiguous (slices of
    arenas); else new buffers with their slack."""
    n, k = w.shape
    size, floats = qpanels_numel(n, k)
    if data_out is None:
        data_out = torch.zeros(size + SLACK_BYTES, dtype=torch.int8)
    if scales_out is None:
        scales_out = torch.zeros(floats + SLACK_FLOATS, dtype=torch.float32)
    for name, out, need, room, dtype in (("data_out", data_out, size, SLACK_BYTES, torch.int8),
                                         ("scales_out", scales_out, floats, SLACK_FLOATS, torch.float32)):
        left = out.untyped_storage().nbytes() // out.element_size() - out.storage_offset()
        if out.dtype != dtype or not out.is_contiguous() or out.numel() < need or left < need + room:
            raise ValueError(f"quantize: {name} must be a contiguous {dtype} buffer of at least {need} elements "
                             f"with {room} more after them in its storage")
    q, scales = quantize_rows(w.detach().to(torch.float32))
    data = pack(q, data_out[:size]).data
    scale_panels = pack(scales, scales_out[:floats]).data
    return QPanels(data, scale_panels, n)
