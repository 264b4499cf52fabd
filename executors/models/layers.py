"""Small building blocks: RMSNorm and LayerNorm, rotary embedding (Llama 3, linear or YaRN
scaling), the MLP (gated, or ungated)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from executors.models.config import DecoderConfig, RopeScaling


class RMSNorm(nn.Module):
    """`offset` 1: Gemma's norm, whose checkpoints store w - 1 (it multiplies by 1 + w, in float32)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, as the reference implementation does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def fused_weight(self) -> torch.Tensor:
        """The weight F.rms_norm multiplies by (offset added once, at fuse time)."""
        w = self.weight.detach()
        return (w.float() + self.offset).to(w.dtype) if self.offset else w


class LayerNorm(nn.Module):
    """Cohere's, StableLM's, StarCoder2's and Phi's norm: the mean subtracted and the variance
    normalised, in float32 whatever the weights' dtype (as CohereLayerNorm), times a weight,
    plus a bias (all but Cohere's)."""

    def __init__(self, dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def fused_weight(self) -> torch.Tensor:
        """What the fast forward's norm op takes (step_ops.torch_layer_norm, the one-call step's
        NORM_LAYER_BIAS): the weight, or the weight and the bias stacked ([2, dim])."""
        w = self.weight.detach()
        return w if self.bias is None else torch.stack([w, self.bias.detach()])


class HeadLayerNorm(nn.Module):
    """Command R+'s q/k norm: a LayerNorm of each head's dimensions, without a bias, in float32,
    its weight a row per head ([heads, head_dim], as CohereLayerNorm((heads, head_dim)))."""

    def __init__(self, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, heads, head_dim]."""
        return head_layer_norm(x, self.weight, self.eps)

    def fused_weight(self) -> torch.Tensor:
        return self.weight.detach()


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in float32 (as CohereLayerNorm), cast back to x's dtype."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), None if bias is None else bias.float(),
                        eps).to(x.dtype)


def head_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [m, heads, D] normed over D (float32), times weight [heads, D]."""
    return (F.layer_norm(x.float(), x.shape[-1:], eps=eps) * weight.float()).to(x.dtype)


def norm(config: DecoderConfig, dim: int) -> RMSNorm | LayerNorm:
    """The family's norm over `dim` features."""
    if config.layer_norm:
        return LayerNorm(dim, config.rms_norm_eps, config.norm_bias)
    return RMSNorm(dim, config.rms_norm_eps, config.norm_offset)


def rms_norm_across_heads(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """OLMo 2's q/k norm of rows x [m, heads * D] over all their heads at once, in float32, the
    weight applied before the cast back (as Olmo2RMSNorm). Under tensor parallelism a rank
    holds some of the heads: `mean_over_ranks` makes its mean square the whole row's."""
    xf = x.float()
    ms = xf.pow(2).mean(-1, keepdim=True)
    if mean_over_ranks is not None:
        ms = mean_over_ranks(ms)
    return (xf * torch.rsqrt(ms + eps) * weight.float()).to(x.dtype)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                        factors: tuple[float, ...] = ()) -> torch.Tensor:
    """`head_dim`: the rotated dimensions; `factors`: LongRoPE's per-frequency divisors."""
    # float32 throughout, as the checkpoints' reference implementation computes it: the
    # positions' phases then agree with it bit for bit rather than "more accurately".
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if factors:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * powers)
    inv = 1.0 / powers
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_frequencies(inv, powers, head_dim, theta, scaling)
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """NeoX-style rotary embedding (rotate_half), cos/sin tables precomputed to max positions."""

    def __init__(self, config: DecoderConfig, local: bool = False) -> None:
        """`local`: the sliding layers' table (config.local_rope_theta, unscaled)."""
        super().__init__()
        cos, sin = rope_tables(config, local)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # sin with the first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin.
        signed = sin.clone()
        signed[:, :config.head_dim // 2].neg_()
        self.register_buffer("signed_sin", signed, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [M, H, D], k [M, KVH, D], positions [M]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of the positions ([M, 1, D] each), looked up once per step.

        float32 for float32 models (bit for bit the reference's phases); the activations'
        dtype otherwise, as transformers computes a bfloat16 model's rotation (and ~1.8x
        faster than promoting to float32 and back, bench/RESULTS.md)."""
        cos, sin = self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)
        return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


def _yarn_frequencies(inv: torch.Tensor, powers: torch.Tensor, dim: int, theta: float,
                      scaling: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    divided by the factor (interpolated), those turning more than beta_fast times kept
    (extrapolated), a linear ramp over the dimensions between; in float32 as transformers'
    _compute_yarn_parameters, so that the tables agree with it bit for bit."""
    original = scaling.original_max_position_embeddings

    def dimension(turns: float) -> float:  # the dimension whose frequency turns this many times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    return 1.0 / (scaling.factor * powers) * (1 - kept) + inv * kept


def rope_tables(config: DecoderConfig, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's phases, [max_positions, head_dim] float32.

    With a partial rotary_dim, the rotated pairs are the first rotary_dim / 2 of each half
    (the loader moved q's and k's dimensions there, partial_rotary.py) and the others keep
    cos 1 and sin 0. LongRoPE picks a position's frequencies by the position alone (short
    below original_max_position_embeddings, long from there). transformers picks them by
    the longest position of each forward: a prompt that crosses that length gets the long
    ones throughout there, while a token decoded one a step gets what it gets here. Here a
    position's rotation never depends on the chunk or the batch it came in."""
    head, rotary = config.head_dim, config.rotary_dim or config.head_dim
    scaling = None if local else config.rope_scaling
    theta = config.local_rope_theta if local else config.rope_theta
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    if scaling is not None and scaling.kind == "longrope":
        original = scaling.original_max_position_embeddings
        freqs = torch.cat([torch.outer(positions[:original], inverse_frequencies(rotary, theta, None,
                                                                                 scaling.short_factor)),
                           torch.outer(positions[original:], inverse_frequencies(rotary, theta, None,
                                                                                 scaling.long_factor))])
        gain = scaling.attention_factor
    else:
        freqs = torch.outer(positions, inverse_frequencies(rotary, theta, scaling).float())
        gain = scaling.attention_factor if scaling is not None and scaling.kind == "yarn" else 1.0
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * gain, emb.sin() * gain
    if rotary == head:
        return cos, sin
    # Pairs beyond the rotated ones: identity (cos 1, sin 0), not scaled by the gain.
    keep = (head - rotary) // 2
    ones, zeros = torch.ones(len(positions), keep), torch.zeros(len(positions), keep)
    half = rotary // 2
    return (torch.cat([cos[:, :half], ones, cos[:, half:], ones], dim=-1),
            torch.cat([sin[:, :half], zeros, sin[:, half:], zeros], dim=-1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The same rotation as RotaryEmbedding in three ops: x*cos + swap_halves(x)*signed_sin."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def activation(name: str):
    """The gate's activation: SiLU (SwiGLU), or GELU with the tanh approximation (Gemma's GeGLU)."""
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); StarCoder2's and Phi's ungated one down(act(up(x))), without a gate."""

    def __init__(self, config: DecoderConfig, intermediate_size: int | None = None, bias: bool | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        bias = config.mlp_bias if bias is None else bias
        if config.mlp_gated:
            self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = activation(config.hidden_act)

    @property
    def gated(self) -> bool:
        return hasattr(self, "gate_proj")

    @property
    def gate_up_names(self) -> list[str]:
        """The projections the fast forward's gate_up matrix holds, in its row order."""
        return ["gate_proj", "up_proj"] if self.gated else ["up_proj"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
