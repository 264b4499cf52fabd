"""The fast forward: DecoderLM's hidden states through the fused per-layer tensors of fused_weights.py.

The default forward once `DecoderLM.fuse()` ran. It walks plain FusedLayer tuples instead
of the modules: q/k/v in one matmul, gate and up in one, the residual adds folded into the
o and down matmuls (addmm), the activation into the down matmul where the CPU kernels pack
its rows (StepOps.glu_down), one fused RMSNorm op, the rotary tables looked up once per
step, and the planned attention of attention.py. step_ops.for_step picks those ops for the step
(the CPU kernels, oneDNN's packed copies or plain torch); a float32 CPU decode step the
kernels accept runs whole in FusedDecode instead (fused_decode.py). It computes what the
reference forward of decoder_modules.py computes.

DeepSeek's latent attention (mla.py) takes the fused matmul's output (q_a_proj's and
kv_a_proj_with_mqa's rows) through its module's `attend`, q_b_proj by the step's matmul op.

LoRA deltas go into the column slices of the fused qkv and gate_up outputs (before q/k
norm, rope and the SiLU), and o/down deltas straight into the residual stream after its
fused add; without adapters each fused projection pays one `is not None` test. Gemma's
sandwich norms and tensor parallelism's all-reduce leave no add to fold into the matmul,
so those layers run the matmul, then the add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from executors.models import step_ops
from executors.models.attention import StepContext, attend
from executors.models.fused_weights import FusedLayer
from executors.models.layers import head_layer_norm, rms_norm_across_heads
from executors.models.moe import moe_forward

if TYPE_CHECKING:
    from executors.models.decoder import DecoderLM

# Rows of a step the MLP takes at a time with the CPU kernels. Its gate/up output at 4096
# rows is 50 MB, past glibc's largest mmap threshold (32 MB): each such allocation is mapped
# afresh and faulted in page by page as the kernel first stores to it (12 ms of a 47 ms
# matmul, bench/RESULTS.md runs 21 and 22). Blocks of 1024 rows keep it at 12.6 MB, which glibc
# reuses from its heap; the kernels compute each row alone, so the bits do not change.
MLP_ROWS = 1024


def hidden_states(model: DecoderLM, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """Final (normed) hidden states of a flat batch's embeddings through the fused weights: [M, hidden] -> same."""
    c = model.config
    heads, kv_heads, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    hq, hk, inter = heads * d, kv_heads * d, c.intermediate_size
    m = x.shape[0]
    lora, reduce = ctx.lora, model.all_reduce
    if model.fused_decode is not None and reduce is None:
        out = model.fused_decode.hidden_states(x, positions, ctx)
        if out is not None:
            return out
    layers, linear, residual_linear, norm, rotate, glu, glu_down = step_ops.for_step(
        positions, model.fused, model.fused_fp32_packed, model.cpu_kernels, model.rope, model.rope_local, x.dtype,
        c.hidden_act, c.layer_norm, c.mlp_gated)
    if model.cpu_kernels is not None and model.cpu_kernels.attention_accepts(heads, kv_heads, d):
        ctx.cpu = model.cpu_kernels
    # Attention through the Triton kernels: q/k norm, rotation and the K/V store as one kernel,
    # and the GLU as one.
    prologue = ctx.prologue if ctx.backend == "triton" and ctx.pool is not None else None
    few_rows = ctx.matmuls is not None and m <= ctx.matmuls.max_rows
    if few_rows:  # a decode graph's: each shape's faster matmul over the plain weights (not
        # oneDNN's packed copies, which only a CPU test run would have)
        layers, linear, residual_linear = model.fused, ctx.matmuls.linear, ctx.matmuls.residual_linear
    fused_glu = ctx.backend == "triton" and ctx.glu is not None and c.mlp_gated
    if fused_glu:
        glu = ctx.glu
    if few_rows or fused_glu:
        glu_down = step_ops.glu_then(residual_linear, glu)
    blocked_mlp = m > MLP_ROWS and lora is None and model.cpu_kernels is not None and linear == model.cpu_kernels.linear
    parallel = c.parallel_residual  # Cohere: x + attn(h) + mlp(h)
    qk_norm = head_layer_norm if c.layer_norm else norm  # a per-head q/k norm: Command R+'s are LayerNorms
    for i, w in enumerate(layers):
        sliding, rotates = c.window(i) is not None, c.rotates(i)
        attention_partial = None  # tensor parallelism, a parallel layer: o_proj's partial sum, not yet reduced
        h = x if w.input_norm is None else norm(x, w.input_norm, eps)  # OLMo, EXAONE 4: no input norm
        qkv = linear(h, w.qkv, w.qkv_bias)
        if lora is not None and c.mla is None:  # deltas into the fused output's column slices, before q/k norm and rope
            lora.apply(i, "q_proj", h, qkv[:, :hq])
            lora.apply(i, "k_proj", h, qkv[:, hq:hq + hk])
            lora.apply(i, "v_proj", h, qkv[:, hq + hk:])
        if c.mla is not None:  # DeepSeek: qkv is q_a_proj's and kv_a_proj_with_mqa's outputs (mla.py)
            q_b = None if w.q_b is None else lambda q, weight=w.q_b: linear(q, weight, None)
            a = model.model.layers[i].self_attn.attend(qkv, positions, model.rope, ctx, attend, q_b)
        elif prologue is not None and rotates:  # K and V go straight to the pool (triton_prologue.py)
            a = attend(i, prologue(i, qkv, positions, ctx, sliding), None, None, ctx)
        else:
            if c.qk_norm_across_heads:  # OLMo 2 and 3: each of q and k normed as one vector
                q = rms_norm_across_heads(qkv[:, :hq], w.q_norm, eps, model.mean_over_ranks).view(m, heads, d)
                k = rms_norm_across_heads(qkv[:, hq:hq + hk], w.k_norm, eps, model.mean_over_ranks).view(
                    m, kv_heads, d)
                if rotates:
                    q, k = rotate(q, sliding), rotate(k, sliding)
            elif w.q_norm is None:
                qk = qkv[:, :hq + hk].view(m, heads + kv_heads, d)
                if rotates:  # not on a NoPE layer (SmolLM3, EXAONE 4)
                    qk = rotate(qk, sliding)
                q, k = qk[:, :heads], qk[:, heads:]
            else:  # per head: RMSNorms (Qwen3, Gemma 3, GLM-4.5) or LayerNorms (Command R+)
                q = qk_norm(qkv[:, :hq].view(m, heads, d), w.q_norm, eps)
                k = qk_norm(qkv[:, hq:hq + hk].view(m, kv_heads, d), w.k_norm, eps)
                if rotates:
                    q, k = rotate(q, sliding), rotate(k, sliding)
            v = qkv[:, hq + hk:].view(m, kv_heads, d)
            a = attend(i, q, k, v, ctx)
        if w.post_ff_norm is not None:  # Gemma 2 and 3, GLM-4, OLMo, EXAONE 4: attention's output normed
            x, h = _sandwich_attention_out(model, i, x, a, w, ctx, linear, norm)
        elif reduce is not None:  # the ranks' partial sums of o_proj, then the residual add
            o = linear(a, w.o, w.o_bias)
            if lora is not None:
                lora.apply(i, "o_proj", a, o)
            if parallel:  # summed with the MLP's partial output: one all-reduce for both
                attention_partial = o
            else:
                x = x + reduce(o)
                h = norm(x, w.post_norm, eps)
        else:
            x = residual_linear(x, a, w.o, w.o_bias)
            if lora is not None:  # o_proj's delta straight into the residual stream
                lora.apply(i, "o_proj", a, x)
            if not parallel:  # a parallel layer's MLP reads the input norm's output, h
                h = norm(x, w.post_norm, eps)
        if w.moe is not None:
            y = moe_forward(h, w.moe, model.act, model.expert_load[i])
            if reduce is not None:
                y = reduce(y if attention_partial is None else y.add_(attention_partial))
            x = x + (norm(y, w.post_ff_norm, eps) if w.post_ff_norm is not None else y)
            continue
        if blocked_mlp and w.post_ff_norm is None and reduce is None:
            x = torch.cat([glu_down(x[r:r + MLP_ROWS], linear(h[r:r + MLP_ROWS], w.gate_up, w.gate_up_bias),
                                    w.down, w.down_bias) for r in range(0, m, MLP_ROWS)])
            continue
        gu = linear(h, w.gate_up, w.gate_up_bias)
        if lora is not None:  # before the SiLU
            if c.mlp_gated:
                lora.apply(i, "gate_proj", h, gu[:, :inter])
                lora.apply(i, "up_proj", h, gu[:, inter:])
            else:  # StarCoder2: gu is up's output alone
                lora.apply(i, "up_proj", h, gu)
        elif w.post_ff_norm is None and reduce is None:
            x = glu_down(x, gu, w.down, w.down_bias)
            continue
        act = glu(gu)
        if w.post_ff_norm is not None or reduce is not None:
            y = linear(act, w.down, w.down_bias)
            if lora is not None:
                lora.apply(i, "down_proj", act, y)
            if reduce is not None:
                y = reduce(y if attention_partial is None else y.add_(attention_partial))
            x = x + (norm(y, w.post_ff_norm, eps) if w.post_ff_norm is not None else y)
            continue
        x = residual_linear(x, act, w.down, w.down_bias)
        if lora is not None:
            lora.apply(i, "down_proj", act, x)
    return norm(x, model.final_norm, eps)


def _sandwich_attention_out(model: DecoderLM, i: int, x: torch.Tensor, a: torch.Tensor, w: FusedLayer,
                            ctx: StepContext, linear: step_ops.Linear,
                            norm: step_ops.Norm) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 2 and 3, GLM-4: x + norm(o_proj(a)), and the pre-MLP norm of that (no add to fuse
    into the matmul); OLMo and EXAONE 4 have no pre-MLP norm."""
    eps = model.config.rms_norm_eps
    o = linear(a, w.o, w.o_bias)
    if ctx.lora is not None:
        ctx.lora.apply(i, "o_proj", a, o)
    if model.all_reduce is not None:
        o = model.all_reduce(o)
    x = x + norm(o, w.post_norm, eps)
    return x, (x if w.pre_ff_norm is None else norm(x, w.pre_ff_norm, eps))
