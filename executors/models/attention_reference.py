"""The reference attention: each segment gathers its whole context from the pool slot by slot
(an index_select of every cached position, only those inside a sliding window) and attends
over the copy. The fast path (attention.py) is checked against it, and it serves what the
fused paths do not compute: Gemma 2's soft-capped scores and GPT-OSS's attention sinks, but
for the decode rows and whole fresh prompts of a float32 CPU step, which the CPU kernels
compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from executors.models.attention_plan import visibility

if TYPE_CHECKING:
    from executors.models.attention import LayerAttention, Segment, StepContext
    from kvcache.kv_pool import PagedKvPool


def attend_reference(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                     skip: frozenset[int] = frozenset()) -> torch.Tensor:
    """q [M, H, D], k and v [M, KVH, D] -> [M, H * D]; gathers every segment's context by slot.
    `skip`: the first rows of segments to leave out (the caller's kernels fill them; their K
    and V are stored all the same)."""
    if ctx.pool is not None:
        ctx.pool.write(layer, ctx.slot_mapping, k, v)
    spec = ctx.layer(layer)
    out = torch.empty_like(q)
    for seg in ctx.segments:
        if seg.q_start in skip:
            continue
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        if seg.start == 0 or ctx.pool is None:
            ks, vs, key_start = k[rows], v[rows], 0
        else:
            key_start = _first_key(seg, spec)
            ks, vs = ctx.pool.read(layer, _context_slots(seg, ctx.pool)[key_start:])
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        out[rows] = sdpa(q[rows], ks, vs, seg.start, spec, key_start)
    return out.flatten(1)


def _first_key(seg: Segment, spec: LayerAttention) -> int:
    """The first position some query of the segment sees: its first query's window on."""
    return 0 if spec.window is None else max(0, seg.start - spec.window + 1)


def _context_slots(seg: Segment, pool: PagedKvPool) -> torch.Tensor:
    """Pool slots of positions 0..start+q_len-1, built once a step (every layer slices its
    window's from them; a block freed behind every window gives slots nothing reads)."""
    if seg.context_slots is None:
        bs, ids = pool.block_size, seg.block_ids
        seg.context_slots = torch.tensor([ids[p // bs] * bs + p % bs for p in range(seg.start + seg.q_len)],
                                         device=pool.device)
    return seg.context_slots


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, spec: LayerAttention | None = None,
         key_start: int = 0) -> torch.Tensor:
    """Causal attention of n queries at positions start.. over the keys at positions
    key_start..start+n-1, within spec's window, with its scale, soft-cap and sinks (None: none)."""
    n, length = q.shape[0], k.shape[0]
    window, scale = (None, None) if spec is None else (spec.window, spec.scale)
    if spec is not None and spec.scored:
        return explicit(q, k, v, visibility(n, start, length, key_start, window, q.device), scale, spec.softcap,
                        spec.sinks)
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    windowed = window is not None and start + n - key_start > window
    if n == 1 and not windowed:
        mask, causal = None, False  # a single query sees every cached key
    elif n == length and not windowed:
        mask, causal = None, True
    else:
        mask, causal = visibility(n, start, length, key_start, window, q.device), False
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, enable_gqa=True, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float | None,
             softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with the scores written out, as the models' references compute them: scaled
    q.k, capped by softcap * tanh(s / softcap) (Gemma 2), masked, softmax in float32 over the
    keys and each head's sink logit (GPT-OSS's `sinks` [H]: a key without a value, its share of
    the weights dropped, as GptOssAttention's eager computation does). The query heads
    of each KV head are grouped against that head's K and V as they lie (strided views, no
    repeated copy: 8x faster for one query over 1024 keys than repeating K and V)."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    group = heads // kvh
    qg = q.view(n, kvh, group, d).permute(1, 2, 0, 3).reshape(kvh, group * n, d)  # rows (g, i) of each KV head
    scores = torch.bmm(qg, k.permute(1, 2, 0))  # [KVH, G n, L]
    scores = scores * (scale if scale is not None else d ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf")).float()
    if sinks is None:
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
    else:  # [KVH, G n, 1]: head (kv head, g)'s sink on each of its n rows
        sink = sinks.float().view(kvh, group, 1, 1).expand(kvh, group, n, 1).reshape(kvh, group * n, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    out = torch.bmm(weights, v.transpose(0, 1))  # [KVH, G n, D]
    return out.view(kvh, group, n, d).permute(2, 0, 1, 3).reshape(n, heads, d)
