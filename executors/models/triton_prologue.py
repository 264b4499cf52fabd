"""The attention prologue of a layer as one Triton kernel: q/k RMSNorm, rotation and the K/V store.

Between the q/k/v matmul and the paged attention kernel, the torch ops of fast_forward.py
launch 12 kernels a layer on a GPU: a copy and an RMSNorm for each of q and k (Qwen3's
per-head norms), the rotation's multiply, concatenation and addcmul for each, and two
index_copy stores of K and V into the pool. On an H100 a batch-1 decode step of a
Qwen3-0.6B shape ran ~685 kernels, ~24 a layer, in 1.96 ms of kernel time, and its graph
replay took 2.52 ms (bench/RESULTS.md, run 20). Here one program per (token, head) of the
fused q/k/v output reads its head once and:
- q and k heads: RMS-normalises it (when the layer has q/k norms), rotates it with the
  float32 cos / signed-sin tables at the token's position (NeoX halves, as RotaryEmbedding),
  and writes q to a new [M, H, D] tensor or k to the pool at the token's slot;
- v heads: copies it to the pool at the token's slot.
The arithmetic is float32 with one rounding at the store (the torch path rounds after the
norm and after each multiply in bfloat16), so bfloat16 results differ from that path by
rounding only; float32 ones agree within 1e-6.

`QkvPrologue` is what fast_forward calls; `self_check` compares the kernel with the torch ops
at start-up (the executor turns it off, with a warning that says why, when it fails), as
triton_attention.py does for the attention kernels. Importing this module needs `triton`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from executors.models.attention import StepContext
    from executors.models.decoder import DecoderLM


@triton.jit
def _prologue_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, norm_ptr,
                     stride_qkv, stride_q_m, stride_q_h, stride_kv_slot, stride_kv_h, stride_table, eps,
                     HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     QK_NORM: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(offs < half, offs + half, offs - half)  # the other half of the rotation
    row = qkv_ptr + m * stride_qkv + h * HEAD_DIM
    x = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + m).to(tl.int64)
    if h < HEADS + KV_HEADS:
        xs = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            # norm_ptr holds [2, HEAD_DIM]: q's weight, then k's.
            w_row = norm_ptr + (h >= HEADS).to(tl.int32) * HEAD_DIM
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
            x = x * rstd * tl.load(w_row + offs, mask=mask, other=0.0).to(tl.float32)
            xs = xs * rstd * tl.load(w_row + partner, mask=mask, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + m).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_table + offs, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_table + offs, mask=mask, other=0.0)
        y = x * cos + xs * sin
        if h < HEADS:
            tl.store(q_ptr + m * stride_q_m + h * stride_q_h + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(k_ptr + slot * stride_kv_slot + (h - HEADS) * stride_kv_h + offs,
                     y.to(k_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(v_ptr + slot * stride_kv_slot + (h - HEADS - KV_HEADS) * stride_kv_h + offs,
                 x.to(v_ptr.dtype.element_ty), mask=mask)


def prologue(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, norms: torch.Tensor | None,
             eps: float, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """q [M, heads, head_dim] of the fused q/k/v output qkv ([M, (heads + 2 kv_heads) * head_dim]);
    K and V go to key and value ([slots, kv_heads, head_dim]) at `slots`. `norms`: [2, head_dim]
    (q's and k's RMSNorm weights) or None; cos / signed_sin: [positions, head_dim] float32."""
    m = qkv.shape[0]
    if qkv.stride(1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1 or key.stride() != value.stride():
        raise ValueError("the prologue needs unit stride along the head dimension and K and V alike")
    q = qkv.new_empty(m, heads, head_dim)
    if m == 0:
        return q
    positions, slots = positions.contiguous(), slots.contiguous()  # read with unit stride (views: no copy)
    _prologue_kernel[(m, heads + 2 * kv_heads)](
        qkv, q, key, value, slots, positions, cos, signed_sin, norms if norms is not None else cos,
        qkv.stride(0), q.stride(0), q.stride(1), key.stride(0), key.stride(1), cos.stride(0), eps,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        QK_NORM=norms is not None,
    )
    return q


class QkvPrologue:
    """The model's prologue, its per-layer q/k norm weights stacked once: fast_forward calls it for
    each layer of a step whose attention runs through the Triton kernels."""

    def __init__(self, model: DecoderLM) -> None:
        c = model.config
        self.heads, self.kv_heads, self.head_dim, self.eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        self.norms = [torch.stack([w.q_norm, w.k_norm]).contiguous() if w.q_norm is not None else None
                      for w in model.fused]
        self.model = model  # its rotary tables, read at each call

    def __call__(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                 sliding: bool) -> torch.Tensor:
        model = self.model
        table = model.rope_local if sliding and model.rope_local is not None else model.rope
        key, value = ctx.pool.flat(layer)
        return prologue(qkv, positions, ctx.slot_mapping, key, value, table.cos, table.signed_sin, self.norms[layer],
                        self.eps, self.heads, self.kv_heads, self.head_dim)


def torch_prologue(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, norms: torch.Tensor | None,
                   eps: float, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """What the kernel computes, in float32 torch ops (the self-check's and the tests' reference)."""
    m = qkv.shape[0]
    x = qkv.float().view(m, heads + 2 * kv_heads, head_dim)
    qk = x[:, :heads + kv_heads]
    if norms is not None:
        w = torch.cat([norms[0].float().expand(heads, head_dim), norms[1].float().expand(kv_heads, head_dim)])
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * w
    c, s = cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1)
    half = head_dim // 2
    qk = qk * c + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * s
    key.index_copy_(0, slots, qk[:, heads:].to(key.dtype))
    value.index_copy_(0, slots, x[:, heads + kv_heads:].to(value.dtype))
    return qk[:, :heads].to(qkv.dtype)


def self_check(device: torch.device | str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
               qk_norm: bool) -> str | None:
    """The kernel against torch_prologue on random rows at the model's shapes: None when they
    agree; otherwise what differed (or why it failed to build or run)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    m, num_slots, positions_max = 5, 64, 300

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    qkv = rand(m, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, positions_max, (m,), generator=g).to(device)
    slots = torch.randperm(num_slots, generator=g)[:m].to(device)
    angles = torch.rand(positions_max, head_dim, generator=g).to(device) * 6.3
    cos, sin = angles.cos(), angles.sin()
    norms = (1 + 0.2 * torch.randn(2, head_dim, generator=g)).to(device, dtype) if qk_norm else None
    outs = []
    for fn in (prologue, torch_prologue):
        key = torch.zeros(num_slots, kv_heads, head_dim, dtype=dtype, device=device)
        value = torch.zeros_like(key)
        try:
            q = fn(qkv, positions, slots, key, value, cos, sin, norms, 1e-6, heads, kv_heads, head_dim)
        except Exception as e:  # noqa: BLE001 - any failure to build or launch is the answer
            return f"the prologue kernel failed to run: {type(e).__name__}: {e}"
        outs.append((q.float(), key.float(), value.float()))
    # Both round float32 results once: bfloat16 ones may differ by an ulp (2^-8 relative).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, got, want in zip(("q", "K", "V"), outs[0], outs[1]):
        err = ((got - want).abs() / (want.abs() + 1)).max().item()
        if not err <= tol:  # NaN too
            return (f"the prologue kernel's {name} differs from the torch ops by {err:.3g} (relative, tolerance "
                    f"{tol:g}) at heads {heads}/{kv_heads}, head_dim {head_dim}, {dtype}")
    return None
