"""Which code runs a step's matmuls, norms and rotations, by device, dtype and row count.

- float32 on a CPU with the kernels of executors/cpu_kernels built: steps of every size run
  their matmuls there, over the weights stored as panels (panel_modules.py; at the memory's
  rate for decode rows, above MKL's sgemm for larger steps), their RMSNorms, rotations and
  gated activation (torch's per-op set-up is most of those ops' cost at decode sizes; at
  prefill sizes the kernels' loops, threaded over rows, are still 2-2.5x faster).
  (Decode steps of dense models usually skip all of this: executors/models/fused_decode.py
  runs them as one kernel call.)
- float32 on a CPU without the kernels, steps of PACKED_FP32_ROWS rows: oneDNN prepacked
  copies (batched decode), 1.25-1.4x faster than MKL's sgemm there. They double the
  weights' memory, so only for models up to PACK_FP32_MAX_BYTES; status reports them
  (DecoderLM.packed_bytes).
- bfloat16 on a CPU: oneDNN prepacked weights (AMX / avx512_bf16 layout) for every step:
  F.linear would re-lay the weight out on every call (1.3-1.5x slower at M = 1..512).
- Everything else (prefill-sized float32 steps, CUDA): F.linear, with the residual add folded
  into addmm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from executors.cpu_kernels import MAX_ROPE_DIM
from executors.models import layers
from executors.models.layers import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from executors.cpu_kernels import CpuKernels
    from executors.models.decoder import FusedLayer

PACKED_FP32_ROWS = range(2, 49)
PACK_FP32_MAX_BYTES = 1 << 30

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
ResidualLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# (x, weight, eps) over the last dim; a LayerNorm's "weight" may be its weight and bias stacked
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
Rotate = Callable[[torch.Tensor, bool], torch.Tensor]  # (x [m, heads, d], local table?) -> rotated
Glu = Callable[[torch.Tensor], torch.Tensor]  # gate_up [m, 2 I] -> act(gate) * up [m, I]
# (residual, gate_up, weight, bias) -> residual + glu(gate_up) @ weight.T + bias: a gated MLP's down
GluResidualLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class StepOps(NamedTuple):
    """The weights a step reads and the calls it makes with them."""

    layers: list[FusedLayer]
    linear: Linear  # (x, weight, bias) -> x @ weight.T + bias
    residual_linear: ResidualLinear  # (residual, x, weight, bias) -> residual + x @ weight.T + bias
    norm: Norm
    rotate: Rotate  # may rotate x in place (the kernels do) and returns it
    glu: Glu
    # The kernels compute the activation as the down matmul packs its rows (pack_x.h): no
    # [m, I] tensor between, the same bits.
    glu_down: GluResidualLinear


def for_step(positions: torch.Tensor, fused: list[FusedLayer], packed: list[FusedLayer] | None,
             kernels: CpuKernels | None, rope: RotaryEmbedding, rope_local: RotaryEmbedding | None,
             dtype: torch.dtype, activation: str, layer_norm: bool = False, gated: bool = True) -> StepOps:
    """`layer_norm`: the model's norms are LayerNorms (Cohere, StableLM), which torch computes;
    `gated` False: an ungated MLP (StarCoder2), whose "glu" is the activation alone, in torch."""
    rows = positions.shape[0]
    # The kernels' rotation reads the tables at the given positions unchecked: check once here.
    # Only with the (CPU) kernels: on a GPU the min/max would synchronize every step, and a
    # CUDA graph cannot capture a synchronization.
    fits = (kernels is not None and rope.cos.shape[1] <= MAX_ROPE_DIM and 0 < rows and 0 <= int(positions.min())
            and int(positions.max()) < rope.cos.shape[0])
    # The kernels' ops are threaded over rows for prefill-sized steps and beat torch's there
    # too: RMSNorm 21 against 47 us at 128 rows of 576, 92 against 242 at 1024; SiLU-and-
    # multiply ~60 against 150 us at 128 rows of 1536.
    if kernels is not None and fits:
        norm, rotate = kernels.rms_norm, _kernel_rotate(kernels, positions, rope, rope_local or rope)
        glu = functools.partial(kernels.glu, activation=activation)
        glu_down = functools.partial(kernels.residual_linear, glu=activation)
    else:
        norm = kernels.rms_norm if kernels is not None else torch_norm
        rotate = _torch_rotate(positions, rope, rope_local, dtype)
        glu = functools.partial(torch_glu, act=layers.activation(activation))
        glu_down = None
    if layer_norm:
        norm = torch_layer_norm
    if not gated:
        glu, glu_down = layers.activation(activation), None
    if kernels is not None:  # the weights are panels (panel_modules.py): every step through the kernels
        return StepOps(fused, kernels.linear, kernels.residual_linear, norm, rotate, glu,
                       glu_down or glu_then(kernels.residual_linear, glu))
    if packed is not None and rows in PACKED_FP32_ROWS:
        return StepOps(packed, linear, residual_linear, norm, rotate, glu, glu_then(residual_linear, glu))
    return StepOps(fused, linear, residual_linear, norm, rotate, glu, glu_then(residual_linear, glu))


def glu_then(residual_linear: ResidualLinear, glu: Glu) -> GluResidualLinear:
    """A gated MLP's down projection as two calls: the activation, then the matmul."""
    return lambda residual, gate_up, weight, bias: residual_linear(residual, glu(gate_up), weight, bias)


def torch_glu(gu: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    inter = gu.shape[1] // 2
    return act(gu[:, :inter]).mul_(gu[:, inter:])


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def torch_layer_norm(x: torch.Tensor, params: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.layer_norm of `params`: the weight, or the weight and the bias stacked [2, dim]
    (LayerNorm.fused_weight)."""
    weight, bias = (params[0], params[1]) if params.dim() == 2 else (params, None)
    return layers.layer_norm(x, weight, bias, eps)


def _torch_rotate(positions: torch.Tensor, rope: RotaryEmbedding, rope_local: RotaryEmbedding | None,
                  dtype: torch.dtype) -> Rotate:
    # Looked up once per step, not per layer, and only once a layer rotates (a step whose
    # layers all run the fused prologue of triton_prologue.py launches no lookup at all).
    looked_up: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def rotate(x: torch.Tensor, sliding: bool) -> torch.Tensor:
        local = sliding and rope_local is not None
        if local not in looked_up:
            looked_up[local] = (rope_local if local else rope).tables(positions, dtype)
        cos, sin = looked_up[local]
        return apply_rope(x, cos, sin)
    return rotate


def _kernel_rotate(kernels: CpuKernels, positions: torch.Tensor, rope: RotaryEmbedding,
                   rope_local: RotaryEmbedding) -> Rotate:
    positions = positions.to(torch.int64).contiguous()

    def rotate(x: torch.Tensor, sliding: bool) -> torch.Tensor:
        table = rope_local if sliding else rope
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            x = x.contiguous()
        return kernels.rope_(x, positions, table.cos, table.signed_sin)
    return rotate


def should_pack(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    if weight.device.type != "cpu" or weight.dtype != dtype or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)


def packed(w: FusedLayer) -> FusedLayer:
    """The layer with its matmul weights prepacked (a sparse layer's experts stay as they are)."""
    dense = {} if w.gate_up is None else dict(gate_up=pack(w.gate_up), down=pack(w.down))
    if w.q_b is not None:  # DeepSeek's q_b_proj
        dense["q_b"] = pack(w.q_b)
    return w._replace(qkv=pack(w.qkv), o=pack(w.o), **dense)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def residual_linear(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + a @ weight.T (+ bias), the add fused into the matmul (addmm, or oneDNN's binary post-op).
    x, the residual stream, may be updated in place: the forward never reads it again."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise.binary(a, x, weight, bias, "add")
    if bias is not None:
        return x + F.linear(a, weight, bias)
    # In place: out-of-place addmm first copies x into its output (on a GPU a device-to-device
    # copy, two a layer, each a node of the decode graphs: 56 of a Qwen3-0.6B step's, run 24).
    return x.addmm_(a, weight.t())


def add_rows_(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """out[rows[i]] += values[i], in place, repeated rows summed in index order.

    On a CPU through index_put_'s accumulate, not index_add_: index_add_ opens an OpenMP
    region whose threads have gone to sleep since the kernels' last one. Right after a kernel
    call it took 237 us on the 2-vCPU VM of bench/RESULTS.md run 25, index_put_ 6.5 us (alone,
    ~5 us each). On CUDA index_add_, which a CUDA graph captures."""
    if out.is_cuda:
        return out.index_add_(0, rows, values)
    return out.index_put_((rows,), values, accumulate=True)
