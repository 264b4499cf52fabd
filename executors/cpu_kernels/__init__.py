"""float32 kernels for the steps of a model on a CPU (AVX2 + FMA, AVX-512 where the CPU has
it; built by build.py).

- weight_panel.c: the projections and the lm_head of steps of every size over weights
  stored in 6-column panels (panels.py, the weights' one copy): decode rows stream them at
  the memory's rate, steps of more rows run tiles at 80-95 % of the FMA units' rate where
  the CPU has AVX-512 (weight_panel512.h; bench/RESULTS.md run 21), the AVX2 ones otherwise;
  or as int8 16-column panels with float32 scales (qpanels.py, weight_q8.h), computing
  exactly what the float32 panels of their dequantized weights would;
- pointwise.c: RMSNorm, the rotary embedding and the gated activation without torch's
  per-op set-up;
- paged_attention.c: the new tokens' K and V stored into the pool, and decode attention
  reading K and V in place through the block tables;
- prefill_attention.c: causal attention of fresh prompts over themselves, as panel matmuls
  over the causal triangle;
- argmax.c: the ARGMAX policy's token and log-probability in one call;
- sampling.c: the SAMPLE policy's draw (top-k, top-p, min-p, inversion) in one call;
- decode_step.c: a whole decode step of a dense model, every layer, in one call, its
  layer's phases in decode_layer.h (executors/models/fused_decode.py; the structures in step.py).

`cpu_kernels()` returns the process's CpuKernels, or None where they cannot be built here
(the reason is logged once, and the model keeps torch's ops).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from executors.cpu_kernels.attention_calls import MAX_HEADS, AttentionCalls
from executors.cpu_kernels.build import KernelsUnavailable, build_library, load_library
from executors.cpu_kernels.calls import C_FLOAT as _F
from executors.cpu_kernels.calls import C_INT as _C
from executors.cpu_kernels.calls import C_INT64 as _I
from executors.cpu_kernels.calls import C_PTR as _P
from executors.cpu_kernels.calls import F32 as _F32
from executors.cpu_kernels.calls import I8 as _I8
from executors.cpu_kernels.calls import I64 as _I64
from executors.cpu_kernels.calls import bind, refused
from executors.cpu_kernels.panels import PANEL, Panels
from executors.cpu_kernels.qpanels import Q8PANEL, QGROUP, QPanels
from executors.cpu_kernels.step import DecoderSpec, StepSpec

log = logging.getLogger(__name__)

MAX_ROPE_DIM = 512  # head dimension the rotation takes (pointwise.c's row buffer)
GLU_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}

class CpuKernels(AttentionCalls):
    """ctypes bindings; every tensor is float32 on the CPU with rows of unit stride.

    Each wrapper checks what its C function assumes of its arguments (dtype, device, rank,
    shape, the strides it does not take) and raises TypeError (a dtype, a non-tensor) or
    ValueError (the rest) naming the argument: the C functions index with them unchecked. The
    checks are attribute comparisons only, cheap beside the calls they guard (linear() of one
    row of 576 over a 576 x 576 weight: 21 us before and after them on the 2-core EPYC; the
    strides are read once where they were read twice). The values inside index tensors
    (slots, positions, block tables, key bounds) stay the callers' to check, as each says."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._linear = bind(library, "me_weight_linear_f32", [_P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _I, _C],
                             ctypes.c_int)
        self._glu_linear = bind(library, "me_glu_linear_f32", [_P, _I, _I, _C, _P, _I, _I, _P, _P, _I, _P, _I, _C],
                                 ctypes.c_int)
        self._linear_q8 = bind(library, "me_weight_linear_q8",
                                [_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I, _C], ctypes.c_int)
        self._isa = bind(library, "me_isa", [_C], ctypes.c_int)
        self._fma_flops = bind(library, "me_fma_flops", [_I, _C], ctypes.c_int64)
        self._rms_norm = bind(library, "me_rms_norm_f32", [_P, _I, _I, _I, _I, _I, _P, _F, _P, _I, _I, _C])
        self._rope = bind(library, "me_rope_f32", [_P, _I, _I, _I, _I, _P, _P, _P, _C])
        self._glu = bind(library, "me_glu_f32", [_P, _I, _I, _I, _C, _P, _C])
        self._argmax = bind(library, "me_argmax_logprob_f32", [_P, _I, _I, _I, _P, _P, _C], ctypes.c_int)
        self._sample = bind(library, "me_sample_f32", [_P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _C], ctypes.c_int)
        self._decode_step = bind(library, "me_decode_step_f32", [_P, _P, _C], ctypes.c_int)
        self.bind_attention(library)

    @staticmethod
    def accepts(w: torch.Tensor) -> bool:
        """A weight the kernels take once packed (panels.pack): a float32 matrix on the CPU."""
        return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2

    @staticmethod
    def attention_accepts(heads: int, kv_heads: int, head_dim: int) -> bool:
        return heads <= MAX_HEADS and heads % kv_heads == 0 and head_dim % 8 == 0

    def linear(self, x: torch.Tensor, w: Panels | QPanels, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, glu: str | None = None) -> torch.Tensor:
        """x @ w.T (+ bias) (+ residual): x [m, k], w [n, k] as float32 panels (panels.pack) or
        int8 ones (qpanels.quantize), bias [n], residual [m, n]. Where `glu` names an activation
        (as glu's), x is a gated MLP's gate/up output [m, 2 k] and the rows multiplied are
        glu(x, glu): float32 panels compute it as they pack x, with no [m, k] tensor between."""
        if x.dtype is not _F32 or x.ndim != 2 or not x.is_cpu:
            raise refused("linear", "x", x, "a float32 CPU matrix [m, k]", _F32)
        if glu is not None and (type(w) is not Panels or x.shape[0] == 0):
            x, glu = self.glu(x, glu), None
        kind = type(w)
        if kind is not Panels and kind is not QPanels:
            raise TypeError(f"CpuKernels.linear: w must be Panels (panels.pack) or QPanels (qpanels.quantize), "
                            f"not {kind.__name__}")
        data, n = w.data, w.n
        dtype, panel = (_F32, PANEL) if kind is Panels else (_I8, Q8PANEL)
        if data.dtype is not dtype or data.ndim != 3 or not data.is_cpu or not data.is_contiguous():
            raise refused("linear", "w.data", data, f"a contiguous {dtype} CPU tensor [ceil(n / {panel}), k, "
                           f"{panel}]", dtype)
        m, k = x.shape
        if glu is not None:
            act = GLU_ACTIVATIONS.get(glu)
            if act is None or k % 2:
                raise ValueError(f"CpuKernels.linear: glu takes a gate/up output [m, 2 k] and one of "
                                 f"{sorted(GLU_ACTIVATIONS)}, not {k} columns and {glu!r}")
            k //= 2
        count, kw, width = data.shape
        if k != kw:
            raise ValueError(f"CpuKernels.linear: x has {k} columns, the weight {kw}")
        if width != panel or count * panel < n:
            raise refused("linear", "w.data", data, f"panels of {panel} columns for w.n = {n} rows")
        if kind is QPanels:
            _check_int8(w)
        sx = x.stride()
        if sx[1] != 1:
            x = x.contiguous()
            sx = x.stride()
        if bias is not None:
            if bias.dtype is not _F32 or bias.shape != (n,) or not bias.is_cpu:
                raise refused("linear", "bias", bias, f"a float32 CPU vector [n] = [{n}]", _F32)
            if not bias.is_contiguous():
                bias = bias.contiguous()
        ldr = 0
        if residual is not None:
            if residual.dtype is not _F32 or residual.shape != (m, n) or not residual.is_cpu:
                raise refused("linear", "residual", residual, f"a float32 CPU matrix [m, n] = [{m}, {n}]", _F32)
            ldr, unit = residual.stride()
            if unit != 1:
                residual = residual.contiguous()
                ldr = residual.stride(0)
        if k == 0:  # an empty sum: what is left is the bias and the residual
            y = torch.zeros(m, n, dtype=torch.float32)
            return y.add_(bias if bias is not None else 0).add_(residual if residual is not None else 0)
        y = torch.empty(m, n, dtype=torch.float32)
        tail = (None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(), ldr,
                y.data_ptr(), n, torch.get_num_threads())
        if glu is not None:
            failed = self._glu_linear(x.data_ptr(), m, sx[0], act, data.data_ptr(), n, k, *tail)
        elif kind is Panels:
            failed = self._linear(x.data_ptr(), m, sx[0], data.data_ptr(), n, k, *tail)
        else:
            failed = self._linear_q8(x.data_ptr(), m, sx[0], data.data_ptr(), w.scales.data_ptr(), n, k, *tail)
        if failed:
            raise MemoryError("the matmul kernel could not allocate its scratch (packed rows of x, dequantized panels)")
        return y

    def residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: Panels | QPanels,
                        bias: torch.Tensor | None, glu: str | None = None) -> torch.Tensor:
        """x + a @ w.T (+ bias): the residual add in the kernel's store (`glu` as linear's)."""
        return self.linear(a, w, bias, residual=x, glu=glu)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """F.rms_norm over the last dimension of x ([m, n], or [m, heads, n] with heads n apart)."""
        if x.dtype is not _F32 or not 2 <= x.ndim <= 3 or not x.is_cpu:
            raise refused("rms_norm", "x", x, "a float32 CPU tensor [m, n] or [m, heads, n]", _F32)
        if x.stride(-1) != 1:
            x = x.contiguous()
        n = x.shape[-1]
        if weight.dtype is not _F32 or weight.shape != (n,) or not weight.is_cpu:
            raise refused("rms_norm", "weight", weight, f"a float32 CPU vector [n] = [{n}]", _F32)
        if weight.stride(0) != 1:
            weight = weight.contiguous()
        outer = x.shape[0]
        inner = x.shape[1] if x.ndim == 3 else 1
        inner_stride = x.stride(1) if x.ndim == 3 else n
        y = torch.empty(x.shape, dtype=torch.float32)
        self._rms_norm(x.data_ptr(), outer, inner, x.stride(0), inner_stride, n, weight.data_ptr(), eps,
                       y.data_ptr(), inner * n, n, torch.get_num_threads())
        return y

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x ([m, heads, d], heads d floats apart, d even and <= MAX_ROPE_DIM) in place;
        positions int64 [m]; tables [max_positions, d], every position below max_positions
        (step_ops checks the positions' values)."""
        if x.dtype is not _F32 or x.ndim != 3 or not x.is_cpu:
            raise refused("rope_", "x", x, "a float32 CPU tensor [m, heads, d]", _F32)
        m, heads, d = x.shape
        sx = x.stride()
        if sx[2] != 1 or (sx[1] != d and heads > 1) or d % 2 or d > MAX_ROPE_DIM:
            raise refused("rope_", "x", x, f"heads of d contiguous floats, d even and at most {MAX_ROPE_DIM}")
        if positions.dtype is not _I64 or positions.shape != (m,) or not positions.is_cpu:
            raise refused("rope_", "positions", positions, f"an int64 CPU vector [m] = [{m}]", _I64)
        if positions.stride(0) != 1:
            positions = positions.contiguous()
        for name, table in (("cos", cos), ("signed_sin", signed_sin)):
            if (table.dtype is not _F32 or table.ndim != 2 or table.shape[1] != d or not table.is_cpu
                    or not table.is_contiguous()):
                raise refused("rope_", name, table, f"a contiguous float32 CPU table [max_positions, d = {d}]", _F32)
        if signed_sin.shape != cos.shape:
            raise refused("rope_", "signed_sin", signed_sin, f"of cos's shape {tuple(cos.shape)}")
        self._rope(x.data_ptr(), m, heads, sx[0], d, positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
                   torch.get_num_threads())
        return x

    def glu(self, gu: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gu[:, :I]) * gu[:, I:] for gu [m, 2 I] (rows of unit stride); act "silu" or "gelu_tanh"."""
        if gu.dtype is not _F32 or gu.ndim != 2 or gu.shape[1] % 2 or not gu.is_cpu:
            raise refused("glu", "gu", gu, "a float32 CPU matrix [m, 2 I]", _F32)
        act = GLU_ACTIVATIONS.get(activation)
        if act is None:
            raise ValueError(f"CpuKernels.glu: activation must be one of {sorted(GLU_ACTIVATIONS)}, not {activation!r}")
        m, inter = gu.shape[0], gu.shape[1] // 2
        if gu.stride(1) != 1:
            gu = gu.contiguous()
        y = torch.empty(m, inter, dtype=torch.float32)
        self._glu(gu.data_ptr(), m, gu.stride(0), inter, act, y.data_ptr(), torch.get_num_threads())
        return y

    def argmax_logprob(self, x: torch.Tensor) -> tuple[list[int], list[float]] | None:
        """Each row's first largest logit and its log-probability (x [n, vocab] float32); None
        when a row holds a NaN or an infinite maximum (torch's rules then apply)."""
        if x.dtype is not _F32 or x.ndim != 2 or not x.is_cpu:
            raise refused("argmax_logprob", "x", x, "a float32 CPU matrix [rows, vocab]", _F32)
        rows, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        token = torch.empty(rows, dtype=torch.int64)
        logprob = torch.empty(rows, dtype=torch.float32)
        if self._argmax(x.data_ptr(), rows, n, x.stride(0), token.data_ptr(), logprob.data_ptr(),
                        torch.get_num_threads()) != 0:
            return None
        return token.tolist(), logprob.tolist()

    def sample(self, scaled: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float],
               u: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's drawn token ([rows] int64) and the log of the probability it was drawn
        with ([rows] float64), as logits._draw computes them: scaled [rows, vocab] float32
        (logits / temperature, finite or -inf, each row's largest finite), the row's top_k
        (0 keeps all), top_p, min_p and its uniform number u in [0, 1). None when the kernel's
        scratch could not be allocated."""
        if scaled.dtype is not _F32 or scaled.ndim != 2 or not scaled.is_cpu:
            raise refused("sample", "scaled", scaled, "a float32 CPU matrix [rows, vocab]", _F32)
        rows, n = scaled.shape
        if not len(top_k) == len(top_p) == len(min_p) == len(u) == rows:
            raise ValueError(f"CpuKernels.sample: top_k, top_p, min_p and u need {rows} entries each, one a row")
        if scaled.stride(1) != 1:
            scaled = scaled.contiguous()
        params = (torch.tensor(top_k, dtype=_I64), torch.tensor(top_p, dtype=_F32), torch.tensor(min_p, dtype=_F32),
                  torch.tensor(u, dtype=torch.float64))
        token, drawn = torch.empty(rows, dtype=_I64), torch.empty(rows, dtype=torch.float64)
        if self._sample(scaled.data_ptr(), rows, n, scaled.stride(0), *(t.data_ptr() for t in params),
                        token.data_ptr(), drawn.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return token, drawn

    def isa(self, avx512: bool | None = None) -> str:
        """The instructions of the wide paths (the int8 dot products, the float32 tiles past
        6 rows): "avx512" where the CPU has AVX-512, else "avx2"; avx512=False asks for AVX2
        from now on, in this process (tests compare the two), True for AVX-512 again where
        the CPU has it."""
        return "avx512" if self._isa(-1 if avx512 is None else int(avx512)) else "avx2"

    def fma_flops(self, steps: int) -> int:
        """Runs `steps` rounds of register-only vector FMAs on each of torch's threads, as wide
        as the matmul tiles run (isa()), and returns the floating-point operations done: the
        bench times the call for the machine's fp32 FMA peak (fma_rate.c)."""
        if steps < 0:
            raise ValueError(f"CpuKernels.fma_flops: steps must be >= 0, not {steps}")
        return self._fma_flops(steps, torch.get_num_threads())

    def decode_step(self, model: DecoderSpec, step: StepSpec) -> int:
        """me_decode_step_f32 (step.py's DecoderSpec and StepSpec): 0, or step.OUT_OF_RANGE
        when an index was out of range (nothing written); raises on the other failures."""
        if type(model) is not DecoderSpec or type(step) is not StepSpec:
            raise TypeError(f"CpuKernels.decode_step: model and step must be a DecoderSpec and a StepSpec, not "
                            f"{type(model).__name__} and {type(step).__name__}")
        status = self._decode_step(ctypes.addressof(model), ctypes.addressof(step), torch.get_num_threads())
        if status == -1:
            raise MemoryError("the decode step kernel could not allocate its scratch buffers")
        if status == -2:
            raise ValueError("the decode step kernel does not take this model's shape")
        return status


def _check_int8(w: QPanels) -> None:
    """What the int8 kernels assume of w's scales (qpanels.py)."""
    count, k, _ = w.data.shape
    scales, groups = w.scales, -(-k // QGROUP)
    if (scales.dtype is not _F32 or scales.shape != (count, groups, Q8PANEL) or not scales.is_cpu
            or not scales.is_contiguous()):
        raise refused("linear", "w.scales", scales, f"a contiguous float32 CPU tensor [{count}, ceil(k / {QGROUP}), "
                       f"{Q8PANEL}] = [{count}, {groups}, {Q8PANEL}]", _F32)


_unavailable: list[str] = []  # why cpu_kernels() returned None, once it has


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels, built or loaded once per process; None (logged) where they cannot be."""
    try:
        path = build_library()
        kernels = CpuKernels(load_library(path))
    except KernelsUnavailable as e:
        log.warning("float32 CPU kernels unavailable, decode steps stay with torch's ops: %s", e)
        _unavailable.append(str(e))
        return None
    log.info("float32 CPU kernels loaded from %s", path)
    return kernels


def kernels_unavailable_reason() -> str | None:
    """Why the kernels cannot be built or loaded here (asking builds them once); None where they can."""
    return None if cpu_kernels() is not None else _unavailable[0]
