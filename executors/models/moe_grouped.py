"""A sparse layer's routed rows through their experts, grouped by expert (moe.py sorts them).

Rows sorted by expert (counts[e] rows for expert e, in order) run one gate/up matmul and one
down matmul per expert that has rows: a loop over those experts on a CPU (through the CPU
kernels' panels where the dense layers use them, `experts_on_panels`); on CUDA torch's
grouped GEMM or the Triton kernel of moe_triton.py, one launch for all experts. `glu` maps
the [n, 2I] gate/up rows to [n, I] (act(gate) * up, or GPT-OSS's clamped SwiGLU:
stacked_experts.gated); GPT-OSS's experts add a bias to each matmul's output, gathered per
row by its expert (`row_experts`), which needs no host sync and so captures into a graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from executors.models.stacked_experts import clamped_swiglu

if TYPE_CHECKING:
    from executors.models.moe import MoeWeights

Glu = Callable[[torch.Tensor], torch.Tensor]
# Grouped GEMM implementation on CUDA: "torch" (torch._grouped_mm), "triton"
# (moe_triton.py) or "loop" (the CPU loop); chosen at the first use by `grouped_backend`.
_BACKENDS: dict[tuple[str, torch.dtype], str] = {}

log = logging.getLogger(__name__)


def grouped_swiglu(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, glu: Glu,
                   biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                   row_experts: torch.Tensor | None = None) -> torch.Tensor:
    """Rows sorted by expert through their experts: gate_up [E, 2I, hidden], down [E, hidden, I];
    `biases` (gate/up's [E, 2I], down's [E, hidden]) with each row's expert in `row_experts`."""
    backend = grouped_backend(xs.device, xs.dtype)
    if backend == "loop":
        return grouped_swiglu_loop(xs, counts, gate_up, down, glu, biases)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    if backend == "torch":
        def matmul(x, w):
            return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
    else:
        from executors.models import moe_triton

        def matmul(x, w):
            return moe_triton.grouped_matmul(x, w, ends)
    gu = matmul(xs, gate_up)
    if biases is not None:
        gu += biases[0].index_select(0, row_experts)
    out = matmul(glu(gu), down)
    if biases is not None:
        out += biases[1].index_select(0, row_experts)
    return out


def grouped_swiglu_loop(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, glu: Glu,
                        biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One gate/up and one down matmul per expert that has rows, over its contiguous slice."""
    out = torch.empty(xs.shape[0], down.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            if biases is None:
                torch.mm(glu(F.linear(xs[start:start + n], gate_up[e])), down[e].t(), out=out[start:start + n])
            else:
                gu = F.linear(xs[start:start + n], gate_up[e], biases[0][e])
                out[start:start + n] = F.linear(glu(gu), down[e], biases[1][e])
            start += n
    return out


def experts_on_panels(xs: torch.Tensor, counts: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """grouped_swiglu_loop through the CPU kernels: each expert with rows streams its panels once,
    the activation applied as the down matmul packs its input (GPT-OSS's biases added by the
    kernels, its clamped SwiGLU in torch between them)."""
    kernels, out, start, biases = w.kernels, torch.empty_like(xs), 0, w.expert_biases
    for e, n in enumerate(counts.tolist()):
        if n:
            gate_up, down = w.expert_panels[e]
            rows = xs[start:start + n]
            if biases is None and w.clamp is None:
                out[start:start + n] = kernels.linear(kernels.linear(rows, gate_up), down, glu=w.glu)
            else:
                gu = kernels.linear(rows, gate_up, None if biases is None else biases[0][e])
                h = clamped_swiglu(gu, *w.clamp) if w.clamp is not None else kernels.glu(gu, w.glu)
                out[start:start + n] = kernels.linear(h, down, None if biases is None else biases[1][e])
            start += n
    return out


def grouped_backend(device: torch.device, dtype: torch.dtype) -> str:
    """"loop" on a CPU; on CUDA torch's grouped GEMM where this torch has one that runs for the
    dtype here, else the Triton kernel where triton is installed, else the loop."""
    key = (str(device), dtype)
    if key not in _BACKENDS:
        _BACKENDS[key] = _pick_backend(device, dtype)
    return _BACKENDS[key]


def _pick_backend(device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cuda":
        return "loop"
    gate_up = torch.randn(3, 64, 32, device=device, dtype=dtype)
    xs = torch.randn(5, 32, device=device, dtype=dtype)
    counts = torch.tensor([2, 0, 3], device=device)
    want = torch.cat([xs[:2] @ gate_up[0].t(), xs[2:] @ gate_up[2].t()]).float()
    ends = torch.cumsum(counts, 0).to(torch.int32)
    if hasattr(torch, "_grouped_mm"):
        try:  # some builds have it only for bfloat16 on recent GPUs: check it here
            got = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends).float()
            if torch.allclose(got, want, atol=5e-2, rtol=5e-2):
                return "torch"
        except (RuntimeError, NotImplementedError):
            pass
    why = "its result differs from the plain matmuls"
    try:
        from executors.models import moe_triton

        got = moe_triton.grouped_matmul(xs, gate_up, ends).float()
        if torch.allclose(got, want, atol=5e-2, rtol=5e-2):
            return "triton"
    except Exception as e:  # noqa: BLE001 - no triton, or a kernel that does not build here: the loop works
        why = f"{type(e).__name__}: {e}"
    log.warning("MoE on %s: no grouped GEMM (torch._grouped_mm unusable here, the Triton kernel: %s); experts run "
                "one matmul each", xs.device, why)
    return "loop"
