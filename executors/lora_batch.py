"""Which rows of a step's flat batch use which LoRA adapter, and the deltas they add.

Every adapted projection adds, for the rows of each adapter, (x @ A.T) @ B_scaled.T to the
base output (executors/lora.py reads and checks the adapters). The rows of one adapter are
a slice when they are contiguous, so the common cases (one adapter for the whole batch, or
for one run of it) take views and no gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from executors.lora import LoraAdapter
from executors.models.step_ops import add_rows_


@dataclass(slots=True)
class _Group:
    """One adapter's rows of the flat batch: a slice when contiguous (views, no gather), else indices."""

    adapter: LoraAdapter
    rows: slice | torch.Tensor


class LoraBatch:
    """Which rows of a flat batch use which adapter, built once per step and used by every layer."""

    __slots__ = ("applications", "groups")

    def __init__(self, groups: list[_Group]) -> None:
        self.groups = groups
        self.applications = 0  # (adapter, layer, module) deltas applied by this batch so far

    @staticmethod
    def build(row_ranges: Sequence[tuple[int, int, LoraAdapter | None]], num_rows: int, device) -> LoraBatch | None:
        """row_ranges: (first_row, row_count, adapter or None) per sequence of the flat batch. None when no row has an adapter."""
        by_key: dict[str, tuple[LoraAdapter, list[tuple[int, int]]]] = {}
        for first, count, adapter in row_ranges:
            if adapter is not None and count > 0:
                by_key.setdefault(adapter.key, (adapter, []))[1].append((first, count))
        if not by_key:
            return None
        groups = []
        for adapter, ranges in by_key.values():
            ranges.sort()
            if all(a + n == b for (a, n), (b, _) in pairwise(ranges)):
                rows = slice(ranges[0][0], ranges[-1][0] + ranges[-1][1])  # the whole batch, or one run of it
            else:
                rows = torch.tensor([r for a, n in ranges for r in range(a, a + n)], device=device)
            groups.append(_Group(adapter, rows))
        return LoraBatch(groups)

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += (x[rows] @ A.T) @ B_scaled.T for the rows of each adapter that targets (layer, module).

        x is [M, in]; out is [M, out], possibly a column slice (a view) of a fused output: added in place."""
        for group in self.groups:
            pair = group.adapter.weights.get((layer, module))
            if pair is None:
                continue
            a, b_scaled = pair
            rows = group.rows
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ a.t(), b_scaled.t())
            else:
                add_rows_(out, rows, (x.index_select(0, rows) @ a.t()) @ b_scaled.t())
            self.applications += 1
