"""DecoderLM: one decoder-only transformer for Qwen3, Llama/SmolLM2 and Qwen2, by config flags.

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
CPU each kind of weight is then stored in the layout its one-row matmuls read fastest
(cpu_layout.py), still one copy.

LoRA: when the step's context carries a LoraBatch (executors/lora.py), both forwards add
each row's adapter delta to every adapted projection's output, in place. The fast one adds
q/k/v deltas into the column slices of the fused qkv output and gate/up deltas into those
of gate_up (before q/k norm, rope and the SiLU), and o/down deltas straight into the
residual stream after its fused add. Without adapters it pays one `is not None` test per
fused projection.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from executors.lora import LoraBatch
from executors.models import cpu_layout
from executors.models.attention import StepContext, attend, attend_reference
from executors.models.config import DecoderConfig
from executors.models.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope


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
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

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
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        h = self.post_attention_layernorm(x)
        if ctx.lora is None:
            return x + self.mlp(h)
        return x + _mlp_with_lora(self.mlp, h, ctx.lora, self.self_attn.layer)


def _mlp_with_lora(mlp: MLP, x: torch.Tensor, lora: LoraBatch, layer: int) -> torch.Tensor:
    """MLP.forward with each projection's adapter deltas added to its output."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    lora.apply(layer, "gate_proj", x, gate)
    lora.apply(layer, "up_proj", x, up)
    act = F.silu(gate) * up
    out = mlp.down_proj(act)
    lora.apply(layer, "down_proj", act, out)
    return out


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class FusedLayer(NamedTuple):
    """One decoder layer's tensors for the fast forward (views of, or the same as, its parameters)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


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
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.rope = RotaryEmbedding(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.fused: list[FusedLayer] | None = None
        self.packed_head: torch.Tensor | None = None
        self.fused_fp32_packed: list[FusedLayer] | None = None  # float32: for PACKED_FP32_ROWS-row steps
        self.packed_head_fp32: torch.Tensor | None = None

    def fuse(self) -> DecoderLM:
        """Build the fast forward's fused weights (idempotent; no extra memory, see the module doc)."""
        if self.fused is not None:
            return self
        c = self.config
        fused = []
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse([a.q_proj, a.k_proj, a.v_proj], c.qkv_bias)
            gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj], c.mlp_bias)
            fused.append(FusedLayer(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=qkv, qkv_bias=qkv_bias,
                o=a.o_proj.weight.detach(), o_bias=a.o_proj.bias.detach() if c.o_bias else None,
                q_norm=a.q_norm.weight.detach() if c.qk_norm else None,
                k_norm=a.k_norm.weight.detach() if c.qk_norm else None,
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=gate_up, gate_up_bias=gate_up_bias,
                down=mlp.down_proj.weight.detach(), down_bias=mlp.down_proj.bias.detach() if c.mlp_bias else None,
            ))
        self.fused = fused
        if cpu_layout.wanted(self):
            cpu_layout.relayout(self)  # float32 on CPU: each kind of weight in its faster layout
            fused = self.fused
        head = (self.model.embed_tokens.weight if c.tie_word_embeddings else self.lm_head.weight).detach()
        if _should_pack(head, torch.bfloat16):
            # bfloat16 on CPU: oneDNN prepacked weights (AMX / avx512_bf16 layout) instead of
            # F.linear, which re-lays the weight out on every call: 1.3-1.5x faster matmuls
            # at M = 1..512 here (bench/RESULTS.md). A second copy of the matmul weights.
            fused = [_packed(w) for w in fused]
            self.packed_head = _pack(head)
        elif _should_pack(head, torch.float32) and sum(p.numel() for p in self.parameters()) * 4 <= PACK_FP32_MAX_BYTES:
            # float32 on CPU: oneDNN prepacked copies for steps of PACKED_FP32_ROWS rows (batched
            # decode), 1.25-1.4x faster than MKL's sgemm there; slower at 1 row and no better
            # for prefill-sized steps, which keep F.linear. Doubles the weights' memory, so
            # only for models up to PACK_FP32_MAX_BYTES.
            self.fused_fp32_packed = [_packed(w) for w in fused]
            self.packed_head_fp32 = _pack(head)
        self.fused = fused
        return self

    def packed_bytes(self) -> int:
        """Memory of the oneDNN packed copies of the matmul weights kept beside the parameters."""
        layers = [w for group in (self.fused_fp32_packed, self.fused) for w in group or ()]
        tensors = [t for w in layers for t in (w.qkv, w.o, w.gate_up, w.down)]
        tensors += [t for t in (self.packed_head, self.packed_head_fp32) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors if t.is_mkldnn)

    def _apply(self, fn, recurse: bool = True):
        """.to(), .cuda(), .half() and the like: the fused tensors are not parameters, so they
        would stay behind (on the old device or dtype) while each parameter moves on its own.
        Drop them, move the parameters, and fuse again where the model was fused."""
        fused = self.fused is not None
        self.fused = self.packed_head = self.fused_fp32_packed = self.packed_head_fp32 = None
        out = super()._apply(fn, recurse)
        if fused:
            self.fuse()
        return out

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Final (normed) hidden states of a flat batch: [M] ids -> [M, hidden]."""
        if self.fused is not None and not ctx.reference:
            return self._fast_hidden_states(input_ids, positions, ctx)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rope, ctx)
        return self.model.norm(x)

    def _fast_hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        c = self.config
        heads, kv_heads, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        hq, hk, inter = heads * d, kv_heads * d, c.intermediate_size
        norm_shape, head_shape = (c.hidden_size,), (d,)
        m = input_ids.shape[0]
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        cos, sin = self.rope.tables(positions, x.dtype)
        layers, lora = self.fused, ctx.lora
        if self.fused_fp32_packed is not None and m in PACKED_FP32_ROWS:
            layers = self.fused_fp32_packed
        for i, w in enumerate(layers):
            h = F.rms_norm(x, norm_shape, w.input_norm, eps)
            qkv = _linear(h, w.qkv, w.qkv_bias)
            if lora is not None:  # deltas into the fused output's column slices, before q/k norm and rope
                lora.apply(i, "q_proj", h, qkv[:, :hq])
                lora.apply(i, "k_proj", h, qkv[:, hq:hq + hk])
                lora.apply(i, "v_proj", h, qkv[:, hq + hk:])
            if w.q_norm is None:
                qk = apply_rope(qkv[:, :hq + hk].view(m, heads + kv_heads, d), cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = apply_rope(F.rms_norm(qkv[:, :hq].view(m, heads, d), head_shape, w.q_norm, eps), cos, sin)
                k = apply_rope(F.rms_norm(qkv[:, hq:hq + hk].view(m, kv_heads, d), head_shape, w.k_norm, eps), cos, sin)
            v = qkv[:, hq + hk:].view(m, kv_heads, d)
            a = attend(i, q, k, v, ctx)
            x = _residual_linear(x, a, w.o, w.o_bias)
            if lora is not None:  # o_proj's delta straight into the residual stream
                lora.apply(i, "o_proj", a, x)
            h = F.rms_norm(x, norm_shape, w.post_norm, eps)
            gu = _linear(h, w.gate_up, w.gate_up_bias)
            if lora is not None:  # before the SiLU
                lora.apply(i, "gate_proj", h, gu[:, :inter])
                lora.apply(i, "up_proj", h, gu[:, inter:])
            act = F.silu(gu[:, :inter]).mul_(gu[:, inter:])
            x = _residual_linear(x, act, w.down, w.down_bias)
            if lora is not None:
                lora.apply(i, "down_proj", act, x)
        return F.rms_norm(x, norm_shape, self.model.norm.weight, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """float32 logits of the given hidden rows; the lm_head runs only on these rows."""
        if self.packed_head is not None and not reference:
            return _linear(hidden.contiguous(), self.packed_head, None).float()
        if self.packed_head_fp32 is not None and not reference and hidden.shape[0] in PACKED_FP32_ROWS:
            return _linear(hidden.contiguous(), self.packed_head_fp32, None)
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()


# float32 steps with this many rows use oneDNN prepacked weights (see DecoderLM.fuse).
PACKED_FP32_ROWS = range(2, 49)
PACK_FP32_MAX_BYTES = 1 << 30


def _should_pack(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    if weight.device.type != "cpu" or weight.dtype != dtype or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)


def _packed(w: FusedLayer) -> FusedLayer:
    return w._replace(qkv=_pack(w.qkv), o=_pack(w.o), gate_up=_pack(w.gate_up), down=_pack(w.down))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _residual_linear(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + a @ weight.T (+ bias), the add fused into the matmul (addmm, or oneDNN's binary post-op)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise.binary(a, x, weight, bias, "add")
    if bias is not None:
        return x + F.linear(a, weight, bias)
    return torch.addmm(x, a, weight.t())
