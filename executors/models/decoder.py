"""DecoderLM: one decoder-only transformer for Qwen3, Llama/SmolLM2, Qwen2, Mistral, Gemma 3
and the mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral, by config flags.

Parameter names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj...),
so a safetensors state dict loads as it is. The forward takes a flat batch of tokens
([M]) with their positions and a StepContext that says how they split into sequences.

Two forwards compute the same thing. The reference runs the nn.Modules as written (three
projections, rotary tables looked up per layer, attention through attend_reference). The
fast one (the default once `fuse()` ran, which the loader and LlmExecutor do) walks plain
per-layer tuples of tensors: q/k/v fused into one [(H + 2 KVH) D, hidden] matmul, gate and
up into one [2 I, hidden] matmul, the residual adds folded into addmm, one fused RMSNorm
op, the rotary tables looked up once per step, and the planned attention of attention.py.
The fused weights are the storage: the modules' q_proj/k_proj/... parameters become views
into them, so fusing costs no memory and parameter counts do not change. In float32 on a
CPU with the kernels of executors/cpu_kernels built, every matmul weight is then stored as
the kernels' 6-column panels instead, the modules becoming PanelLinear over them
(panel_modules.py); without the kernels, each kind of weight in the layout its one-row
matmuls read fastest (cpu_layout.py). One copy either way.

LoRA: when the step's context carries a LoraBatch (executors/lora.py), both forwards add
each row's adapter delta to every adapted projection's output, in place. The fast one adds
q/k/v deltas into the column slices of the fused qkv output and gate/up deltas into those
of gate_up (before q/k norm, rope and the SiLU), and o/down deltas straight into the
residual stream after its fused add. Without adapters it pays one `is not None` test per
fused projection. Sparse (MoE) layers take adapters on attention only.

Family flags (config.py): a sparse layer's MLP is a SparseMoe (moe.py), its experts'
weights stacked for grouped compute; Gemma 3 norms attention's and the MLP's outputs
before the residual add ("sandwich" norms, so no add fuses into a matmul there), scales
the embeddings, uses a second rotary table on its sliding layers and soft-caps the final
logits; each layer's window and score scale reach attention through StepContext.layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from executors.cpu_kernels import CpuKernels, cpu_kernels
from executors.cpu_kernels.panels import Panels
from executors.lora import LoraBatch
from executors.models import cpu_layout, panel_modules, step_ops
from executors.models.fused_decode import FusedDecode
from executors.models.attention import LayerAttention, StepContext, attend, attend_reference
from executors.models.config import DecoderConfig
from executors.models.layers import MLP, RMSNorm, RotaryEmbedding, activation
from executors.models.moe import MoeWeights, SparseMoe, grouped_backend, moe_forward, stack

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the tensor-parallel ranks, in place


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: StepContext) -> torch.Tensor:
        m, lora = x.shape[0], ctx.lora
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if lora is not None:
            lora.apply(self.layer, "q_proj", x, q)
            lora.apply(self.layer, "k_proj", x, k)
            lora.apply(self.layer, "v_proj", x, v)
        q = q.view(m, self.num_heads, self.head_dim)
        k = k.view(m, self.num_kv_heads, self.head_dim)
        v = v.view(m, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, positions)
        a = attend_reference(self.layer, q, k, v, ctx)
        out = self.o_proj(a)
        if lora is not None:
            lora.apply(self.layer, "o_proj", a, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        h, eps, off = config.hidden_size, config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm(h, eps, off)
        self.self_attn = Attention(config, layer)
        # Gemma: the norm of attention's output; elsewhere the norm before the MLP.
        self.post_attention_layernorm = RMSNorm(h, eps, off)
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, off)
            self.post_feedforward_layernorm = RMSNorm(h, eps, off)
        self.sparse = config.moe is not None and config.moe.sparse_layers[layer]
        self.ffn_name = config.moe.module_name if self.sparse else "mlp"
        setattr(self, self.ffn_name, SparseMoe(config) if self.sparse else MLP(config))

    @property
    def ffn(self) -> MLP | SparseMoe:
        return getattr(self, self.ffn_name)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: StepContext,
                load: torch.Tensor | None = None, reduce: Reduce | None = None) -> torch.Tensor:
        """`reduce`: under tensor parallelism, the all-reduce that sums the ranks' partial
        outputs of o_proj and of the MLP's down projection (row-parallel layers)."""
        a = self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        if reduce is not None:
            a = reduce(a)
        if hasattr(self, "pre_feedforward_layernorm"):
            x = x + self.post_attention_layernorm(a)
            h = self.pre_feedforward_layernorm(x)
        else:
            x = x + a
            h = self.post_attention_layernorm(x)
        if self.sparse:
            y = self.ffn(h, load)
        elif ctx.lora is None:
            y = self.ffn(h)
        else:
            y = _mlp_with_lora(self.ffn, h, ctx.lora, self.self_attn.layer)
        if reduce is not None:
            y = reduce(y)
        if hasattr(self, "post_feedforward_layernorm"):
            y = self.post_feedforward_layernorm(y)
        return x + y


def _mlp_with_lora(mlp: MLP, x: torch.Tensor, lora: LoraBatch, layer: int) -> torch.Tensor:
    """MLP.forward with each projection's adapter deltas added to its output."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    lora.apply(layer, "gate_proj", x, gate)
    lora.apply(layer, "up_proj", x, up)
    act = mlp.act(gate) * up
    out = mlp.down_proj(act)
    lora.apply(layer, "down_proj", act, out)
    return out


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)


class FusedLayer(NamedTuple):
    """One decoder layer's tensors for the fast forward (views of, or the same as, its parameters)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # Gemma: of attention's output; else before the MLP
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a sparse layer
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    pre_ff_norm: torch.Tensor | None = None  # Gemma's norms before and after the MLP
    post_ff_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None  # a sparse layer's router and stacked experts


def _fuse(modules: list[nn.Linear], bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the modules' weights (and biases) and make each module's parameters views of the result."""
    weight = torch.cat([m.weight.detach() for m in modules], dim=0)
    fused_bias = torch.cat([m.bias.detach() for m in modules], dim=0) if bias else None
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias:
            m.bias = nn.Parameter(fused_bias[row:row + n], requires_grad=False)
        row += n
    return weight, fused_bias


class DecoderLM(nn.Module):
    def __init__(self, config: DecoderConfig, head_rows: tuple[int, int] | None = None) -> None:
        """`head_rows`: under tensor parallelism, the vocabulary rows [lo, hi) this rank's
        lm_head computes (a slice of the tied embedding, or an lm_head of hi - lo rows);
        `config` is then this rank's shard (executors/parallel/shard.py)."""
        super().__init__()
        self.config = config
        self.head_rows = head_rows
        # Set under tensor parallelism: the all-reduce after each row-parallel matmul.
        self.all_reduce: Reduce | None = None
        self.model = DecoderModel(config)
        self.reset_buffers()
        # Each layer's attention options; () when every layer is plain (no window, default scale).
        specs = tuple(LayerAttention(config.window(i), config.attn_scale)
                      for i in range(config.num_layers))
        self.attn_layers = specs if any(s != LayerAttention() for s in specs) else ()
        self.act = activation(config.hidden_act)
        if not config.tie_word_embeddings:
            rows = config.vocab_size if head_rows is None else head_rows[1] - head_rows[0]
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.fused: list[FusedLayer] | None = None
        self.packed_head: torch.Tensor | None = None
        self.fused_fp32_packed: list[FusedLayer] | None = None  # float32: for PACKED_FP32_ROWS-row steps
        self.packed_head_fp32: torch.Tensor | None = None
        # float32 on a CPU: the AVX2 kernels (step_ops.py), when use_cpu_kernels allows and
        # they build here; the matmul weights are then stored as their panels (panel_modules.py).
        self.use_cpu_kernels = True
        self.cpu_kernels: CpuKernels | None = None
        self.head_panels: Panels | None = None  # the lm_head as panels, with the kernels
        self.head_copy = False  # head_panels is a copy (a TP rank's slice of a tied embedding), not the storage
        self.fused_decode: FusedDecode | None = None  # with the kernels: decode steps in one call

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """The rotary tables and the expert-load counters (not in checkpoints: made here, on
        `device`, also after a load onto the meta device)."""
        c = self.config
        self.rope = RotaryEmbedding(c).to(device) if device is not None else RotaryEmbedding(c)
        self.rope_local = None
        if c.local_rope_theta is not None:
            self.rope_local = RotaryEmbedding(c, local=True)
            if device is not None:
                self.rope_local = self.rope_local.to(device)
        if c.moe is not None:
            # Rows routed to each expert of each layer since start (dense layers' rows stay 0).
            self.register_buffer("expert_load", torch.zeros(c.num_layers, c.moe.num_experts, dtype=torch.int64,
                                                            device=device), persistent=False)

    def rope_for(self, layer: int) -> RotaryEmbedding:
        """The rotary table of a layer: Gemma's sliding layers have their own base."""
        if self.rope_local is not None and self.config.window(layer) is not None:
            return self.rope_local
        return self.rope

    def fuse(self) -> DecoderLM:
        """Build the fast forward's fused weights (idempotent; no extra memory, see the module doc)."""
        if self.fused is not None:
            return self
        c = self.config
        fused = []
        for layer in self.model.layers:
            a, ffn = layer.self_attn, layer.ffn
            qkv, qkv_bias = _fuse([a.q_proj, a.k_proj, a.v_proj], c.qkv_bias)
            dense = dict(gate_up=None, gate_up_bias=None, down=None, down_bias=None)
            if not layer.sparse:
                gate_up, gate_up_bias = _fuse([ffn.gate_proj, ffn.up_proj], c.mlp_bias)
                dense = dict(gate_up=gate_up, gate_up_bias=gate_up_bias, down=ffn.down_proj.weight.detach(),
                             down_bias=ffn.down_proj.bias.detach() if c.mlp_bias else None)
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            fused.append(FusedLayer(
                input_norm=layer.input_layernorm.fused_weight(),
                qkv=qkv, qkv_bias=qkv_bias,
                o=a.o_proj.weight.detach(), o_bias=a.o_proj.bias.detach() if c.o_bias else None,
                q_norm=a.q_norm.fused_weight() if c.qk_norm else None,
                k_norm=a.k_norm.fused_weight() if c.qk_norm else None,
                post_norm=layer.post_attention_layernorm.fused_weight(),
                **dense,
                pre_ff_norm=layer.pre_feedforward_layernorm.fused_weight() if sandwich else None,
                post_ff_norm=layer.post_feedforward_layernorm.fused_weight() if sandwich else None,
                moe=stack(ffn) if layer.sparse else None,
            ))
        self.fused = fused
        if c.moe is not None:  # pick the grouped GEMM for this device and dtype now, not inside a graph capture
            embed = self.model.embed_tokens.weight
            grouped_backend(embed.device, embed.dtype)
        if cpu_layout.wanted(self):
            self.cpu_kernels = cpu_kernels() if self.use_cpu_kernels else None
            if self.cpu_kernels is None or not all(map(self.cpu_kernels.accepts, self._matmul_weights())):
                self.cpu_kernels = None
                cpu_layout.relayout(self)  # MKL's one-row matmuls: each kind of weight in its faster layout
            else:
                panel_modules.pack_model(self)  # the kernels' layout, the weights' one copy
            self.fused_decode = FusedDecode.build(self)
            fused = self.fused
        if self.head_panels is not None:
            return self
        head = self.head_weight()
        if step_ops.should_pack(head, torch.bfloat16):
            # bfloat16 on CPU: oneDNN prepacked weights (AMX / avx512_bf16 layout) instead of
            # F.linear, which re-lays the weight out on every call: 1.3-1.5x faster matmuls
            # at M = 1..512 here (bench/RESULTS.md). A second copy of the matmul weights.
            fused = [step_ops.packed(w) for w in fused]
            self.packed_head = step_ops.pack(head)
        elif (self.cpu_kernels is None and step_ops.should_pack(head, torch.float32)
              and sum(p.numel() for p in self.parameters()) * 4 <= step_ops.PACK_FP32_MAX_BYTES):
            # float32 on CPU without the kernels (whose tiles match these without a copy): oneDNN
            # prepacked copies for steps of PACKED_FP32_ROWS rows (batched decode), 1.25-1.4x
            # faster than MKL's sgemm there; slower at 1 row and no better
            # for prefill-sized steps, which keep F.linear. Doubles the weights' memory, so
            # only for models up to PACK_FP32_MAX_BYTES.
            self.fused_fp32_packed = [step_ops.packed(w) for w in fused]
            self.packed_head_fp32 = step_ops.pack(head)
        self.fused = fused
        return self

    def head_weight(self) -> torch.Tensor:
        """The lm_head's weight: the embedding when tied; under tensor parallelism this rank's
        vocabulary rows (of a tied embedding: a view, no copy). Stored as panels, it is unpacked
        (a new tensor): for the reference forward, not the fast one."""
        if self.head_panels is not None:
            return self.head_panels.unpack()
        if not self.config.tie_word_embeddings:
            return self.lm_head.weight.detach()
        w = self.model.embed_tokens.weight.detach()
        return w if self.head_rows is None else w[self.head_rows[0]:self.head_rows[1]]

    def _matmul_weights(self) -> list[torch.Tensor]:
        dense = [t for w in self.fused for t in (w.qkv, w.o, w.gate_up, w.down) if t is not None]
        return [*dense, self.head_weight()]

    def packed_bytes(self) -> int:
        """Memory of copies of the matmul weights kept beside the parameters: oneDNN's packed
        ones, or a tensor-parallel rank's panels of its slice of a tied embedding."""
        if self.head_panels is not None:
            return self.head_panels.nbytes if self.head_copy else 0
        layers = [w for group in (self.fused_fp32_packed, self.fused) for w in group or ()]
        tensors = [t for w in layers for t in (w.qkv, w.o, w.gate_up, w.down)]
        tensors += [self.packed_head, self.packed_head_fp32]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.is_mkldnn)

    def num_parameters(self) -> int:
        """The checkpoint's parameter count (panels' padding not counted)."""
        return panel_modules.logical_numel(self)

    def logical_parameters(self):
        """named_parameters() in the checkpoint's layout (panels unpacked, one at a time)."""
        return panel_modules.logical_parameters(self)

    def _apply(self, fn, recurse: bool = True):
        """.to(), .cuda(), .half() and the like: the fused tensors are not parameters, so they
        would stay behind (on the old device or dtype) while each parameter moves on its own.
        Drop them, move the parameters, and fuse again where the model was fused."""
        fused = self.fused is not None
        if self.head_panels is not None:  # row-major modules again, to move and re-fuse
            panel_modules.unpack_model(self)
        self.fused = self.packed_head = self.fused_fp32_packed = self.packed_head_fp32 = self.cpu_kernels = None
        self.fused_decode = None
        out = super()._apply(fn, recurse)
        if fused:
            self.fuse()
        return out

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Final (normed) hidden states of a flat batch: [M] ids -> [M, hidden]."""
        if self.attn_layers and not ctx.layers:
            ctx.layers = self.attn_layers
        if self.fused is not None and not ctx.reference:
            return self._fast_hidden_states(input_ids, positions, ctx)
        x = self._embed(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rope_for(i), ctx, self.expert_load[i] if layer.sparse else None,
                      self.all_reduce)
        return self.model.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # nn.Embedding, or PanelEmbedding over the tied head's panels
        if self.config.embed_scale is not None:  # Gemma: sqrt(hidden), rounded to the model's dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def _fast_hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        c = self.config
        heads, kv_heads, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        hq, hk, inter = heads * d, kv_heads * d, c.intermediate_size
        m = input_ids.shape[0]
        x = self._embed(input_ids)
        lora, reduce = ctx.lora, self.all_reduce
        if self.fused_decode is not None and reduce is None:
            out = self.fused_decode.hidden_states(x, positions, ctx)
            if out is not None:
                return out
        layers, linear, residual_linear, norm, rotate, glu = step_ops.for_step(
            positions, self.fused, self.fused_fp32_packed, self.cpu_kernels, self.rope, self.rope_local, x.dtype,
            c.hidden_act)
        if self.cpu_kernels is not None and self.cpu_kernels.attention_accepts(heads, kv_heads, d):
            ctx.cpu = self.cpu_kernels
        for i, w in enumerate(layers):
            sliding = c.window(i) is not None
            h = norm(x, w.input_norm, eps)
            qkv = linear(h, w.qkv, w.qkv_bias)
            if lora is not None:  # deltas into the fused output's column slices, before q/k norm and rope
                lora.apply(i, "q_proj", h, qkv[:, :hq])
                lora.apply(i, "k_proj", h, qkv[:, hq:hq + hk])
                lora.apply(i, "v_proj", h, qkv[:, hq + hk:])
            if w.q_norm is None:
                qk = rotate(qkv[:, :hq + hk].view(m, heads + kv_heads, d), sliding)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = rotate(norm(qkv[:, :hq].view(m, heads, d), w.q_norm, eps), sliding)
                k = rotate(norm(qkv[:, hq:hq + hk].view(m, kv_heads, d), w.k_norm, eps), sliding)
            v = qkv[:, hq + hk:].view(m, kv_heads, d)
            a = attend(i, q, k, v, ctx)
            if w.pre_ff_norm is not None:
                x, h = self._sandwich_attention_out(i, x, a, w, ctx, linear, norm)
            elif reduce is not None:  # the ranks' partial sums of o_proj, then the residual add
                o = linear(a, w.o, w.o_bias)
                if lora is not None:
                    lora.apply(i, "o_proj", a, o)
                x = x + reduce(o)
                h = norm(x, w.post_norm, eps)
            else:
                x = residual_linear(x, a, w.o, w.o_bias)
                if lora is not None:  # o_proj's delta straight into the residual stream
                    lora.apply(i, "o_proj", a, x)
                h = norm(x, w.post_norm, eps)
            if w.moe is not None:
                y = moe_forward(h, w.moe, self.act, self.expert_load[i])
                if reduce is not None:
                    y = reduce(y)
                x = x + (norm(y, w.post_ff_norm, eps) if w.post_ff_norm is not None else y)
                continue
            gu = linear(h, w.gate_up, w.gate_up_bias)
            if lora is not None:  # before the SiLU
                lora.apply(i, "gate_proj", h, gu[:, :inter])
                lora.apply(i, "up_proj", h, gu[:, inter:])
            act = glu(gu)
            if w.post_ff_norm is not None or reduce is not None:
                y = linear(act, w.down, w.down_bias)
                if lora is not None:
                    lora.apply(i, "down_proj", act, y)
                if reduce is not None:
                    y = reduce(y)
                x = x + (norm(y, w.post_ff_norm, eps) if w.post_ff_norm is not None else y)
                continue
            x = residual_linear(x, act, w.down, w.down_bias)
            if lora is not None:
                lora.apply(i, "down_proj", act, x)
        return norm(x, self.model.norm.fused_weight(), eps)

    def _sandwich_attention_out(self, i: int, x: torch.Tensor, a: torch.Tensor, w: FusedLayer,
                                ctx: StepContext, linear: step_ops.Linear,
                                norm: step_ops.Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma: x + norm(o_proj(a)), and the pre-MLP norm of that (no add to fuse into the matmul)."""
        eps = self.config.rms_norm_eps
        o = linear(a, w.o, w.o_bias)
        if ctx.lora is not None:
            ctx.lora.apply(i, "o_proj", a, o)
        if self.all_reduce is not None:
            o = self.all_reduce(o)
        x = x + norm(o, w.post_norm, eps)
        return x, norm(x, w.pre_ff_norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """float32 logits of the given hidden rows; the lm_head runs only on these rows."""
        rows = hidden.shape[0]
        if self.packed_head is not None and not reference:
            out = step_ops.linear(hidden.contiguous(), self.packed_head, None).float()
        elif self.head_panels is not None and not reference:
            out = self.cpu_kernels.linear(hidden, self.head_panels)
        elif self.packed_head_fp32 is not None and not reference and rows in step_ops.PACKED_FP32_ROWS:
            out = step_ops.linear(hidden.contiguous(), self.packed_head_fp32, None)
        else:
            out = torch.nn.functional.linear(hidden, self.head_weight()).float()
        cap = self.config.final_softcap
        return out if cap is None else torch.tanh(out / cap) * cap
