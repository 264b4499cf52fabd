"""The float32 CPU kernels (executors/cpu_kernels) against torch's ops, shape by shape.

Odd sizes on purpose: outputs not a multiple of the 6-column weight panel (nor of the dot
products' groups of two or three panels), row counts not a multiple of the 8-row x panel or
16-row tile, inputs not a multiple of 8 floats (the masked tails), strided
views (a fused projection's slices, the lm_head as panels of a row slice of the
embedding), windows and fragmented block tables. The kernels must build on this machine
whenever it has a C compiler and AVX2 + FMA: a silent fallback to torch would let every
other test pass without running them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executors.cpu_kernels import build as kernel_build
from executors.cpu_kernels import cpu_kernels
from executors.cpu_kernels.panels import PANEL, pack
from executors.models.layers import apply_rope

try:
    kernel_build.check_cpu()
    kernel_build.compiler()
    BUILDABLE = None
except kernel_build.KernelsUnavailable as e:
    BUILDABLE = str(e)


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels()
    if BUILDABLE is None:
        assert k is not None, "a C compiler and AVX2 are here, yet the kernels did not build (see the log)"
    else:
        assert k is None  # and the model falls back; tests/models/test_cpu_layout.py covers that path
        pytest.skip(f"the CPU kernels cannot be built on this machine: {BUILDABLE}")
    return k


def test_build_into_an_empty_cache_and_reuse_it(tmp_path):
    if BUILDABLE is not None:
        with pytest.raises(kernel_build.KernelsUnavailable):
            kernel_build.build_library(tmp_path)
        return
    first = kernel_build.build_library(tmp_path)
    assert first.exists() and first.parent.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert kernel_build.build_library(tmp_path) == first and first.stat().st_mtime_ns == mtime  # cached, not rebuilt
    assert not list(first.parent.glob("*.partial"))


def test_no_compiler_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
    with pytest.raises(kernel_build.KernelsUnavailable, match="no C compiler"):
        kernel_build.compiler()


# Rows: the dot products of 1..6 rows (three panels at a time to 4, two past it); with AVX2
# one x panel against two weight panels (7, 8), 16-row tiles and an 8-row one to end (13, 32,
# 40); with AVX-512 one 16-row x panel against up to four weight panels (7-16), 32-row tiles
# and a 16-row one to end (17, 33, 40, 64); past a chunk of packed rows (300 x 1537: chunks
# of 48; weight_panel.h).
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 32, 33, 40, 64, 300])
@pytest.mark.parametrize("n,k", [(8, 8), (13, 20), (960, 576), (100, 1537), (5, 3)])  # a part-filled last panel
def test_linear_matches_torch(kernels, isa, m, n, k):
    g = torch.Generator().manual_seed(n * 31 + k + m)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
    bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    p = pack(w)
    torch.testing.assert_close(kernels.linear(x, p), F.linear(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.linear(x, p, bias), F.linear(x, w, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.residual_linear(residual, x, p, bias), residual + F.linear(x, w, bias),
                               atol=1e-5, rtol=1e-5)


def test_a_row_does_not_depend_on_its_batch_mates(kernels, isa):
    """Every path (dot products, 8 x 12 and 16 x 6 tiles, AVX-512's 16 x 24 and 32 x 12 ones,
    chunks) sums each output as one FMA chain over k in order: a row's result is the same bit
    for bit whatever the step's size, so greedy tokens cannot change with the batch."""
    g = torch.Generator().manual_seed(6)
    n, k = 100, 1537
    w, bias = torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)
    p, x = pack(w), torch.randn(300, k, generator=g)
    alone = kernels.linear(x[:1], p, bias)
    for m in (2, 4, 5, 6, 7, 8, 9, 16, 17, 40, 64, 300):
        assert torch.equal(kernels.linear(x[:m], p, bias)[:1], alone), m
    every = kernels.linear(x, p, bias)
    for m in (3, 6, 8, 13, 64):
        assert torch.equal(kernels.linear(x[:m], p, bias), every[:m]), m


@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (6, 64), (7, 576), (23, 600), (24, 33), (25, 1536), (97, 96)])
def test_avx512_tiles_compute_exactly_the_avx2_ones(kernels, n, k):
    """The same FMA chains on either instruction set: AVX-512 and AVX2 give the same bits, for
    every tile shape and tail (n past a multiple of 6, 12 and 24; rows past 16 and 32; chunks
    of packed rows at k = 576 and 1536), with and without bias and residual."""
    if kernels.isa(True) != "avx512":
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(n * 7 + k)
    w, bias = pack(torch.randn(n, k, generator=g)), torch.randn(n, generator=g)
    try:
        for m in (7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 65, 161, 200):
            x, residual = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
            for b, r in ((None, None), (bias, None), (bias, residual), (None, residual)):
                kernels.isa(False)
                slow = kernels.linear(x, w, b, r)
                kernels.isa(True)
                assert torch.equal(kernels.linear(x, w, b, r), slow), (m, b is None, r is None)
    finally:
        kernels.isa(True)


def test_fma_flops_counts_what_it_ran(kernels):
    """The bench's FMA peak (fma_rate.c): 2 x lanes x 12 chains a step on each thread, the lanes
    those of the instruction set the tiles run on."""
    threads = torch.get_num_threads()
    try:
        for avx512, lanes in ((False, 8), (True, 16)):
            if kernels.isa(avx512) == ("avx512" if avx512 else "avx2"):
                assert kernels.fma_flops(1000) == 2 * lanes * 12 * 1000 * threads
        assert kernels.fma_flops(0) == 0
        with pytest.raises(ValueError, match="steps"):
            kernels.fma_flops(-1)
    finally:
        kernels.isa(True)


def test_linear_of_no_rows_or_an_empty_inner_dimension(kernels):
    g = torch.Generator().manual_seed(7)
    w, bias = torch.randn(13, 20, generator=g), torch.randn(13, generator=g)
    assert kernels.linear(torch.randn(0, 20), pack(w), bias).shape == (0, 13)
    residual = torch.randn(3, 13, generator=g)
    torch.testing.assert_close(kernels.residual_linear(residual, torch.randn(3, 0), pack(torch.randn(13, 0)), bias),
                               residual + bias)


def test_panels_round_trip_and_views():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 20, generator=g)
    p = pack(w)
    assert PANEL == 6 and p.data.shape == (7, 20, 6) and p.data.is_contiguous()
    assert torch.equal(p.data[6, :, 1:], torch.zeros(20, 5)), "the last panel is zero past n"
    assert torch.equal(p.unpack(), w) and torch.equal(p.unpack(5, 33), w[5:33])
    view = p.rows(12, 30)
    assert view.data.data_ptr() == p.data[2].data_ptr() and torch.equal(view.unpack(), w[12:30])
    ids = torch.tensor([0, 36, 17, 5])
    assert torch.equal(p.embedding(ids), w[ids])
    with pytest.raises(ValueError, match="multiple of 6"):
        p.rows(10, 20)


def test_linear_reads_strided_inputs_and_panel_views(kernels):
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(50, 24, generator=g)
    head = pack(embed).rows(18, 43)  # a tensor-parallel rank's rows of a tied embedding, no copy
    fused = torch.randn(3, 40, generator=g)
    x = fused[:, 8:32]  # a slice of a fused output: rows 40 floats apart
    assert kernels.accepts(embed.t())  # any float32 matrix packs
    torch.testing.assert_close(kernels.linear(x, head), F.linear(x, embed[18:43]), atol=1e-5, rtol=1e-5)
    many = torch.randn(9, 40, generator=g)[:, 8:32]
    torch.testing.assert_close(kernels.linear(many, head), F.linear(many, embed[18:43]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="columns"):
        kernels.linear(torch.randn(2, 23), head)


@pytest.mark.parametrize("shape", [(1, 576), (3, 20), (2, 5, 32)])
def test_rms_norm_matches_torch(kernels, shape):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (shape[-1],), w, 1e-6),
                               atol=1e-5, rtol=1e-5)


def test_rms_norm_of_head_slices(kernels):
    """q/k norms read [m, heads, d] views of a fused qkv output."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 7 * 16, generator=g)
    q = qkv[:, :4 * 16].view(2, 4, 16)
    w = torch.randn(16, generator=g)
    torch.testing.assert_close(kernels.rms_norm(q, w, 1e-6), F.rms_norm(q, (16,), w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [3, 400])  # a decode step's rows; a prefill's, threaded
def test_rope_matches_apply_rope(kernels, tokens):
    g = torch.Generator().manual_seed(4)
    d = 32
    positions = torch.tensor([0, 5, 17]) if tokens == 3 else torch.randint(0, 64, (tokens,), generator=g)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(d // 2, generator=g))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    sin[:, :d // 2].neg_()
    qkv = torch.randn(tokens, 9 * d, generator=g)
    view = qkv[:, :6 * d].view(tokens, 6, d)
    expected = apply_rope(view, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    kernels.rope_(view, positions, cos, sin)
    torch.testing.assert_close(view, expected, atol=1e-6, rtol=1e-6)


def reference_attention(q, kpool, vpool, table, lo, hi, scale):
    bs, kvh, d = kpool.shape[1:]
    slots = [table[p // bs] * bs + p % bs for p in range(lo, hi)]
    k = kpool.reshape(-1, kvh, d)[slots].transpose(0, 1)
    v = vpool.reshape(-1, kvh, d)[slots].transpose(0, 1)
    out = F.scaled_dot_product_attention(q.unsqueeze(1), k, v, enable_gqa=True, scale=scale)
    return out.squeeze(1).flatten()


@pytest.mark.parametrize("bs", [4, 16])  # runs of 4 slots; full runs of 8 and a tail run
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 32), (16, 1, 128), (8, 2, 8)])
def test_decode_attention_matches_sdpa(kernels, heads, kv_heads, d, bs):
    g = torch.Generator().manual_seed(heads * d)
    blocks = 40
    kpool, vpool = torch.randn(blocks, bs, kv_heads, d, generator=g), torch.randn(blocks, bs, kv_heads, d, generator=g)
    # Row 0: contiguous blocks; row 1: fragmented; row 2: one key; row 3: a window (keys 9..22).
    bounds = [(0, 29), (0, 17), (0, 1), (9, 23)]
    tables = torch.zeros(4, 8, dtype=torch.int32)
    tables[0, :8] = torch.arange(3, 11)
    tables[1, :5] = torch.tensor([30, 2, 17, 5, 39])
    tables[2, 0] = 12
    tables[3, 2:6] = torch.tensor([20, 21, 35, 1])  # 4-slot blocks 0-1 fell out of the window: never read
    lo = torch.tensor([b[0] for b in bounds], dtype=torch.int32)
    hi = torch.tensor([b[1] for b in bounds], dtype=torch.int32)
    q = torch.randn(4, heads, d, generator=g) * 2
    out = torch.full((4, heads * d), float("nan"))
    kernels.decode_attention(q, kpool, vpool, tables, lo, hi, 0.3, out)
    for r, (a, b) in enumerate(bounds):
        expected = reference_attention(q[r], kpool, vpool, tables[r].tolist(), a, b, 0.3)
        torch.testing.assert_close(out[r], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", [4, 16])
def test_decode_attention_caps_the_scores_as_gemma2_does(kernels, bs):
    """softcap: scaled scores s -> softcap * tanh(s / softcap) before the softmax, against an
    explicit computation; a cap that bites (scores of +-10 under a cap of 3) on windowed,
    fragmented and one-key rows."""
    g = torch.Generator().manual_seed(bs)
    heads, d, cap, scale = 8, 32, 3.0, 0.5
    bounds = [(0, 29), (0, 1), (9, 23)]
    q, kpool, vpool, tables, lo, hi = random_paged_rows(g, bounds, heads, 2, d, bs)
    out = torch.full((3, heads * d), float("nan"))
    kernels.decode_attention(q, kpool, vpool, tables, lo, hi, scale, out, softcap=cap)
    uncapped = torch.empty_like(out)
    kernels.decode_attention(q, kpool, vpool, tables, lo, hi, scale, uncapped)
    for r, (a, b) in enumerate(bounds):
        scores, v = row_scores(q[r], kpool, vpool, tables[r], a, b, scale)
        weights = torch.softmax(torch.tanh(scores / cap) * cap, dim=-1)
        torch.testing.assert_close(out[r], (weights @ v).flatten(), atol=1e-5, rtol=1e-5)
        if b - a > 1:
            assert (out[r] - uncapped[r]).abs().max() > 1e-2  # the cap changed the answer
    with pytest.raises(ValueError, match="softcap must be positive"):
        kernels.decode_attention(q, kpool, vpool, tables, lo, hi, scale, out, softcap=0.0)


def random_paged_rows(g: torch.Generator, bounds: list[tuple[int, int]], heads: int, kv_heads: int, d: int,
                      bs: int, blocks: int = 40):
    """A random pool, a query and a random table of 8 blocks per row of `bounds` (its keys
    lo..hi - 1): (q, kpool, vpool, tables, lo, hi), for checks against explicit scores."""
    kpool, vpool = torch.randn(blocks, bs, kv_heads, d, generator=g), torch.randn(blocks, bs, kv_heads, d, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:8] for _ in bounds]).to(torch.int32)
    lo = torch.tensor([b[0] for b in bounds], dtype=torch.int32)
    hi = torch.tensor([b[1] for b in bounds], dtype=torch.int32)
    return torch.randn(len(bounds), heads, d, generator=g), kpool, vpool, tables, lo, hi


def row_scores(q: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, table: torch.Tensor, lo: int, hi: int,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's scaled scores [H, 1, L] over its keys lo..hi - 1, and their values [H, L, D]
    (each query head against its KV head's), gathered through its block table."""
    bs, kv_heads, d = kpool.shape[1:]
    group = q.shape[0] // kv_heads
    slots = [int(table[p // bs]) * bs + p % bs for p in range(lo, hi)]
    k = kpool.reshape(-1, kv_heads, d)[slots].repeat_interleave(group, 1).transpose(0, 1)
    v = vpool.reshape(-1, kv_heads, d)[slots].repeat_interleave(group, 1).transpose(0, 1)
    return (q.unsqueeze(1) @ k.transpose(1, 2)) * scale, v


def prompt_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: slice):
    """One prompt's rows as heads: q [H, n, D], and k, v repeated for each query head of their KV head."""
    group = q.shape[1] // k.shape[1]
    return (q[rows].transpose(0, 1), *(t[rows].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v)))


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's softmax: each head's scores [H, rows, L] and its sink logit, the sink's share dropped."""
    sink = sinks.view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


@pytest.mark.parametrize("rows", [3, 8])  # few rows: a task per KV head (the sinks offset by it); many: per row
def test_decode_attention_normalises_over_gpt_oss_sinks(kernels, rows):
    """sinks: one logit per query head that each softmax normalises over, with no value: against
    an explicit computation, on windowed, fragmented and one-key rows; sinks far above every
    score (near-zero outputs) and far below (none) included; they bite."""
    g = torch.Generator().manual_seed(rows)
    heads, d, scale = 8, 32, 0.5
    bounds = [(0, 29), (0, 1), (9, 23), (0, 12), (3, 30), (0, 2), (5, 6), (0, 31)][:rows]
    q, kpool, vpool, tables, lo, hi = random_paged_rows(g, bounds, heads, 2, d, 4)
    sinks = torch.randn(heads, generator=g) * 2
    sinks[0], sinks[5] = 80.0, -80.0
    out = torch.full((rows, heads * d), float("nan"))
    kernels.decode_attention(q, kpool, vpool, tables, lo, hi, scale, out, sinks=sinks)
    plain = torch.empty_like(out)
    kernels.decode_attention(q, kpool, vpool, tables, lo, hi, scale, plain)
    for r, (a, b) in enumerate(bounds):
        scores, v = row_scores(q[r], kpool, vpool, tables[r], a, b, scale)
        torch.testing.assert_close(out[r], (softmax_with_sinks(scores, sinks) @ v).flatten(), atol=1e-5, rtol=1e-5)
    assert (out - plain).abs().max() > 1e-2
    with pytest.raises(ValueError, match="sinks must be a float32 CPU vector"):
        kernels.decode_attention(q, kpool, vpool, tables, lo, hi, scale, out, sinks=sinks[:4])


@pytest.mark.parametrize("heads,d,keys", [(16, 576, 300), (17, 64, 2000)])  # DeepSeek's latent rows; 8 and 9 heads
def test_one_row_of_one_kv_head_splits_its_query_heads_over_the_threads(kernels, heads, d, keys):
    """A decode row of a model with one KV head (DeepSeek's latent rows, MQA) is shared out by
    query heads (17 heads: 8 and 9), each share with its own queries, outputs and sinks; long
    enough a context that the threads take it."""
    g = torch.Generator().manual_seed(keys)
    bs, blocks = 16, 256
    kpool, vpool = torch.randn(blocks, bs, 1, d, generator=g), torch.randn(blocks, bs, 1, d, generator=g)
    tables = torch.randperm(blocks, generator=g).to(torch.int32).view(1, -1)
    lo, hi = torch.tensor([0], dtype=torch.int32), torch.tensor([keys], dtype=torch.int32)
    q = torch.randn(1, heads, d, generator=g) * 0.1
    sinks = torch.randn(heads, generator=g) * 3
    out = torch.full((1, heads * d), float("nan"))
    kernels.decode_attention(q, kpool, vpool, tables, lo, hi, 0.2, out, sinks=sinks)
    scores, v = row_scores(q[0], kpool, vpool, tables[0], 0, keys, 0.2)
    torch.testing.assert_close(out[0], (softmax_with_sinks(scores, sinks) @ v).flatten(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("count,n", [(1, 37), (2, 13)])
def test_prefill_attention_normalises_over_gpt_oss_sinks(kernels, count, n):
    """sinks on a prompt's causal attention, against an explicit computation; they bite."""
    g = torch.Generator().manual_seed(n + 100)
    heads, kv_heads, d, scale = 8, 2, 32, 0.5
    q = torch.randn(count * n, heads, d, generator=g)
    k, v = torch.randn(count * n, kv_heads, d, generator=g), torch.randn(count * n, kv_heads, d, generator=g)
    sinks = torch.randn(heads, generator=g) * 2
    sinks[1] = 60.0
    out, plain = torch.full_like(q, float("nan")), torch.empty_like(q)
    kernels.prefill_attention(q, k, v, count, scale, out, sinks=sinks)
    kernels.prefill_attention(q, k, v, count, scale, plain)
    for c in range(count):
        rows = slice(c * n, (c + 1) * n)
        qh, kh, vh = prompt_heads(q, k, v, rows)
        scores = (qh @ kh.transpose(1, 2) * scale).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(),
                                                              float("-inf"))
        expected = (softmax_with_sinks(scores, sinks) @ vh).transpose(0, 1)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
    assert (out - plain).abs().max() > 1e-2


@pytest.mark.parametrize("count,n,heads,kv_heads,d", [
    (1, 128, 9, 3, 64),  # SmolLM2's prefill: 22 tiles of 6 tokens, 8 key panels
    (3, 37, 4, 2, 24),  # several prompts; a tail tile and tail key panel; d not a multiple of 16
    (2, 2, 8, 1, 8),  # all query heads over one KV head
    (1, 300, 2, 2, 128),  # threaded over tiles of very different lengths
])
def test_prefill_attention_matches_causal_sdpa(kernels, count, n, heads, kv_heads, d):
    g = torch.Generator().manual_seed(count * n + d)
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(count * n, width + 5, generator=g) * 2  # rows wider than the heads: strided views
    q = qkv[:, :heads * d].view(-1, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(-1, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:width].view(-1, kv_heads, d)
    out = torch.full((count * n, heads, d), float("nan"))
    kernels.prefill_attention(q, k, v, count, 0.3, out)

    def by_prompt(t):
        return t.reshape(count, n, t.shape[1], d).transpose(1, 2)

    expected = F.scaled_dot_product_attention(by_prompt(q), by_prompt(k), by_prompt(v), is_causal=True,
                                              enable_gqa=True, scale=0.3).transpose(1, 2).reshape(-1, heads, d)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("count,n", [(1, 37), (2, 13)])
def test_prefill_attention_caps_the_scores_as_gemma2_does(kernels, count, n):
    """softcap on a prompt's causal attention, against an explicit computation; it bites."""
    g = torch.Generator().manual_seed(n)
    heads, kv_heads, d, cap, scale = 8, 2, 32, 3.0, 0.5
    q = torch.randn(count * n, heads, d, generator=g)
    k, v = torch.randn(count * n, kv_heads, d, generator=g), torch.randn(count * n, kv_heads, d, generator=g)
    out, uncapped = torch.full_like(q, float("nan")), torch.empty_like(q)
    kernels.prefill_attention(q, k, v, count, scale, out, softcap=cap)
    kernels.prefill_attention(q, k, v, count, scale, uncapped)
    for c in range(count):
        rows = slice(c * n, (c + 1) * n)
        qh, kh, vh = prompt_heads(q, k, v, rows)
        scores = torch.tanh(qh @ kh.transpose(1, 2) * scale / cap) * cap
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        expected = (torch.softmax(scores, dim=-1) @ vh).transpose(0, 1)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
    assert (out - uncapped).abs().max() > 1e-2
    with pytest.raises(ValueError, match="softcap must be positive"):
        kernels.prefill_attention(q, k, v, count, scale, out, softcap=-1.0)


def test_prefill_attention_refuses_heads_that_are_not_contiguous(kernels):
    q = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="heads of d contiguous floats"):
        kernels.prefill_attention(q.transpose(0, 1).contiguous().transpose(0, 1), q, q, 1, 0.25, torch.empty(4, 2, 16))


@pytest.mark.parametrize("rows,inter", [(3, 37), (70, 1001)])  # a decode step's; a prefill's, threaded
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glu_matches_torch(kernels, activation, rows, inter):
    from executors.models.layers import activation as torch_activation

    g = torch.Generator().manual_seed(5)
    gu = torch.randn(rows, 2 * inter, generator=g) * 4
    gu[0, :5] = torch.tensor([-100.0, -30.0, 0.0, 30.0, 100.0])  # the exp's clamps
    expected = torch_activation(activation)(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(kernels.glu(gu, activation), expected, atol=1e-5, rtol=1e-5)


def test_store_kv_writes_the_slots_and_nothing_else(kernels):
    g = torch.Generator().manual_seed(6)
    kpool, vpool = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    qkv = torch.randn(3, 4 * 8 + 2 * 2 * 8, generator=g)
    k, v = qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)  # strided views of a fused output
    slots = torch.tensor([5, 22, 9])
    kernels.store_kv(k, v, slots, kpool, vpool)
    expected_k, expected_v = torch.zeros(24, 2, 8), torch.zeros(24, 2, 8)
    expected_k[slots], expected_v[slots] = k, v
    assert torch.equal(kpool.view(24, 2, 8), expected_k) and torch.equal(vpool.view(24, 2, 8), expected_v)


def test_argmax_logprob_matches_torch(kernels):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 1001, generator=g) * 5
    x[1, 700] = x[1, 3] = x[1].max() + 1  # a tie: the first index wins, as torch.argmax's
    x[2, 1000] = 50.0  # the largest in the scalar tail
    tokens, logprobs = kernels.argmax_logprob(x)
    assert tokens == torch.argmax(x, -1).tolist() and tokens[1] == 3 and tokens[2] == 1000
    expected = torch.log_softmax(x, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=1e-5)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[3, 10] = bad
        assert kernels.argmax_logprob(y) is None  # torch's rules apply then


def test_argmax_logprob_of_a_batch_threaded_over_rows(kernels):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 49152, generator=g) * 3  # a batch's logits: rows shared out over the threads
    tokens, logprobs = kernels.argmax_logprob(x)
    assert tokens == torch.argmax(x, -1).tolist()
    expected = torch.log_softmax(x, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=1e-5)
    x[11, 5] = float("nan")  # in the last thread's rows
    assert kernels.argmax_logprob(x) is None


def test_a_model_computes_the_same_with_and_without_the_kernels(kernels):
    """Prefill, then decode steps of 1, 3, 4 and 6 rows (one panel tile, and a tile with a
    tail), against the same executor with --no-cpu-kernels (torch's ops, oneDNN's packed
    weights at 6 rows)."""
    import asyncio

    from executors.llm import LlmExecutor, LlmExecutorConfig
    from executors.types import DecodeInput, PrefillInput
    from tests.models.test_cpu_paths import tiny_model

    runs = {}
    for on in (True, False):
        model = tiny_model("qwen3")
        model.use_cpu_kernels = on
        ex = LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/qwen3", num_blocks=64, block_size=4,
                                           cpu_kernels=on), model)
        assert (ex.model.cpu_kernels is not None) == on
        loop = asyncio.new_event_loop()
        try:
            outs = loop.run_until_complete(ex.batch_prefill([PrefillInput(input_ids=[1 + i, 7, 3 * i, 9, 11])
                                                             for i in range(6)]))
            logits = [o.logits.logits.array for o in outs]
            for batch in (1, 3, 4, 6):
                steps = loop.run_until_complete(ex.batch_decode(
                    [DecodeInput(token_id=5 + b, kv_cache=o.kv_cache) for b, o in enumerate(outs[:batch])]))
                logits += [s.logits.logits.array for s in steps]
                outs = [*steps, *outs[batch:]]
            runs[on] = logits
        finally:
            ex.worker.close()
            loop.close()
    for a, b in zip(runs[True], runs[False], strict=True):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=1e-5, rtol=0)


def test_rms_norm_of_a_view_whose_rows_are_not_contiguous(kernels):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 16, 4, generator=g).transpose(1, 2)  # [2, 4, 16], last dimension 4 floats apart
    w = torch.randn(16, generator=g)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6), atol=1e-5, rtol=1e-5)


def good_arguments() -> dict[str, dict]:
    """Arguments each wrapper takes, by name: the baseline the refusals below change one of."""
    g = torch.Generator().manual_seed(10)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "linear": {"x": randn(3, 20), "w": pack(randn(13, 20)), "bias": randn(13), "residual": randn(3, 13)},
        "rms_norm": {"x": randn(3, 16), "weight": randn(16), "eps": 1e-6},
        "rope_": {"x": randn(3, 2, 8), "positions": torch.tensor([0, 1, 3]), "cos": randn(4, 8),
                  "signed_sin": randn(4, 8)},
        "glu": {"gu": randn(3, 10), "activation": "silu"},
        "store_kv": {"k": randn(3, 2, 8), "v": randn(3, 2, 8), "slots": torch.tensor([0, 5, 9]),
                     "kpool": torch.zeros(4, 4, 2, 8), "vpool": torch.zeros(4, 4, 2, 8)},
        "argmax_logprob": {"x": randn(2, 50)},
        "decode_attention": {"q": randn(2, 4, 8), "kpool": randn(4, 4, 2, 8), "vpool": randn(4, 4, 2, 8),
                             "tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                             "lo": torch.tensor([0, 1], dtype=torch.int32),
                             "hi": torch.tensor([5, 6], dtype=torch.int32), "scale": 0.3, "out": torch.empty(2, 32)},
        "prefill_attention": {"q": randn(6, 4, 8), "k": randn(6, 2, 8), "v": randn(6, 2, 8), "count": 2,
                              "scale": 0.3, "out": torch.empty(6, 4, 8)},
    }


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose last dimension is not of unit stride."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# (wrapper, argument, what it becomes, the error): each wrong in a way its C function would
# have read past a buffer or misread (ASan found several), refused with the argument named.
BAD_ARGUMENTS = [
    ("linear", "x", lambda a: a["x"].double(), TypeError),
    ("linear", "x", lambda a: a["x"][0], ValueError),  # a 1-D row
    ("linear", "x", lambda a: a["x"][:, :19], ValueError),  # columns other than the weight's
    ("linear", "w", lambda a: a["w"].unpack(), TypeError),  # a matrix, not panels
    ("linear", "w", lambda a: a["w"]._replace(data=a["w"].data.double()), TypeError),
    ("linear", "w", lambda a: a["w"]._replace(n=19), ValueError),  # more rows than the panels hold
    ("linear", "w", lambda a: a["w"]._replace(data=_strided(a["w"].data)), ValueError),
    ("linear", "bias", lambda a: a["bias"].half(), TypeError),
    ("linear", "bias", lambda a: a["bias"][:12], ValueError),
    ("linear", "bias", lambda a: a["bias"][None], ValueError),
    ("linear", "residual", lambda a: a["residual"].double(), TypeError),
    ("linear", "residual", lambda a: a["residual"][:2], ValueError),
    ("rms_norm", "x", lambda a: a["x"][0], ValueError),  # 1-D: read as n rows of n floats
    ("rms_norm", "x", lambda a: a["x"].half(), TypeError),
    ("rms_norm", "weight", lambda a: a["weight"][:15], ValueError),
    ("rms_norm", "weight", lambda a: a["weight"].double(), TypeError),
    ("rope_", "x", lambda a: a["x"].double(), TypeError),
    ("rope_", "x", lambda a: a["x"].transpose(0, 1).contiguous().transpose(0, 1), ValueError),  # heads 24 floats apart
    ("rope_", "x", lambda a: a["x"][:, :, :7].contiguous(), ValueError),  # an odd head size
    ("rope_", "x", lambda a: torch.zeros(3, 1, 520), ValueError),  # past the row buffer
    ("rope_", "positions", lambda a: a["positions"].int(), TypeError),
    ("rope_", "positions", lambda a: a["positions"][:2], ValueError),
    ("rope_", "cos", lambda a: a["cos"].double(), TypeError),
    ("rope_", "cos", lambda a: a["cos"][:, :6].contiguous(), ValueError),
    ("rope_", "signed_sin", lambda a: _strided(a["signed_sin"]), ValueError),
    ("rope_", "signed_sin", lambda a: a["signed_sin"][:2], ValueError),
    ("glu", "gu", lambda a: a["gu"].double(), TypeError),
    ("glu", "gu", lambda a: a["gu"][:, :9], ValueError),
    ("glu", "activation", lambda a: "relu", ValueError),
    ("store_kv", "k", lambda a: a["k"].half(), TypeError),
    ("store_kv", "v", lambda a: a["v"][:, :1], ValueError),
    ("store_kv", "slots", lambda a: a["slots"].int(), TypeError),  # C reads int64
    ("store_kv", "slots", lambda a: a["slots"][:2], ValueError),
    ("store_kv", "kpool", lambda a: torch.zeros(4, 4, 1, 8), ValueError),  # slots of another width
    ("store_kv", "kpool", lambda a: a["kpool"].transpose(0, 1), ValueError),
    ("store_kv", "vpool", lambda a: a["vpool"].double(), TypeError),
    ("store_kv", "vpool", lambda a: a["vpool"][:3], ValueError),
    ("argmax_logprob", "x", lambda a: a["x"].double(), TypeError),
    ("argmax_logprob", "x", lambda a: a["x"][0], ValueError),
    ("decode_attention", "q", lambda a: a["q"].double(), TypeError),
    ("decode_attention", "q", lambda a: a["q"].transpose(0, 1).contiguous().transpose(0, 1), ValueError),
    ("decode_attention", "q", lambda a: torch.randn(2, 3, 8), ValueError),  # heads not a multiple of the KV heads
    ("decode_attention", "kpool", lambda a: a["kpool"][..., :4].contiguous(), ValueError),
    ("decode_attention", "kpool", lambda a: a["kpool"].transpose(0, 1), ValueError),
    ("decode_attention", "vpool", lambda a: a["vpool"][:, :2].contiguous(), ValueError),
    ("decode_attention", "tables", lambda a: a["tables"].long(), TypeError),
    ("decode_attention", "tables", lambda a: a["tables"][:1], ValueError),
    ("decode_attention", "lo", lambda a: a["lo"].long(), TypeError),  # C reads int32 pairs
    ("decode_attention", "hi", lambda a: a["hi"][:1], ValueError),
    ("decode_attention", "out", lambda a: torch.empty(2, 31), ValueError),
    ("decode_attention", "out", lambda a: a["out"].double(), TypeError),
    ("prefill_attention", "q", lambda a: a["q"].half(), TypeError),
    ("prefill_attention", "k", lambda a: torch.randn(6, 3, 8), ValueError),  # 4 heads over 3 KV heads
    ("prefill_attention", "k", lambda a: a["k"][:5], ValueError),
    ("prefill_attention", "v", lambda a: a["v"][:, :1], ValueError),
    ("prefill_attention", "out", lambda a: a["out"][:, :3], ValueError),
    ("prefill_attention", "count", lambda a: 4, ValueError),  # 6 rows: the last prompt's rows never written
    ("prefill_attention", "count", lambda a: 0, ValueError),
]


def test_the_wrappers_take_the_good_arguments(kernels):
    for name, args in good_arguments().items():
        getattr(kernels, name)(**args)


@pytest.mark.parametrize("name,argument,make,error", BAD_ARGUMENTS,
                         ids=[f"{n}-{a}-{i}" for i, (n, a, _, _) in enumerate(BAD_ARGUMENTS)])
def test_a_bad_argument_is_refused_with_its_name(kernels, name, argument, make, error):
    args = good_arguments()[name]
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    args[argument] = make(args)
    with pytest.raises(error, match=rf"CpuKernels\.{name}: .*\b{argument}\b"):
        getattr(kernels, name)(**args)
    for k, v in before.items():  # refused before the C function ran: nothing written
        if k != argument:
            assert torch.equal(args[k].nan_to_num(), v.nan_to_num()), k


def test_decode_step_takes_only_its_structures(kernels):
    from executors.cpu_kernels.step import DecoderSpec, StepSpec

    with pytest.raises(TypeError, match=r"CpuKernels\.decode_step: model and step must be a DecoderSpec"):
        kernels.decode_step(StepSpec(), StepSpec())
    with pytest.raises(TypeError, match=r"CpuKernels\.decode_step: .*StepSpec"):
        kernels.decode_step(DecoderSpec(), DecoderSpec())
