"""Attention over a flat batch of sequences, reading and writing the paged KV pool.

A step is a flat run of M tokens from several sequences ([M, hidden] through every
matmul); only attention is segmented per sequence. K and V of the new tokens are written
into the pool by slot mapping; each segment then attends over its whole context read back
through its block table (or, for a fresh prompt, over the K and V just computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.kv_pool import PagedKvPool


@dataclass(slots=True)
class Segment:
    """One sequence's share of the flat batch."""

    q_start: int  # first row of the flat batch
    q_len: int  # rows (new tokens)
    start: int  # position of the first new token (tokens cached before it)
    context_slots: torch.Tensor | None  # pool slots of positions 0..start+q_len-1; None without a cache


@dataclass(slots=True)
class StepContext:
    """What attention needs besides q, k and v; passed explicitly down the model."""

    segments: list[Segment]
    pool: PagedKvPool | None = None  # None: attend within the batch, store nothing
    slot_mapping: torch.Tensor | None = None  # [M] pool slot of every new token


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """q [M, H, D], k and v [M, KVH, D] -> [M, H * D]."""
    if ctx.pool is not None:
        ctx.pool.write(layer, ctx.slot_mapping, k, v)
    out = torch.empty_like(q)
    for seg in ctx.segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        if seg.start == 0 or ctx.pool is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = ctx.pool.read(layer, seg.context_slots)
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        out[rows] = _sdpa(q[rows], ks, vs, seg.start)
    return out.flatten(1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of n queries at positions start.. over L = start + n keys."""
    n, length = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if n == 1:
        mask, causal = None, False  # a single query sees every cached key
    elif n == length:
        mask, causal = None, True
    else:
        mask = torch.arange(length, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        causal = False
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
