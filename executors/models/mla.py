"""DeepSeek V2's and V3's multi-head latent attention (MLA), attending in the latent space.

transformers expands each cached latent c (kv_a_layernorm's output, [R]) into every head's
key k_h = W_UK_h c and value v_h = W_UV_h c (kv_b_proj's rows), then attends as multi-head
attention. Both products fold into the other side of the dot products:

    q_h . k_h = (W_UK_h^T q_h) . c        sum_t p_t v_h(t) = W_UV_h sum_t p_t c_t

so each head's query is absorbed into the latent space once ([nope] -> [R]), attention runs
over the latents themselves, and its output per head is expanded once ([R] -> [v_head_dim]).
With the rotary parts appended (the query's own, and the one rotary key every head shares),
that is grouped-query attention with a single KV head whose rows are [c | k_rope]
(kv_lora_rank + qk_rope_head_dim wide), read as its own values: every attention path (the
planned SDPA calls, the CPU kernels, the Triton kernels, the reference) serves it unchanged,
and the pool caches one such row a token a layer, as DeepSeek's inference code does, instead
of every head's key and value (for DeepSeek V3, 576 numbers instead of 40,960). The value
rows' rotary tail comes out of attention too and is dropped before the expansion.

The pool holds each row once: its V half is its K half (kvcache.kv_pool's `values_are_keys`),
so the paths that read a value read the key, and a V write is dropped.

Rotary pairs: DeepSeek's are neighbours (2i, 2i + 1), which every path here rotates as NeoX
halves: the loader reorders the rope rows of the query projection and of kv_a_proj_with_mqa
(`served`), which leaves every dot product as it was.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from executors.models.attention_reference import attend_reference
from executors.models.config import DecoderConfig, MlaConfig
from executors.models.layers import RMSNorm, RotaryEmbedding
from executors.models.partial_rotary import head_order

# q_a_layernorm's and kv_a_layernorm's epsilon: transformers' and DeepSeek's code leave those
# norms at their class default, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]


class LatentAttention(nn.Module):
    """An MLA layer's parameters under the checkpoints' names (self_attn.q_a_proj, ...)."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        c, m = config, config.mla
        self.layer, self.num_heads, self.mla = layer, c.num_heads, m
        heads, hidden = c.num_heads, c.hidden_size
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=c.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.latent_dim, bias=c.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, hidden, bias=c.o_bias)

    @property
    def fused_names(self) -> tuple[str, str]:
        """The projections of the hidden state, fused into the fast forward's one matmul (its `qkv`)."""
        return ("q_proj" if self.mla.q_lora_rank is None else "q_a_proj"), "kv_a_proj_with_mqa"

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding | None, ctx,
                mean_over_ranks=None) -> torch.Tensor:
        """The reference: the projections one by one, attention through attend_reference."""
        first, kv_a = (getattr(self, name) for name in self.fused_names)
        a = self.attend(torch.cat([first(x), kv_a(x)], dim=-1), positions, rope, ctx, attend_reference)
        out = self.o_proj(a)
        if ctx.lora is not None:  # adapters on o_proj alone (lora_targets.py)
            ctx.lora.apply(self.layer, "o_proj", a, out)
        return out

    def attend(self, projected: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx,
               attend: Attend, q_b: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """[M, q width + latent row] (the hidden state's projections: q_a_proj's or q_proj's,
        then kv_a_proj_with_mqa's) -> the heads' outputs [M, H * v_head_dim], before o_proj.
        The latent rows go into the pool through `attend` (attention.attend or the reference);
        `q_b`: q_b_proj as the fast forward's matmul op runs it (its panels), else the module."""
        m, heads, c = projected.shape[0], self.num_heads, self.mla
        nope, rank = c.qk_nope_head_dim, c.kv_lora_rank
        q, kv = projected[:, :-c.latent_dim], projected[:, -c.latent_dim:]
        if c.q_lora_rank is not None:
            q = (q_b or self.q_b_proj)(self.q_a_layernorm(q))
        q = q.view(m, heads, c.qk_head_dim)
        q_rope, k_rope = rope(q[..., nope:], kv[:, rank:].view(m, 1, c.qk_rope_head_dim), positions)
        expand = self.expansion()
        queries = torch.cat([absorb(q[..., :nope], expand[:, :nope]), q_rope], dim=-1)  # [M, H, latent row]
        rows = torch.cat([self.kv_a_layernorm(kv[:, :rank]), k_rope.view(m, -1)], dim=-1).view(m, 1, c.latent_dim)
        out = attend(self.layer, queries, rows, rows, ctx).view(m, heads, c.latent_dim)
        return expand_values(out[..., :rank], expand[:, nope:]).reshape(m, heads * c.v_head_dim)

    def expansion(self) -> torch.Tensor:
        """kv_b_proj's weight per head, [H, nope + v, R]: each head's W_UK rows, then its W_UV rows."""
        c = self.mla
        return self.kv_b_proj.weight.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)


def absorb(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Each head's non-rotary query into the latent space: [M, H, nope] x [H, nope, R] -> [M, H, R]."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_values(out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Each head's attention output in the latent space to its values' space: [M, H, R] x [H, v, R] -> [M, H, v]."""
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def rope_rows(m: MlaConfig) -> torch.Tensor:
    """served rope row -> checkpoint rope row: DeepSeek's pairs (2i, 2i + 1) as NeoX halves."""
    r = m.qk_rope_head_dim
    return torch.tensor(head_order(r, r, interleaved=True))


def served(name: str, tensor: torch.Tensor, config: DecoderConfig) -> torch.Tensor:
    """A checkpoint tensor as served: the rope rows of the queries (each head's last
    qk_rope_head_dim rows of q_proj or q_b_proj) and of kv_a_proj_with_mqa (its last ones)
    reordered from interleaved pairs to halves. (A rank's part of q holds whole heads.)"""
    m = config.mla
    if not m.interleaved:
        return tensor
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        within = torch.cat([torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + rope_rows(m)])
        heads = tensor.shape[0] // m.qk_head_dim
        order = (torch.arange(heads)[:, None] * m.qk_head_dim + within[None, :]).reshape(-1)
        return tensor[order].contiguous()
    if name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
        order = torch.cat([torch.arange(m.kv_lora_rank), m.kv_lora_rank + rope_rows(m)])
        return tensor[order].contiguous()
    return tensor
