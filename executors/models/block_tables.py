"""A step's block tables as one int32 array, as the attention kernels read them.

A decode row reads its sequence's first n block ids; a long context has thousands (2048 at 32K
tokens in 16-token blocks). Building the padded table from Python lists cost 15-50 ns an id
on every step, ms a step at batch 32 and 32K tokens. A row given as an array (a cache's
BlockTable.ids_array(), which the step plan hands each Segment as `table`) is copied by NumPy
in one go instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def padded_block_tables(tables: Sequence[Sequence[int] | np.ndarray], counts: Sequence[int]) -> np.ndarray:
    """int32 [rows, width]: row i holds tables[i][:counts[i]], then zeros; width is the longest row.
    A table shorter than its count gives what it has: the kernels that bound a row's positions by
    the width then refuse it (fused_decode.py), as they did the lists' narrower table."""
    counts = [min(n, len(table)) for table, n in zip(tables, counts)]
    out = np.zeros((len(counts), max(counts)), np.int32)
    for row, (table, n) in enumerate(zip(tables, counts)):
        out[row, :n] = table[:n]
    return out


def segment_table(seg) -> Sequence[int] | np.ndarray:
    """A Segment's block ids: its array where the step plan gave one, else its list."""
    return seg.table if seg.table is not None else seg.block_ids
