"""Weight layouts for float32 matmuls on a CPU, chosen at load by timing the real weights.

A decode step at batch 1 is a chain of one-row matmuls that read every weight once, so its
speed is the rate at which those reads go. MKL reads a weight stored [out, in] row by row
(F.linear's natural layout) at ~12-13 GB/s on the 2-core EPYC of bench/RESULTS.md, and the
same weight stored column-major (its transpose contiguous) at ~20-23 GB/s when the output is
wide (gate/up, the lm_head); for a narrow output with a long input (down) row-major is the
faster one. Steps of 64 rows and more run at the same speed in either layout (within 5 %),
and steps of 2-48 rows use oneDNN's packed copies where the model has them.

So at load, each kind of weight is timed at one row in both layouts, on the model's own
tensors (several layers in turn, so that none is read from cache), and stored in the
faster: one copy, no extra memory. F.linear takes either layout (a column-major weight is
the transpose of a contiguous matrix, which MKL reads as a non-transposed operand), so no
call changes; the modules' parameters stay views of the one copy.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from executors.models.decoder import DecoderLM

log = logging.getLogger(__name__)

KINDS = ("qkv", "o", "gate_up", "down", "lm_head")
SAMPLE_LAYERS = 4  # layers of a kind timed in turn: more weight than a CPU's caches hold
ROUNDS = 5
WIN = 0.95  # the column-major layout must be at least this much faster to be chosen


def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix stored column-major (a copy)."""
    return w.t().contiguous().t()


def is_column_major(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.stride(0) == 1 and w.stride(1) == w.shape[0] and w.shape[1] > 1


def wanted(model: DecoderLM) -> bool:
    """Layouts are chosen for float32 models on a CPU (bfloat16 uses oneDNN's packed weights)."""
    w = model.model.embed_tokens.weight
    return w.device.type == "cpu" and w.dtype == torch.float32


def one_row_speedup(weights: list[torch.Tensor]) -> float:
    """How many times faster a one-row F.linear over `weights` (in turn) runs when they are
    stored column-major; rounds of the two layouts interleave and each keeps its best."""
    x = torch.randn(1, weights[0].shape[1], dtype=weights[0].dtype)
    layouts = {"row": weights, "col": [column_major(w) for w in weights]}
    best = dict.fromkeys(layouts, float("inf"))
    with torch.inference_mode():
        for _ in range(ROUNDS + 1):  # the first round warms up
            for name, ws in layouts.items():
                started = time.perf_counter()
                for w in ws:
                    F.linear(x, w)
                best[name] = min(best[name], time.perf_counter() - started)
    return best["row"] / best["col"]


def choose(model: DecoderLM) -> dict[str, float]:
    """The one-row speed-up of the column-major layout, for each kind of weight."""
    fused = model.fused
    speedups = {}
    for kind in KINDS[:-1]:
        # Sparse (MoE) layers have no dense gate_up/down: their experts keep the row-major stacks.
        present = [w for w in fused if getattr(w, kind) is not None]
        step = max(len(present) // SAMPLE_LAYERS, 1)
        picked = present[::step][:SAMPLE_LAYERS]
        speedups[kind] = one_row_speedup([getattr(w, kind) for w in picked]) if picked else 0.0
    speedups["lm_head"] = one_row_speedup([model.head_weight()])
    return speedups


def _reparent(modules: list[nn.Linear], weight: torch.Tensor) -> None:
    """Make the modules' weights consecutive row slices of `weight` again."""
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        row += n


def apply(model: DecoderLM, speedups: dict[str, float]) -> list[str]:
    """Store each kind whose speed-up clears WIN column-major; returns those kinds."""
    chosen = [k for k in KINDS if speedups[k] > 1 / WIN]
    fused = []
    for layer, w in zip(model.model.layers, model.fused):
        a, mlp = layer.self_attn, layer.ffn
        changes = {}
        if w.gate_up is None:  # a sparse layer: attention only
            chosen_here = [k for k in chosen if k in ("qkv", "o")]
        else:
            chosen_here = chosen
        if "qkv" in chosen_here:
            changes["qkv"] = column_major(w.qkv)
            _reparent([getattr(a, name) for name in a.fused_names], changes["qkv"])
        if "gate_up" in chosen_here:
            changes["gate_up"] = column_major(w.gate_up)
            _reparent([getattr(mlp, name) for name in mlp.gate_up_names], changes["gate_up"])
        if "o" in chosen_here:
            changes["o"] = column_major(w.o)
            _reparent([a.o_proj], changes["o"])
        if "down" in chosen_here:
            changes["down"] = column_major(w.down)
            _reparent([mlp.down_proj], changes["down"])
        fused.append(w._replace(**changes))
    model.fused = fused
    if "lm_head" in chosen:
        owner = model.model.embed_tokens if model.config.tie_word_embeddings else model.lm_head
        owner.weight = nn.Parameter(column_major(owner.weight.detach()), requires_grad=False)
    return chosen


def relayout(model: DecoderLM) -> None:
    """Choose and apply (see the module docstring); logs the figures behind the choice."""
    speedups = choose(model)
    chosen = apply(model, speedups)
    log.info("float32 weight layouts, timed at one row: %s",
             ", ".join(f"{k} {'column' if k in chosen else 'row'}-major ({speedups[k]:.2f}x)" for k in KINDS))
