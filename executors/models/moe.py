"""Mixture-of-experts layers: top-k routing and grouped expert compute.

`SparseMoe` holds the parameters under the checkpoint's names (moe_config.py) and its
`forward` is the reference: every expert in turn over the rows that picked it, as plainly
as the computation can be written. The fast forward (`moe_forward`) runs on `MoeWeights`,
the experts' weights stacked into [E, 2I, hidden] (gate and up) and [E, hidden, I] (down)
tensors whose slices the expert modules' parameters become (one copy, as decoder.py's
fused q/k/v):

1. the router's softmax and top-k pick k (expert, weight) pairs per row (DeepSeek's and
   GLM-4.5's: within the best groups, `route`);
2. the M*k pairs are sorted by expert (a stable sort), so each expert's rows are one
   contiguous slice of a gathered [M*k, hidden] matrix;
3. every expert with rows runs one gate/up matmul and one down matmul over its slice
   (moe_grouped.py: a loop over the experts that have rows on a CPU, through the CPU
   kernels' panels where the dense layers use them; on CUDA a grouped GEMM, one launch for
   all experts);
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

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from executors.descriptions import ExpertLoad
from executors.models.config import DecoderConfig
from executors.models.layers import MLP, activation
from executors.models.moe_grouped import experts_on_panels, grouped_swiglu
from executors.models.moe_routing import GroupedRouting, expert_counts, route
from executors.models.stacked_experts import StackedExperts, gated
from executors.models.step_ops import add_rows_


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
    """The router's weight ([E, hidden]), GPT-OSS's bias ([E]) and, for sigmoid scoring,
    e_score_correction_bias ([E], float32)."""

    def __init__(self, hidden: int, experts: int, corrected: bool, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts)) if bias else None
        if corrected:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))


class SparseMoe(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        moe = self.config = config.moe
        self.top_k, self.norm_topk_prob, self.num_experts = moe.top_k, moe.norm_topk_prob, moe.num_experts
        sigmoid = moe.scoring == "sigmoid"
        # (GPT-OSS's router is mlp.router, with a bias; Granite's block_sparse_moe.router; the
        # others' mlp.gate or block_sparse_moe.gate)
        setattr(self, moe.router_name, Router(config.hidden_size, moe.num_experts,
                                              sigmoid and not moe.correction_on_block, bias=moe.biased))
        if sigmoid and moe.correction_on_block:  # MiniMax-M2's: on the block, not its router
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts))
        self.act = activation(config.hidden_act)
        if moe.stacked:  # GPT-OSS, Granite: every expert in two tensors (and GPT-OSS's biases)
            self.experts = StackedExperts(config.hidden_size, moe.intermediate_size, moe.num_experts, moe.biased,
                                          gated(self.act, moe.clamp))
        else:
            self.experts = nn.ModuleList(Expert(config.hidden_size, moe.intermediate_size, moe.expert_names)
                                         for _ in range(moe.num_experts))
        if moe.shared_intermediate_size:  # Qwen2-MoE's shared_expert (gated), GLM-4.5's shared_experts
            setattr(self, moe.shared_name, MLP(config, moe.shared_intermediate_size, bias=False))
            if moe.shared_gated:
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    @property
    def router(self) -> Router:
        """The router module, under its checkpoint name (moe_config.MoeConfig.router_name)."""
        return self._modules[self.config.router_name]

    @property
    def shared(self) -> MLP | None:
        return getattr(self, self.config.shared_name, None)

    def grouped_routing(self) -> GroupedRouting | None:
        """DeepSeek's routing (sigmoid scores, or groups, or a scale); None: a plain softmax top k."""
        m = self.config
        if not m.grouped:
            return None
        sigmoid = m.scoring == "sigmoid"
        owner = self if m.correction_on_block else self.router
        correction = owner.e_score_correction_bias.detach() if sigmoid else None
        return GroupedRouting(sigmoid, correction, m.n_group, m.topk_group, m.routed_scaling_factor)

    def forward(self, x: torch.Tensor, load: torch.Tensor | None = None) -> torch.Tensor:
        """The reference: each expert over the rows that picked it, in expert order."""
        weights, experts = route(x, self.router.weight, self.top_k, self.norm_topk_prob, self.grouped_routing(),
                                 self.router.bias)
        if load is not None:
            load += expert_counts(experts, self.num_experts)
        if self.config.stacked:
            out = self.experts(x, weights, experts)
        else:
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
    grouped: GroupedRouting | None = None  # DeepSeek's routers (GLM-4.5's), else a plain softmax
    # GPT-OSS: the router's bias [E], the experts' biases (gate/up's [E, 2I], down's [E, hidden])
    # and their clamped SwiGLU's (limit, alpha).
    router_bias: torch.Tensor | None = None
    expert_biases: tuple[torch.Tensor, torch.Tensor] | None = None
    clamp: tuple[float, float] | None = None
    stacked: bool = False  # the experts' parameters are the stacks themselves (GPT-OSS, Granite)

    def matrices(self) -> list[torch.Tensor]:
        """The expert weights still held as tensors (each expert's gate/up and down, the shared
        expert's): what the CPU kernels would pack."""
        stacks = (*(self.gate_up if self.gate_up is not None else ()), *(self.down if self.down is not None else ()))
        return [t for t in (*stacks, self.shared_gate_up, self.shared_down) if t is not None]


def stack(moe: SparseMoe) -> MoeWeights:
    """Stack the experts' weights and make each expert's parameters views of the stacks (GPT-OSS's
    are stacked already: the weights are its parameters)."""
    shared_gate_up = shared_down = shared_gate = None
    if moe.shared is not None:
        s = moe.shared
        shared_gate_up = torch.cat([s.gate_proj.weight.detach(), s.up_proj.weight.detach()])
        n = s.gate_proj.weight.shape[0]
        s.gate_proj.weight = nn.Parameter(shared_gate_up[:n], requires_grad=False)
        s.up_proj.weight = nn.Parameter(shared_gate_up[n:], requires_grad=False)
        shared_down = s.down_proj.weight.detach()
        shared_gate = moe.shared_expert_gate.weight.detach() if moe.config.shared_gated else None
    if moe.config.stacked:
        e, bias = moe.experts, moe.router.bias
        return MoeWeights(moe.router.weight.detach(), e.gate_up_proj.detach(), e.down_proj.detach(), shared_gate_up,
                          shared_down, shared_gate, moe.top_k, moe.norm_topk_prob,
                          router_bias=None if bias is None else bias.detach(), expert_biases=e.biases(),
                          clamp=moe.config.clamp, stacked=True)
    gate_up = torch.stack([torch.cat([g.weight.detach(), u.weight.detach()])
                           for g, u, _ in (e.projections() for e in moe.experts)])
    down = torch.stack([e.projections()[2].weight.detach() for e in moe.experts])
    inter = gate_up.shape[1] // 2
    for i, expert in enumerate(moe.experts):
        g, u, d = expert.projections()
        g.weight = nn.Parameter(gate_up[i, :inter], requires_grad=False)
        u.weight = nn.Parameter(gate_up[i, inter:], requires_grad=False)
        d.weight = nn.Parameter(down[i], requires_grad=False)
    grouped = moe.grouped_routing()
    router = moe.router.weight.detach()
    if grouped is not None:  # its logits are float32 (moe_routing): the weight converted once, not every step
        router = router.float()
    return MoeWeights(router, gate_up, down, shared_gate_up, shared_down, shared_gate, moe.top_k, moe.norm_topk_prob,
                      grouped=grouped)


def moe_forward(x: torch.Tensor, w: MoeWeights, act: Callable, load: torch.Tensor | None = None) -> torch.Tensor:
    """[M, hidden] -> [M, hidden]: routed experts grouped by expert (module docstring), plus the shared expert."""
    weights, experts = route(x, w.router, w.top_k, w.norm_topk_prob, w.grouped, w.router_bias)
    flat = experts.flatten()
    counts = expert_counts(flat, w.router.shape[0])
    if load is not None:
        load += counts
    order = torch.argsort(flat, stable=True)
    rows = order // w.top_k
    if w.expert_panels is not None:
        ys = experts_on_panels(x.index_select(0, rows), counts, w)
    else:
        row_experts = flat.index_select(0, order) if w.expert_biases is not None else None
        ys = grouped_swiglu(x.index_select(0, rows), counts, w.gate_up, w.down, gated(act, w.clamp),
                            w.expert_biases, row_experts)
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


def load_report(model) -> ExpertLoad | None:
    """GetStatus's per-expert routing counts of a DecoderLM (None without experts)."""
    moe = model.config.moe
    if moe is None:
        return None
    sparse = tuple(i for i, s in enumerate(moe.sparse_layers) if s)
    counts = model.expert_load.tolist()
    return ExpertLoad(moe.num_experts, moe.top_k, sparse, tuple(tuple(counts[i]) for i in sparse))
