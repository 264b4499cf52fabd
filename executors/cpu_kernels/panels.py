"""The float32 matmul weights' layout for the CPU kernels (weight_panel.h): 6-column panels.

A weight w [n, k] of y = x @ w.T is stored as ceil(n / 6) panels of [k, 6], panel j
holding w[6 j : 6 j + 6].T, zero-padded past n. The kernels read it for steps of every
size: decode rows at the memory's rate, 8-32 rows 10-26 % faster than 16-column panels
did, prefills near MKL's best sgemm (bench/RESULTS.md runs 11 and 16), so it is the
weight's one copy; `unpack` gives the [n, k] matrix back where something needs that (the
reference forward, the weights' digest).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PANEL = 6  # weight_panel.h's WPANEL


class Panels(NamedTuple):
    """A weight [n, k] as panels: data [ceil(n / PANEL), k, PANEL], float32, contiguous."""

    data: torch.Tensor
    n: int

    @property
    def k(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def unpack(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi) of the [n, k] matrix, as a new contiguous tensor."""
        hi = self.n if hi is None else hi
        first, last = lo // PANEL, -(-hi // PANEL)
        block = self.data[first:last].transpose(1, 2).reshape(-1, self.k)
        return block[lo - first * PANEL:hi - first * PANEL].contiguous()

    def rows(self, lo: int, hi: int) -> Panels:
        """Rows [lo, hi) as panels sharing this storage (lo a multiple of PANEL): the panels
        past hi compute columns that are never stored."""
        if lo % PANEL:
            raise ValueError(f"a panel view starts at a multiple of {PANEL} rows, not {lo}")
        return Panels(self.data[lo // PANEL:-(-hi // PANEL)], hi - lo)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the [n, k] matrix ([m] -> [m, k]): a tied embedding's lookup."""
        return self.data[ids // PANEL, :, ids % PANEL]


def panels_numel(n: int, k: int, width: int = PANEL) -> int:
    """Elements of a weight [n, k] as panels of `width` columns."""
    return -(-n // width) * k * width


def pack(w: torch.Tensor, out: torch.Tensor | None = None, width: int = PANEL) -> Panels:
    """w [n, k] (any strides) as panels of `width` columns (the int8 weights' are 16 wide,
    qpanels.py): a copy, into `out` (panels_numel(n, k, width) contiguous elements, e.g. a
    slice of an arena) where given."""
    n, k = w.shape
    count, full = -(-n // width), n // width
    if out is None:
        out = torch.empty(count * k * width, dtype=w.dtype, device=w.device)
    data = out.view(count, k, width)
    data[:full].copy_(w[:full * width].reshape(full, width, k).transpose(1, 2))
    if full < count:  # the last panel, zero-padded past n
        data[full].zero_()
        data[full, :, :n - full * width].copy_(w[full * width:].T)
    return Panels(data, n)
