"""The attention kernels' wrappers (paged_attention.c, prefill_attention.c): the new tokens'
K and V stored into the pool, decode rows attending through the block tables, fresh prompts
over themselves. CpuKernels inherits them; each checks what its C function assumes."""

from __future__ import annotations

import ctypes

import torch

from executors.cpu_kernels.calls import C_FLOAT as _F
from executors.cpu_kernels.calls import C_INT as _C
from executors.cpu_kernels.calls import C_INT64 as _I
from executors.cpu_kernels.calls import C_PTR as _P
from executors.cpu_kernels.calls import F32, I32, I64, bind, refused

MAX_HEADS = 256  # query heads the attention kernel takes (paged_attention.c)


class AttentionCalls:
    """The attention half of CpuKernels' bindings."""

    def bind_attention(self, library: ctypes.CDLL) -> None:
        self._store_kv = bind(library, "me_store_kv_f32", [_P, _P, _I, _I, _I, _I, _P, _P, _P])
        self._prefill_attention = bind(library, "me_prefill_attention_f32",
                                       [_P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _F, _F, _P, _P, _I, _C],
                                       ctypes.c_int)
        self._attention = bind(library, "me_decode_attention_f32",
                               [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _F, _F, _P, _P, _I, _C],
                               ctypes.c_int)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kpool: torch.Tensor,
                 vpool: torch.Tensor) -> None:
        """kpool/vpool (one layer, [blocks, block_size, KVH, D], contiguous) at flat slots = k, v
        ([n, KVH, D]); slots int64 [n], each already checked against the pool's size."""
        if k.dtype is not F32 or k.ndim != 3 or not k.is_cpu:
            raise refused("store_kv", "k", k, "a float32 CPU tensor [n, kv_heads, d]", F32)
        n, kv_heads, d = k.shape
        if v.dtype is not F32 or v.shape != k.shape or not v.is_cpu:
            raise refused("store_kv", "v", v, f"a float32 CPU tensor of k's shape {tuple(k.shape)}", F32)
        if slots.dtype is not I64 or slots.shape != (n,) or not slots.is_cpu:
            raise refused("store_kv", "slots", slots, f"an int64 CPU vector [n] = [{n}]", I64)
        if slots.stride(0) != 1:
            slots = slots.contiguous()
        if (kpool.dtype is not F32 or kpool.ndim != 4 or kpool.shape[2:] != (kv_heads, d) or not kpool.is_cpu
                or not kpool.is_contiguous()):
            raise refused("store_kv", "kpool", kpool,
                           f"a contiguous float32 CPU pool [blocks, block_size, {kv_heads}, {d}]", F32)
        if vpool.dtype is not F32 or vpool.shape != kpool.shape or not vpool.is_cpu or not vpool.is_contiguous():
            raise refused("store_kv", "vpool", vpool, f"a contiguous float32 CPU pool of kpool's shape "
                           f"{tuple(kpool.shape)}", F32)
        if k.stride(2) != 1 or k.stride(1) != d:
            k = k.contiguous()
        if v.stride(2) != 1 or v.stride(1) != d:
            v = v.contiguous()
        self._store_kv(k.data_ptr(), v.data_ptr(), n, k.stride(0), v.stride(0), kv_heads * d, slots.data_ptr(),
                       kpool.data_ptr(), vpool.data_ptr())

    def decode_attention(self, q: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, tables: torch.Tensor,
                         lo: torch.Tensor, hi: torch.Tensor, scale: float, out: torch.Tensor,
                         softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        """out [R, H * D] = attention of q [R, H, D] (heads D floats apart) over keys lo[r]..hi[r]-1
        of row r, read from one layer's pool ([blocks, block_size, KVH, D], contiguous) through
        tables ([R, width] int32, rows of unit stride); lo and hi int32 [R]; softcap: Gemma 2's
        cap of the scaled scores; sinks: GPT-OSS's logit per query head ([H] float32), a key
        without a value each head's softmax also normalises over. The blocks those keys fall in, and the bounds, are the
        caller's to check against the pool and the tables."""
        if softcap is not None and not softcap > 0:
            raise ValueError(f"CpuKernels.decode_attention: softcap must be positive or None, got {softcap}")
        if q.dtype is not F32 or q.ndim != 3 or not q.is_cpu:
            raise refused("decode_attention", "q", q, "a float32 CPU tensor [rows, heads, d]", F32)
        rows, heads, d = q.shape
        sq = q.stride()
        if sq[2] != 1 or (sq[1] != d and heads > 1):
            raise refused("decode_attention", "q", q, "heads of d contiguous floats")
        if (kpool.dtype is not F32 or kpool.ndim != 4 or kpool.shape[3] != d or not kpool.is_cpu
                or not kpool.is_contiguous()):
            raise refused("decode_attention", "kpool", kpool,
                           f"a contiguous float32 CPU pool [blocks, block_size, kv_heads, {d}]", F32)
        if vpool.dtype is not F32 or vpool.shape != kpool.shape or not vpool.is_cpu or not vpool.is_contiguous():
            raise refused("decode_attention", "vpool", vpool,
                           f"a contiguous float32 CPU pool of kpool's shape {tuple(kpool.shape)}", F32)
        bs, kv_heads = kpool.shape[1], kpool.shape[2]
        if kv_heads < 1 or heads > MAX_HEADS or heads % kv_heads or d % 8:
            raise ValueError(f"CpuKernels.decode_attention: q's {heads} heads of {d} over kpool's {kv_heads} KV heads: "
                             f"at most {MAX_HEADS} heads, a multiple of the KV heads, d a multiple of 8")
        if tables.dtype is not I32 or tables.ndim != 2 or tables.shape[0] != rows or not tables.is_cpu:
            raise refused("decode_attention", "tables", tables, f"an int32 CPU matrix [rows = {rows}, width]", I32)
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        for name, bound in (("lo", lo), ("hi", hi)):
            if bound.dtype is not I32 or bound.shape != (rows,) or not bound.is_cpu or not bound.is_contiguous():
                raise refused("decode_attention", name, bound, f"a contiguous int32 CPU vector [rows] = [{rows}]",
                               I32)
        if out.dtype is not F32 or out.shape != (rows, heads * d) or not out.is_cpu or out.stride(1) != 1:
            raise refused("decode_attention", "out", out,
                           f"a float32 CPU matrix [rows, heads * d] = [{rows}, {heads * d}], rows of unit stride", F32)
        sinks = _sinks("decode_attention", sinks, heads)
        status = self._attention(q.data_ptr(), rows, sq[0], heads, kv_heads, d, kpool.data_ptr(),
                                 vpool.data_ptr(), bs, tables.data_ptr(), tables.stride(0), lo.data_ptr(),
                                 hi.data_ptr(), scale, softcap or 0.0, _pointer(sinks), out.data_ptr(),
                                 out.stride(0), torch.get_num_threads())
        if status != 0:
            raise MemoryError("the decode attention kernel could not allocate its score buffer")

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                          out: torch.Tensor, softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        """out = causal attention of `count` equal prompts (consecutive rows) over themselves:
        q [rows, heads, d], k and v [rows, kv_heads, d] (heads d floats apart, rows of any
        stride), out [rows, heads, d] likewise; heads a multiple of kv_heads, rows of count;
        softcap: Gemma 2's cap of the scaled scores; sinks: GPT-OSS's logit per query head
        ([heads] float32), which each softmax also normalises over."""
        if softcap is not None and not softcap > 0:
            raise ValueError(f"CpuKernels.prefill_attention: softcap must be positive or None, got {softcap}")
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.dtype is not F32 or t.ndim != 3 or not t.is_cpu:
                raise refused("prefill_attention", name, t, "a float32 CPU tensor [rows, heads, d]", F32)
        rows, heads, d = q.shape
        kv_heads = k.shape[1]
        if k.shape[0] != rows or k.shape[2] != d or kv_heads < 1 or heads % kv_heads:
            raise refused("prefill_attention", "k", k, f"[rows = {rows}, kv_heads, d = {d}], kv_heads dividing "
                           f"the {heads} heads")
        if v.shape != k.shape:
            raise refused("prefill_attention", "v", v, f"of k's shape {tuple(k.shape)}")
        if out.shape != q.shape:
            raise refused("prefill_attention", "out", out, f"of q's shape {tuple(q.shape)}")
        if not isinstance(count, int) or count < 1 or rows % count:
            raise ValueError(f"CpuKernels.prefill_attention: count must be a positive int dividing the {rows} rows, "
                             f"not {count!r}")
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.stride(2) != 1 or t.stride(1) != d:
                raise ValueError(f"CpuKernels.prefill_attention: q, k, v and out need heads of d contiguous floats; "
                                 f"{name} has strides {t.stride()}")
        sinks = _sinks("prefill_attention", sinks, heads)
        status = self._prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), count, rows // count, q.stride(0),
                                         k.stride(0), v.stride(0), heads, kv_heads, d, scale, softcap or 0.0,
                                         _pointer(sinks), out.data_ptr(), out.stride(0), torch.get_num_threads())
        if status:
            raise MemoryError("the prefill attention kernel could not allocate its scratch")


def _sinks(fn: str, sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The sinks as the C side reads them: heads contiguous floats (or None)."""
    if sinks is None:
        return None
    if sinks.dtype is not F32 or sinks.shape != (heads,) or not sinks.is_cpu:
        raise refused(fn, "sinks", sinks, f"a float32 CPU vector [heads] = [{heads}]", F32)
    return sinks.contiguous()


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
