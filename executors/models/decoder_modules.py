"""The decoder's nn.Modules in the Hugging Face checkpoints' layout, and the reference forward they run.

DecoderModel (embed_tokens, layers, norm) and each DecoderLayer (input_layernorm, self_attn
with q_proj/k_proj/v_proj/o_proj, post_attention_layernorm, then the mlp or a sparse layer's
experts) carry the parameter names of the checkpoints (model.layers.N.self_attn.q_proj...),
so a safetensors state dict loads into them as it is. Their forward is the reference one:
the modules as written, three projections, attention through attend_reference, LoRA deltas
added to each adapted projection's output. DecoderLM (decoder.py) holds a DecoderModel and
runs this forward when a step asks for the reference; its fast forward (fast_forward.py)
reads the same parameters through the fused tensors of fused_weights.py.

Family flags reach the layers here: a sparse layer's MLP is a SparseMoe (moe.py), Gemma 2 and 3's
sandwich norms are two more RMSNorms around the MLP, its attention output normed before the add,
and OLMo 2 keeps only the norms of attention's and the MLP's outputs (no input_layernorm) and
norms q and k over all heads at once. DeepSeek's layers hold a LatentAttention (mla.py) in
self_attn's place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from executors.lora_batch import LoraBatch
from executors.models.attention import StepContext
from executors.models.attention_reference import attend_reference
from executors.models.config import DecoderConfig
from executors.models.layers import MLP, HeadLayerNorm, RMSNorm, RotaryEmbedding, norm, rms_norm_across_heads
from executors.models.mla import LatentAttention
from executors.models.moe import SparseMoe

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
        if c.attention_sinks:  # GPT-OSS: a logit per head (attention.LayerAttention.sinks)
            self.sinks = nn.Parameter(torch.zeros(c.num_heads))
        self.across_heads = c.qk_norm_across_heads  # OLMo 2
        if c.qk_norm and c.layer_norm:  # Command R+: LayerNorms of each head, a weight row per head
            self.q_norm = HeadLayerNorm(c.num_heads, c.head_dim, c.rms_norm_eps)
            self.k_norm = HeadLayerNorm(c.num_kv_heads, c.head_dim, c.rms_norm_eps)
        elif c.qk_norm:
            q_width, k_width = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim) if self.across_heads else (
                c.head_dim, c.head_dim)
            self.q_norm = RMSNorm(q_width, c.rms_norm_eps, c.norm_offset)
            self.k_norm = RMSNorm(k_width, c.rms_norm_eps, c.norm_offset)

    @property
    def fused_names(self) -> tuple[str, str, str]:
        """The projections of the hidden state, fused into the fast forward's one matmul (its `qkv`)."""
        return "q_proj", "k_proj", "v_proj"

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding | None,
                ctx: StepContext, mean_over_ranks: Reduce | None = None) -> torch.Tensor:
        """`rope` None: a NoPE layer (SmolLM3), q and k not rotated. `mean_over_ranks`: under
        tensor parallelism, what makes a rank's mean square of its heads the whole row's (OLMo 2)."""
        m, lora = x.shape[0], ctx.lora
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if lora is not None:
            lora.apply(self.layer, "q_proj", x, q)
            lora.apply(self.layer, "k_proj", x, k)
            lora.apply(self.layer, "v_proj", x, v)
        if self.across_heads:
            eps = self.q_norm.eps
            q = rms_norm_across_heads(q, self.q_norm.weight, eps, mean_over_ranks)
            k = rms_norm_across_heads(k, self.k_norm.weight, eps, mean_over_ranks)
        q = q.view(m, self.num_heads, self.head_dim)
        k = k.view(m, self.num_kv_heads, self.head_dim)
        v = v.view(m, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm") and not self.across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope(q, k, positions)
        a = attend_reference(self.layer, q, k, v, ctx)
        out = self.o_proj(a)
        if lora is not None:
            lora.apply(self.layer, "o_proj", a, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        h = config.hidden_size
        if config.pre_norms:  # not OLMo 2's layers
            self.input_layernorm = norm(config, h)
        # DeepSeek: multi-head latent attention (mla.py)
        self.self_attn = Attention(config, layer) if config.mla is None else LatentAttention(config, layer)
        # Gemma 2 and 3, OLMo 2: the norm of attention's output; elsewhere the norm before the
        # MLP, but for a parallel layer (Cohere), whose MLP reads the input norm's output.
        self.parallel = config.parallel_residual
        if not self.parallel:
            self.post_attention_layernorm = norm(config, h)
        if config.sandwich_norms:
            if config.pre_norms:
                self.pre_feedforward_layernorm = norm(config, h)
            self.post_feedforward_layernorm = norm(config, h)
        self.sparse = config.moe is not None and config.moe.sparse_layers[layer]
        self.ffn_name = config.moe.module_name if self.sparse else "mlp"
        setattr(self, self.ffn_name, SparseMoe(config) if self.sparse else MLP(config))

    @property
    def ffn(self) -> MLP | SparseMoe:
        return getattr(self, self.ffn_name)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding | None, ctx: StepContext,
                load: torch.Tensor | None = None, reduce: Reduce | None = None,
                mean_over_ranks: Reduce | None = None) -> torch.Tensor:
        """`reduce`: under tensor parallelism, the all-reduce that sums the ranks' partial
        outputs of o_proj and of the MLP's down projection (row-parallel layers);
        `mean_over_ranks` averages OLMo 2's q/k norm statistics over them."""
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        a = self.self_attn(h, positions, rope, ctx, mean_over_ranks)
        if reduce is not None:
            a = reduce(a)
        if self.parallel:  # the MLP reads h too: x + attn(h) + mlp(h)
            x = x + a
        elif hasattr(self, "post_feedforward_layernorm"):  # attention's output normed before the add
            x = x + self.post_attention_layernorm(a)
            h = self.pre_feedforward_layernorm(x) if hasattr(self, "pre_feedforward_layernorm") else x
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
    up = mlp.up_proj(x)
    lora.apply(layer, "up_proj", x, up)
    if mlp.gated:
        gate = mlp.gate_proj(x)
        lora.apply(layer, "gate_proj", x, gate)
        act = mlp.act(gate) * up
    else:
        act = mlp.act(up)
    out = mlp.down_proj(act)
    lora.apply(layer, "down_proj", act, out)
    return out


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = norm(config, config.hidden_size)
