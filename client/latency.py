"""Latency of a batch of completions: time to first token and inter-token latency.

TTFT is per request (first token minus submission). Inter-token latency is per request the
mean gap between its successive tokens (`Completion.itl_s`); summarised, it is taken over
every gap of every request, so the p99 shows the rare long gap (a cache move, a
preemption) that per-request means would hide.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LatencySummary", "Percentiles", "summarize_latency"]


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Mean, median and 99th percentile (linear interpolation) of `count` values, in seconds."""

    count: int
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Percentiles | None:
        v = np.asarray(list(values), dtype=np.float64)
        if v.size == 0:
            return None
        return cls(int(v.size), float(v.mean()), float(np.percentile(v, 50)), float(np.percentile(v, 99)))

    def __str__(self) -> str:
        return f"mean {self.mean:.3f}s p50 {self.p50:.3f}s p99 {self.p99:.3f}s"


@dataclass(frozen=True, slots=True)
class LatencySummary:
    ttft: Percentiles | None  # over requests that produced a token
    itl: Percentiles | None  # over all gaps between successive tokens of a request

    def __str__(self) -> str:
        return (f"latency: first token {self.ttft or 'n/a'}; "
                f"inter-token {self.itl or 'n/a'}")


def summarize_latency(completions: Sequence[Any]) -> LatencySummary:
    """Summary of Completions (client.scheduler); requests without tokens are left out."""
    ttft = Percentiles.of(c.ttft_s for c in completions if c.ttft_s is not None)
    gaps = Percentiles.of(float(g) for c in completions for g in np.diff(c.token_times))
    return LatencySummary(ttft, gaps)
