"""float32 kernels for the small steps of decode on a CPU (AVX2 + FMA, built by build.py).

- weight_panel.c: the projections and the lm_head of steps of every size over weights
  stored in 6-column panels (panels.py, the weights' one copy): decode rows stream them at
  the memory's rate, 16-64 rows at 150-185 GFLOP/s with the weights from memory, prefills
  near MKL's best sgemm (bench/RESULTS.md runs 11 and 16);
- pointwise.c: RMSNorm, the rotary embedding and the gated activation without torch's
  per-op set-up;
- paged_attention.c: the new tokens' K and V stored into the pool, and decode attention
  reading K and V in place through the block tables;
- prefill_attention.c: causal attention of fresh prompts over themselves, as panel matmuls
  over the causal triangle;
- argmax.c: the ARGMAX policy's token and log-probability in one call;
- decode_step.c: a whole decode step of a dense model, every layer, in one call
  (executors/models/fused_decode.py; its structures in step.py).

`cpu_kernels()` returns the process's CpuKernels, or None where they cannot be built here
(the reason is logged once, and the model keeps torch's ops).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from executors.cpu_kernels.build import KernelsUnavailable, build_library, load_library
from executors.cpu_kernels.panels import Panels

log = logging.getLogger(__name__)

MAX_HEADS = 256  # query heads the attention kernel takes (paged_attention.c)
MAX_ROPE_DIM = 512  # head dimension the rotation takes (pointwise.c's row buffer)
GLU_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}

_P, _I, _C, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _bind(library: ctypes.CDLL, name: str, argtypes: list, restype=None):
    fn = getattr(library, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class CpuKernels:
    """ctypes bindings; every tensor is float32 on the CPU with rows of unit stride."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._linear = _bind(library, "me_weight_linear_f32", [_P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _I, _C],
                             ctypes.c_int)
        self._rms_norm = _bind(library, "me_rms_norm_f32", [_P, _I, _I, _I, _I, _I, _P, _F, _P, _I, _I, _C])
        self._rope = _bind(library, "me_rope_f32", [_P, _I, _I, _I, _I, _P, _P, _P, _C])
        self._glu = _bind(library, "me_glu_f32", [_P, _I, _I, _I, _C, _P, _C])
        self._store_kv = _bind(library, "me_store_kv_f32", [_P, _P, _I, _I, _I, _I, _P, _P, _P])
        self._argmax = _bind(library, "me_argmax_logprob_f32", [_P, _I, _I, _I, _P, _P, _C], ctypes.c_int)
        self._decode_step = _bind(library, "me_decode_step_f32", [_P, _P, _C], ctypes.c_int)
        self._prefill_attention = _bind(library, "me_prefill_attention_f32",
                                        [_P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _F, _P, _I, _C], ctypes.c_int)
        self._attention = _bind(library, "me_decode_attention_f32",
                                [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _F, _P, _I, _C], ctypes.c_int)

    @staticmethod
    def accepts(w: torch.Tensor) -> bool:
        """A weight the kernels take once packed (panels.pack): a float32 matrix on the CPU."""
        return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2

    @staticmethod
    def attention_accepts(heads: int, kv_heads: int, head_dim: int) -> bool:
        return heads <= MAX_HEADS and heads % kv_heads == 0 and head_dim % 8 == 0

    def linear(self, x: torch.Tensor, w: Panels, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ bias) (+ residual): x [m, k], w [n, k] as panels, bias [n], residual [m, n]."""
        m, k = x.shape
        if k != w.k:
            raise ValueError(f"x has {k} columns, the weight {w.k}")
        if x.stride(1) != 1:
            x = x.contiguous()
        if bias is not None and bias.stride(0) != 1:
            bias = bias.contiguous()
        if residual is not None and residual.stride(1) != 1:
            residual = residual.contiguous()
        if k == 0:  # an empty sum: what is left is the bias and the residual
            y = torch.zeros(m, w.n, dtype=torch.float32)
            return y.add_(bias if bias is not None else 0).add_(residual if residual is not None else 0)
        y = torch.empty(m, w.n, dtype=torch.float32)
        if self._linear(x.data_ptr(), m, x.stride(0), w.data.data_ptr(), w.n, k,
                        None if bias is None else bias.data_ptr(),
                        None if residual is None else residual.data_ptr(),
                        0 if residual is None else residual.stride(0), y.data_ptr(), w.n, torch.get_num_threads()):
            raise MemoryError("the matmul kernel could not allocate its packed rows of x")
        return y

    def residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: Panels,
                        bias: torch.Tensor | None) -> torch.Tensor:
        """x + a @ w.T (+ bias): the residual add in the kernel's store."""
        return self.linear(a, w, bias, residual=x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """F.rms_norm over the last dimension of x ([m, n], or [m, heads, n] with heads n apart)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        n = x.shape[-1]
        outer = x.shape[0]
        inner = x.shape[1] if x.dim() == 3 else 1
        inner_stride = x.stride(1) if x.dim() == 3 else n
        y = torch.empty(x.shape, dtype=torch.float32)
        self._rms_norm(x.data_ptr(), outer, inner, x.stride(0), inner_stride, n, weight.data_ptr(), eps,
                       y.data_ptr(), inner * n, n, torch.get_num_threads())
        return y

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x ([m, heads, d], heads d floats apart, d <= MAX_ROPE_DIM) in place; tables
        [max_positions, d], every position below max_positions (step_ops checks both)."""
        m, heads, d = x.shape
        self._rope(x.data_ptr(), m, heads, x.stride(0), d, positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
                   torch.get_num_threads())
        return x

    def glu(self, gu: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gu[:, :I]) * gu[:, I:] for gu [m, 2 I] (rows of unit stride); act "silu" or "gelu_tanh"."""
        m, inter = gu.shape[0], gu.shape[1] // 2
        if gu.stride(1) != 1:
            gu = gu.contiguous()
        y = torch.empty(m, inter, dtype=torch.float32)
        self._glu(gu.data_ptr(), m, gu.stride(0), inter, GLU_ACTIVATIONS[activation], y.data_ptr(), torch.get_num_threads())
        return y

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kpool: torch.Tensor,
                 vpool: torch.Tensor) -> None:
        """kpool/vpool (one layer, [blocks, block_size, KVH, D]) at flat slots = k, v ([n, KVH, D],
        heads contiguous); slots int64, each already checked against the pool's size."""
        n, kv_heads, d = k.shape
        if k.stride(2) != 1 or k.stride(1) != d:
            k = k.contiguous()
        if v.stride(2) != 1 or v.stride(1) != d:
            v = v.contiguous()
        self._store_kv(k.data_ptr(), v.data_ptr(), n, k.stride(0), v.stride(0), kv_heads * d, slots.data_ptr(),
                       kpool.data_ptr(), vpool.data_ptr())

    def argmax_logprob(self, x: torch.Tensor) -> tuple[list[int], list[float]] | None:
        """Each row's first largest logit and its log-probability (x [n, vocab] float32); None
        when a row holds a NaN or an infinite maximum (torch's rules then apply)."""
        rows, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        token = torch.empty(rows, dtype=torch.int64)
        logprob = torch.empty(rows, dtype=torch.float32)
        if self._argmax(x.data_ptr(), rows, n, x.stride(0), token.data_ptr(), logprob.data_ptr(),
                        torch.get_num_threads()) != 0:
            return None
        return token.tolist(), logprob.tolist()

    def decode_attention(self, q: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, tables: torch.Tensor,
                         lo: torch.Tensor, hi: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """out [R, H * D] = attention of q [R, H, D] over keys lo[r]..hi[r]-1 of row r, read from
        one layer's pool ([blocks, block_size, KVH, D]) through tables ([R, width] int32)."""
        rows, heads, d = q.shape
        bs, kv_heads = kpool.shape[1], kpool.shape[2]
        status = self._attention(q.data_ptr(), rows, q.stride(0), heads, kv_heads, d, kpool.data_ptr(),
                                 vpool.data_ptr(), bs, tables.data_ptr(), tables.stride(0), lo.data_ptr(),
                                 hi.data_ptr(), scale, out.data_ptr(), out.stride(0), torch.get_num_threads())
        if status != 0:
            raise MemoryError("the decode attention kernel could not allocate its score buffer")

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                          out: torch.Tensor) -> None:
        """out = causal attention of `count` equal prompts (consecutive rows) over themselves:
        q [rows, heads, d], k and v [rows, kv_heads, d] (heads d floats apart, rows of any
        stride), out [rows, heads, d] likewise; heads a multiple of kv_heads."""
        rows, heads, d = q.shape
        kv_heads = k.shape[1]
        for t in (q, k, v, out):
            if t.stride(2) != 1 or t.stride(1) != d:
                raise ValueError("q, k, v and out need heads of d contiguous floats")
        status = self._prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), count, rows // count, q.stride(0),
                                         k.stride(0), v.stride(0), heads, kv_heads, d, scale, out.data_ptr(),
                                         out.stride(0), torch.get_num_threads())
        if status:
            raise MemoryError("the prefill attention kernel could not allocate its scratch")

    def decode_step(self, model: ctypes.Structure, step: ctypes.Structure) -> int:
        """me_decode_step_f32 (step.py's DecoderSpec and StepSpec): 0, or step.OUT_OF_RANGE
        when an index was out of range (nothing written); raises on the other failures."""
        status = self._decode_step(ctypes.addressof(model), ctypes.addressof(step), torch.get_num_threads())
        if status == -1:
            raise MemoryError("the decode step kernel could not allocate its scratch buffers")
        if status == -2:
            raise ValueError("the decode step kernel does not take this model's shape")
        return status


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels, built or loaded once per process; None (logged) where they cannot be."""
    try:
        path = build_library()
        kernels = CpuKernels(load_library(path))
    except KernelsUnavailable as e:
        log.warning("float32 CPU kernels unavailable, decode steps stay with torch's ops: %s", e)
        return None
    log.info("float32 CPU kernels loaded from %s", path)
    return kernels
