"""The fast path's SDPA calls over the pool, as attention.py's plan (attention_plan.py) sorts
a step's rows: fresh prompts over themselves, decode rows over views of the pool's blocks (a
log-sum-exp merge across runs) or over one block gather, chunks over their cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executors.models.attention_plan import ChunkRows, FreshRun, GatheredRows, flash_with_lse
from kvcache.kv_pool import PagedKvPool


def fresh(q, k, v, r0: int, f: FreshRun, scale: float | None) -> torch.Tensor:
    """Causal attention within `count` consecutive prompts of n tokens: [count, n, H, D]."""
    count, n = f.count, f.n
    end = r0 + count * n
    qh = q[r0:end].view(count, n, q.shape[1], q.shape[2]).transpose(1, 2)
    kh = k[r0:end].view(count, n, k.shape[1], k.shape[2]).transpose(1, 2)
    vh = v[r0:end].view(count, n, v.shape[1], v.shape[2]).transpose(1, 2)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=f.mask, is_causal=n > 1 and f.mask is None,
                                         enable_gqa=True, scale=scale)
    return out.transpose(1, 2)


def over_views(qr, kl, vl, runs, bs: int, kvh: int, d: int, scale: float | None = None) -> torch.Tensor:
    """One query row ([1, KVH, group, D]) over contiguous runs of pool blocks, no copy."""
    if len(runs) == 1:
        first, n, skip, used = runs[0]
        kr = kl[first:first + n].view(n * bs, kvh, d)[skip:used].transpose(0, 1).unsqueeze(0)
        vr = vl[first:first + n].view(n * bs, kvh, d)[skip:used].transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(qr, kr, vr, scale=scale)
    outs, lses = [], []
    for first, n, skip, used in runs:
        kr = kl[first:first + n].view(n * bs, kvh, d)[skip:used].transpose(0, 1).unsqueeze(0)
        vr = vl[first:first + n].view(n * bs, kvh, d)[skip:used].transpose(0, 1).unsqueeze(0)
        o, lse = flash_with_lse(qr, kr, vr, 0.0, False, scale=scale)[:2]
        outs.append(o)
        lses.append(lse)
    lse = torch.stack(lses)  # [R, 1, KVH, group], float32
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)  # exp(lse_r - logsumexp_r lse_r)
    return (torch.stack(outs).float() * weights).sum(0).to(qr.dtype)


def gathered(q, pool: PagedKvPool, layer: int, g: GatheredRows, scale: float | None = None) -> torch.Tensor:
    """Decode rows over one block gather: [G, H, D]."""
    bs, kvh, d = pool.block_size, pool.num_kv_heads, pool.head_dim
    heads = q.shape[1]
    kl, vl = pool.key[layer], pool.value[layer]
    nblocks = kl.shape[0]
    kg = kl.view(nblocks, -1).index_select(0, g.blocks).view(g.count, g.nb * bs, kvh, d).transpose(1, 2)
    vg = vl.view(nblocks, -1).index_select(0, g.blocks).view(g.count, g.nb * bs, kvh, d).transpose(1, 2)
    qg = (q[g.rows] if isinstance(g.rows, slice) else q.index_select(0, g.rows)).to(kg.dtype)
    out = F.scaled_dot_product_attention(qg.view(g.count, kvh, heads // kvh, d), kg, vg, attn_mask=g.mask,
                                         scale=scale)
    return out.reshape(g.count, heads, d)


def chunk(q, pool: PagedKvPool, layer: int, c: ChunkRows, scale: float | None = None) -> torch.Tensor:
    """n new tokens over their cached context plus themselves (offset-causal): [n, H, D]."""
    bs, kvh, d = pool.block_size, pool.num_kv_heads, pool.head_dim
    length = c.start + c.n - c.key_start
    kl, vl = pool.key[layer], pool.value[layer]
    if c.run is not None:
        first, n = c.run
        ks = kl[first:first + n].view(n * bs, kvh, d)[:length]
        vs = vl[first:first + n].view(n * bs, kvh, d)[:length]
    else:
        nblocks = kl.shape[0]
        ks = kl.view(nblocks, -1).index_select(0, c.blocks).view(-1, kvh, d)[:length]
        vs = vl.view(nblocks, -1).index_select(0, c.blocks).view(-1, kvh, d)[:length]
    qh = q[c.r0:c.r0 + c.n].transpose(0, 1).unsqueeze(0).to(ks.dtype)
    out = F.scaled_dot_product_attention(qh, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                         attn_mask=c.mask, enable_gqa=True, scale=scale)
    return out.squeeze(0).transpose(0, 1)
