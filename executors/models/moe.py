"""Mixture-of-experts layers: top-k routing and grouped expert compute.

`SparseMoe` holds the parameters under the checkpoint's names (moe_config.py) and its
`forward` is the reference: every expert in turn over the rows that picked it, as plainly
as the computation can be written. The fast forward (`moe_forward`) runs on `MoeWeights`,
the experts' weights stacked into [E, 2I, hidden] (gate and up) and [E, hidden, I] (down)
tensors whose slices the expert modules' parameters become (one copy, as decoder.py's
fused q/k/v):

1. the router's softmax and top-k pick k (expert, weight) pairs per row (GLM-4.5: its
   sigmoid scores, corrected, within the best groups, `route`);
2. the M*k pairs are sorted by expert (a stable sort), so each expert's rows are one
   contiguous slice of a gathered [M*k, hidden] matrix;
3. every expert with rows runs one gate/up matmul and one down matmul over its slice
   (`grouped_swiglu`: a loop over the experts that have rows, on a CPU, through the CPU
   kernels' panels where the dense layers use them (`experts_on_panels`); on CUDA torch's
   grouped GEMM or the Triton kernel of moe_triton.py, one launch for all experts);
4. the rows are scaled by their weights and added back in place (step_ops.add_rows_).

An expert that no row picked costs nothing; a decode step at batch 1 with top-2 reads two
experts' weights. Each call adds its per-expert row counts to a `load` tensor (no host
sync), which GetStatus reports so a scheduler can see imbalance.

Tensor parallelism (executors/parallel/shard.py) splits each routed expert like a dense
MLP: every rank holds all E experts with 1/N of their intermediate rows, so routing needs
no exchange (the router is replicated and every rank picks the same experts), the grouped
compute runs unchanged on narrower experts, and the layer's output is one all-reduce, as a
dense layer's. Splitting experts whole across ranks (expert parallelism) would read each
expert's weights at full width but cost an exchange of rows per sparse layer; it is not
built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from executors.descriptions import ExpertLoad
from executors.models.config import DecoderConfig
from executors.models.layers import MLP, activation
from executors.models.moe_routing import SigmoidRouting, expert_counts, route
from executors.models.step_ops import add_rows_

# Grouped GEMM implementation on CUDA: "torch" (torch._grouped_mm), "triton"
# (moe_triton.py) or "loop" (the CPU loop); chosen at the first use by `grouped_backend`.
_BACKENDS: dict[tuple[str, torch.dtype], str] = {}

log = logging.getLogger(__name__)


class Expert(nn.Module):
    """One routed expert's gated MLP, its projections named as the checkpoint names them."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False))
        setattr(self, up, nn.Linear(hidden, inter, bias=False))
        setattr(self, down, nn.Linear(inter, hidden, bias=False))

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, n) for n in self.names)


class Router(nn.Module):
    """The router's weight ([E, hidden]) and, for sigmoid scoring, e_score_correction_bias ([E], float32)."""

    def __init__(self, hidden: int, experts: int, corrected: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        if corrected:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))


class SparseMoe(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        moe = self.config = config.moe
        self.top_k, self.norm_topk_prob, self.num_experts = moe.top_k, moe.norm_topk_prob, moe.num_experts
        sigmoid = moe.scoring == "sigmoid"
        self.gate = Router(config.hidden_size, moe.num_experts, sigmoid and not moe.correction_on_block)
        if sigmoid and moe.correction_on_block:  # MiniMax-M2's: on the block, not its router
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts))
        self.experts = nn.ModuleList(Expert(config.hidden_size, moe.intermediate_size, moe.expert_names)
                                     for _ in range(moe.num_experts))
        if moe.shared_intermediate_size:  # Qwen2-MoE's shared_expert (gated), GLM-4.5's shared_experts
            setattr(self, moe.shared_name, MLP(config, moe.shared_intermediate_size, bias=False))
            if moe.shared_gated:
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.act = activation(config.hidden_act)

    @property
    def shared(self) -> MLP | None:
        return getattr(self, self.config.shared_name, None)

    def sigmoid_routing(self) -> SigmoidRouting | None:
        m = self.config
        if m.scoring != "sigmoid":
            return None
        owner = self if m.correction_on_block else self.gate
        return SigmoidRouting(owner.e_score_correction_bias.detach(), m.n_group, m.topk_group, m.routed_scaling_factor)

    def forward(self, x: torch.Tensor, load: torch.Tensor | None = None) -> torch.Tensor:
        """The reference: each expert over the rows that picked it, in expert order."""
        weights, experts = route(x, self.gate.weight, self.top_k, self.norm_topk_prob, self.sigmoid_routing())
        if load is not None:
            load += expert_counts(experts, self.num_experts)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(experts == e)
            if rows.numel() == 0:
                continue
            gate, up, down = expert.projections()
            y = down(self.act(gate(x[rows])) * up(x[rows]))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:
            shared = self.shared(x)
            out += torch.sigmoid(self.shared_expert_gate(x)) * shared if self.config.shared_gated else shared
        return out


class MoeWeights(NamedTuple):
    """One sparse layer's tensors for the fast forward (the expert parameters are views of them)."""

    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor | None  # [E, 2I, hidden]; None once the experts are panels
    down: torch.Tensor | None  # [E, hidden, I]
    shared_gate_up: torch.Tensor | None  # [2S, hidden]
    shared_down: torch.Tensor | None  # [hidden, S]
    shared_gate: torch.Tensor | None  # [1, hidden]; None where the shared experts have no gate (GLM-4.5)
    top_k: int
    norm_topk_prob: bool
    # float32 on a CPU with the kernels (panel_modules.pack_model): each expert's (gate/up,
    # down) and the shared expert's as the kernels' panels, the weights' one copy, instead of
    # the stacks above; `kernels` runs them and `glu` names their activation.
    expert_panels: tuple | None = None
    shared_panels: tuple | None = None
    kernels: object | None = None
    glu: str = "silu"
    sigmoid: SigmoidRouting | None = None  # GLM-4.5's router, else a softmax

    def matrices(self) -> list[torch.Tensor]:
        """The expert weights still held as tensors (each expert's gate/up and down, the shared
        expert's): what the CPU kernels would pack."""
        stacks = (*(self.gate_up if self.gate_up is not None else ()), *(self.down if self.down is not None else ()))
        return [t for t in (*stacks, self.shared_gate_up, self.shared_down) if t is not None]


def stack(moe: SparseMoe) -> MoeWeights:
    """Stack the experts' weights and make each expert's parameters views of the stacks."""
    gate_up = torch.stack([torch.cat([g.weight.detach(), u.weight.detach()])
                           for g, u, _ in (e.projections() for e in moe.experts)])
    down = torch.stack([e.projections()[2].weight.detach() for e in moe.experts])
    inter = gate_up.shape[1] // 2
    for i, expert in enumerate(moe.experts):
        g, u, d = expert.projections()
        g.weight = nn.Parameter(gate_up[i, :inter], requires_grad=False)
        u.weight = nn.Parameter(gate_up[i, inter:], requires_grad=False)
        d.weight = nn.Parameter(down[i], requires_grad=False)
    shared_gate_up = shared_down = shared_gate = None
    if moe.shared is not None:
        s = moe.shared
        shared_gate_up = torch.cat([s.gate_proj.weight.detach(), s.up_proj.weight.detach()])
        n = s.gate_proj.weight.shape[0]
        s.gate_proj.weight = nn.Parameter(shared_gate_up[:n], requires_grad=False)
        s.up_proj.weight = nn.Parameter(shared_gate_up[n:], requires_grad=False)
        shared_down = s.down_proj.weight.detach()
        shared_gate = moe.shared_expert_gate.weight.detach() if moe.config.shared_gated else None
    sigmoid = moe.sigmoid_routing()
    router = moe.gate.weight.detach()
    if sigmoid is not None:  # its logits are float32 (moe_routing): the weight converted once, not every step
        router = router.float()
    return MoeWeights(router, gate_up, down, shared_gate_up, shared_down, shared_gate, moe.top_k, moe.norm_topk_prob,
                      sigmoid=sigmoid)


def moe_forward(x: torch.Tensor, w: MoeWeights, act: Callable, load: torch.Tensor | None = None) -> torch.Tensor:
    """[M, hidden] -> [M, hidden]: routed experts grouped by expert (module docstring), plus the shared expert."""
    weights, experts = route(x, w.router, w.top_k, w.norm_topk_prob, w.sigmoid)
    flat = experts.flatten()
    counts = expert_counts(flat, w.router.shape[0])
    if load is not None:
        load += counts
    order = torch.argsort(flat, stable=True)
    rows = order // w.top_k
    if w.expert_panels is not None:
        ys = experts_on_panels(x.index_select(0, rows), counts, w)
    else:
        ys = grouped_swiglu(x.index_select(0, rows), counts, w.gate_up, w.down, act)
    ys.mul_(weights.flatten().index_select(0, order).unsqueeze(1))
    out = add_rows_(torch.zeros_like(x), rows, ys)
    if w.shared_panels is not None:
        gate_up, down = w.shared_panels
        shared = w.kernels.linear(w.kernels.linear(x, gate_up), down, glu=w.glu)
    elif w.shared_gate_up is not None:
        s = w.shared_down.shape[1]
        gu = F.linear(x, w.shared_gate_up)
        shared = F.linear(act(gu[:, :s]).mul_(gu[:, s:]), w.shared_down)
    else:
        return out
    if w.shared_gate is None:  # GLM-4.5's shared experts: no gate
        return out.add_(shared)
    return out.addcmul_(torch.sigmoid(F.linear(x, w.shared_gate)), shared)


def grouped_swiglu(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   act: Callable) -> torch.Tensor:
    """Rows sorted by expert (counts[e] rows for expert e, in order) through their experts."""
    backend = grouped_backend(xs.device, xs.dtype)
    if backend == "loop":
        return grouped_swiglu_loop(xs, counts, gate_up, down, act)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    inter = down.shape[2]
    if backend == "torch":
        gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends)
        return torch._grouped_mm(act(gu[:, :inter]).mul_(gu[:, inter:]), down.transpose(1, 2), offs=ends)
    from executors.models import moe_triton

    gu = moe_triton.grouped_matmul(xs, gate_up, ends)
    return moe_triton.grouped_matmul(act(gu[:, :inter]).mul_(gu[:, inter:]), down, ends)


def grouped_swiglu_loop(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        act: Callable) -> torch.Tensor:
    """One gate/up and one down matmul per expert that has rows, over its contiguous slice."""
    out = torch.empty(xs.shape[0], down.shape[1], dtype=xs.dtype, device=xs.device)
    inter, start = down.shape[2], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gu = F.linear(xs[start:start + n], gate_up[e])
            torch.mm(act(gu[:, :inter]).mul_(gu[:, inter:]), down[e].t(), out=out[start:start + n])
            start += n
    return out


def experts_on_panels(xs: torch.Tensor, counts: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """grouped_swiglu_loop through the CPU kernels: each expert with rows streams its panels once,
    the activation applied as the down matmul packs its input."""
    kernels, out, start = w.kernels, torch.empty_like(xs), 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate_up, down = w.expert_panels[e]
            out[start:start + n] = kernels.linear(kernels.linear(xs[start:start + n], gate_up), down, glu=w.glu)
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


def load_report(model) -> ExpertLoad | None:
    """GetStatus's per-expert routing counts of a DecoderLM (None without experts)."""
    moe = model.config.moe
    if moe is None:
        return None
    sparse = tuple(i for i, s in enumerate(moe.sparse_layers) if s)
    counts = model.expert_load.tolist()
    return ExpertLoad(moe.num_experts, moe.top_k, sparse, tuple(tuple(counts[i]) for i in sparse))
