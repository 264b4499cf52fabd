"""A sparse layer's routing: which k experts each row goes to, and with what weights.

A softmax over the router's logits and its top k (Qwen-MoE, Mixtral, OLMoE; renormalised
where norm_topk_prob says), or DeepSeek's routers: V3's (GLM-4.5's) sigmoid scores, a
correction added to choose but not to weigh, the choice made within the best groups of
experts; V2's softmax, within the groups of the best single scores; the weights scaled.
moe.py runs the chosen experts; `expert_counts` is the load GetStatus reports.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class GroupedRouting(NamedTuple):
    """DeepSeek's routers, beside top_k and norm_topk_prob: V3's (GLM-4.5's, MiniMax-M2's)
    sigmoid scores with a correction, or V2's softmax; either choosing within the best groups
    of experts, the chosen weights scaled."""

    sigmoid: bool  # sigmoid scores (else a softmax over the experts)
    correction: torch.Tensor | None  # [E] float32: added to the scores that choose, not to the weights
    n_group: int
    topk_group: int
    scale: float  # routed_scaling_factor


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renorm: bool,
          grouped: GroupedRouting | None = None, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the top k per row (or DeepSeek's routing, `grouped`
    set): (weights [M, k] in x's dtype, experts [M, k]). `bias`: GPT-OSS's router's, whose
    softmax over its top k logits is this one renormalised."""
    if grouped is not None:
        return _route_grouped(x, router, top_k, renorm, grouped)
    probs = torch.softmax(F.linear(x, router, bias), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def _route_grouped(x: torch.Tensor, router: torch.Tensor, top_k: int, renorm: bool,
                   r: GroupedRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """In float32, as DeepseekV3TopkRouter (sigmoid) and DeepseekV2TopkRouter (softmax): each
    group scored by its two best corrected sigmoid scores (V3) or its best softmax score (V2's
    group_limited_greedy), the topk_group best groups kept; the top k (corrected) scores among
    their experts choose, the uncorrected ones weigh (renormalised where asked, then scaled)."""
    logits = F.linear(x.float(), router.float())
    scores = logits.sigmoid() if r.sigmoid else logits.softmax(dim=-1)
    choice = scores if r.correction is None else scores + r.correction
    if r.n_group > 1:
        m, experts = choice.shape
        grouped = choice.view(m, r.n_group, experts // r.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if r.sigmoid else grouped.amax(dim=-1)
        best = group_scores.topk(r.topk_group, dim=-1)[1]  # [m, topk_group]
        keep = torch.zeros(m, r.n_group, dtype=torch.bool, device=x.device).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(m, experts)
    chosen = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, chosen)
    if renorm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * r.scale).to(x.dtype), chosen


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert ([E] int64). A scatter-add, not bincount, which reads the largest id
    back to the host: a CUDA graph can capture this."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
