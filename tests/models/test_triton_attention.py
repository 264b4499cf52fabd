"""The Triton paged-attention kernels against plain SDPA over gathered contexts.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before triton is imported), which checks their indexing, masking and online softmax;
with one, the same tests run the compiled kernels, plus a bfloat16 case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import triton_kernels_unrunnable

ta = pytest.importorskip("executors.models.triton_attention")
# Every test here runs the kernels, but the ahead-of-time compilation, which needs neither a GPU nor the interpreter.
needs_kernels = pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def make_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    value = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    return key, value


def reference(q, key, value, block_ids, length, start):
    """Rows of q (queries at positions start..) over keys 0..length-1 through block_ids, causal."""
    bs, kvh, d = key.shape[1], key.shape[2], key.shape[3]
    slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(length)], device=q.device)
    k = key.reshape(-1, kvh, d)[slots].float()
    v = value.reshape(-1, kvh, d)[slots].float()
    n = q.shape[0]
    mask = torch.arange(length, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def scattered_tables(lengths, block_size, num_blocks, seed=1):
    """Block tables in a random order of the pool's blocks: every table non-contiguous."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in lengths:
        need = -(-n // block_size)
        tables.append(perm[:need])
        perm = perm[need:]
    return tables


SHAPES = [  # (heads, kv heads, head dim, block size)
    (4, 4, 16, 4),    # multi-head, tiny blocks
    (6, 2, 24, 16),   # a group of 3 (padded to 16 rows), head dim not a power of two
    (8, 1, 32, 8),    # multi-query
]


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_prefill_over_cached_contexts_of_mixed_lengths(heads, kv_heads, head_dim, block_size):
    # (new tokens, cached tokens): fresh prompts, a chunk on a cached context, a 1-token
    # chunk, a prompt longer than one query tile.
    specs = [(5, 0), (37, 0), (20, 13), (1, 50), (3, 2)]
    tables = scattered_tables([n + s for n, s in specs], block_size, 80)
    key, value = make_pool(80, block_size, kv_heads, head_dim)
    segments, row = [], 0
    for (n, start), table in zip(specs, tables):
        segments.append((row, n, start, table))
        row += n
    q = torch.randn(row, heads, head_dim, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    ta.paged_prefill(q, key, value, out, ta.prefill_launch(segments, block_size, DEVICE))
    for r, n, start, table in segments:
        torch.testing.assert_close(out[r:r + n], reference(q[r:r + n], key, value, table, start + n, start),
                                   atol=1e-5, rtol=0)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("partitions", [1, 3])
def test_decode_rows_over_paged_contexts(heads, kv_heads, head_dim, block_size, partitions):
    lengths = [2, 40, 97, 17, block_size]
    tables = scattered_tables(lengths, block_size, 90)
    key, value = make_pool(90, block_size, kv_heads, head_dim)
    # Decode rows interleaved with other rows of the flat batch, which must stay untouched.
    rows = [0, 2, 3, 5, 6]
    q = torch.randn(8, heads, head_dim, device=DEVICE)
    out = torch.zeros_like(q)
    launch = ta.decode_launch(rows, tables, lengths, block_size, kv_heads, DEVICE, partitions=partitions)
    assert launch.partitions == partitions
    ta.paged_decode(q, key, value, out, launch)
    for r, table, n in zip(rows, tables, lengths):
        torch.testing.assert_close(out[r:r + 1], reference(q[r:r + 1], key, value, table, n, n - 1),
                                   atol=1e-5, rtol=0)
    assert out[[1, 4, 7]].abs().sum() == 0


@needs_kernels
@pytest.mark.parametrize("partitions", [1, 3])
def test_decode_partitions_wholly_before_a_sliding_window(partitions):
    """A window of 8 over 97 keys in 3 partitions of 48: the first sees no key (its log-sum-exp
    is -inf) and the merge must weigh it 0, as with partitions past a length."""
    block_size, lengths, window = 16, [97, 5], 8
    tables = scattered_tables(lengths, block_size, 20)
    key, value = make_pool(20, block_size, 2, 16)
    q = torch.randn(2, 4, 16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    ta.paged_decode(q, key, value, out, ta.decode_launch([0, 1], tables, lengths, block_size, 2, DEVICE,
                                                         partitions=partitions), window=window)
    for r, (table, n) in enumerate(zip(tables, lengths)):
        lo = max(0, n - window)
        shifted = [table[p // block_size] for p in range(lo, n)]  # the window's keys, as their own table
        k = torch.stack([key[b, p % block_size] for b, p in zip(shifted, range(lo, n))])
        v = torch.stack([value[b, p % block_size] for b, p in zip(shifted, range(lo, n))])
        want = F.scaled_dot_product_attention(q[r:r + 1].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[r:r + 1], want, atol=1e-5, rtol=0)


def reference_with_sinks(q, key, value, block_ids, length, start, sinks, window=None):
    """GPT-OSS's attention written out (attention_reference.explicit): causal, within the window,
    each head's softmax also over its sink logit."""
    from executors.models.attention import LayerAttention
    from executors.models.attention_reference import sdpa

    bs, kvh, d = key.shape[1], key.shape[2], key.shape[3]
    key_start = 0 if window is None else max(0, start - window + 1)
    slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(key_start, length)], device=q.device)
    return sdpa(q.float(), key.reshape(-1, kvh, d)[slots].float(), value.reshape(-1, kvh, d)[slots].float(), start,
                LayerAttention(window=window, sinks=sinks.float()), key_start)


@needs_kernels
@pytest.mark.parametrize("partitions", [1, 3])  # the sinks in the decode kernel, or in the partitions' merge
@pytest.mark.parametrize("window", [None, 8])
def test_decode_and_prefill_normalise_over_gpt_oss_sinks(partitions, window):
    """Sinks far above every score (near-zero outputs), far below (none) and in between; a
    window whose first partition sees no key; they bite."""
    heads, kv_heads, d, block_size = 6, 2, 16, 4
    lengths = [2, 40, 97]
    tables = scattered_tables(lengths, block_size, 60)
    key, value = make_pool(60, block_size, kv_heads, d)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 2
    sinks[0], sinks[4] = 40.0, -40.0
    q = torch.randn(3, heads, d, device=DEVICE)
    out, plain = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    launch = ta.decode_launch([0, 1, 2], tables, lengths, block_size, kv_heads, DEVICE, partitions=partitions)
    ta.paged_decode(q, key, value, out, launch, window=window, sinks=sinks)
    ta.paged_decode(q, key, value, plain, launch, window=window)
    for r, (table, n) in enumerate(zip(tables, lengths)):
        torch.testing.assert_close(out[r:r + 1], reference_with_sinks(q[r:r + 1], key, value, table, n, n - 1, sinks,
                                                                      window), atol=1e-5, rtol=0)
    assert (out - plain).abs().max() > 1e-2
    # A fresh prompt and a chunk on a cached context, several query tiles.
    segments = [(0, 37, 0, tables[1]), (37, 20, 77, tables[2])]
    q = torch.randn(57, heads, d, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    ta.paged_prefill(q, key, value, out, ta.prefill_launch(segments, block_size, DEVICE), window=window, sinks=sinks)
    for r, n, start, table in segments:
        torch.testing.assert_close(out[r:r + n], reference_with_sinks(q[r:r + n], key, value, table, start + n, start,
                                                                      sinks, window), atol=1e-5, rtol=0)


@needs_kernels
def test_the_merge_of_partitions_adds_the_sinks_in_torch_too(monkeypatch):
    """The merge's fallback (torch ops, where its kernel cannot run) adds the sinks as the kernel does."""
    from executors.models import triton_attention_launch as launch_module

    heads, kv_heads, d, block_size, lengths = 4, 2, 16, 8, [60, 33]
    tables = scattered_tables(lengths, block_size, 20)
    key, value = make_pool(20, block_size, kv_heads, d)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(4)).to(DEVICE) * 2
    q = torch.randn(2, heads, d, device=DEVICE)
    launch = ta.decode_launch([0, 1], tables, lengths, block_size, kv_heads, DEVICE, partitions=3)
    kernel = torch.full_like(q, float("nan"))
    ta.paged_decode(q, key, value, kernel, launch, sinks=sinks)
    monkeypatch.setattr(launch_module, "_merge_kernel_failed", ["broken for the test"])
    torch_ops = torch.full_like(q, float("nan"))
    ta.paged_decode(q, key, value, torch_ops, launch, sinks=sinks)
    torch.testing.assert_close(torch_ops, kernel, atol=1e-5, rtol=0)
    for r, (table, n) in enumerate(zip(tables, lengths)):
        torch.testing.assert_close(kernel[r:r + 1], reference_with_sinks(q[r:r + 1], key, value, table, n, n - 1,
                                                                         sinks), atol=1e-5, rtol=0)


@needs_kernels
def test_keys_past_a_length_are_never_read():
    """NaN in every slot past each sequence's end (a block's stale tail) must not reach the output."""
    block_size, lengths = 8, [3, 13, 30]
    tables = scattered_tables(lengths, block_size, 20)
    key, value = make_pool(20, block_size, 2, 16)
    for table, n in zip(tables, lengths):
        for p in range(n, len(table) * block_size):
            key[table[p // block_size], p % block_size] = float("nan")
            value[table[p // block_size], p % block_size] = float("nan")
    q = torch.randn(3, 4, 16, device=DEVICE)
    for parts in (1, 2):
        out = torch.zeros_like(q)
        ta.paged_decode(q, key, value, out, ta.decode_launch([0, 1, 2], tables, lengths, block_size, 2, DEVICE,
                                                             partitions=parts))
        assert torch.isfinite(out).all()
    out = torch.zeros_like(q)
    segments = [(0, 1, 2, tables[0]), (1, 2, 11, tables[1])]
    ta.paged_prefill(q, key, value, out, ta.prefill_launch(segments, block_size, DEVICE))
    assert torch.isfinite(out).all()


def test_decode_partitions_split_only_long_contexts_on_a_cpu():
    cpu = torch.device("cpu")
    assert ta.decode_partitions(4, 2, 100, cpu, min_partition_tokens=512) == 1
    assert ta.decode_partitions(4, 2, 1500, cpu, min_partition_tokens=512) == 3


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_bfloat16_decode_and_prefill_on_cuda():
    block_size, lengths = 16, [300, 5, 1000]
    tables = scattered_tables(lengths, block_size, 100)
    key, value = make_pool(100, block_size, 8, 128, torch.bfloat16)
    q = torch.randn(3, 16, 128, device=DEVICE, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    ta.paged_decode(q, key, value, out, ta.decode_launch([0, 1, 2], tables, lengths, block_size, 8, DEVICE))
    for r, table, n in zip(range(3), tables, lengths):
        torch.testing.assert_close(out[r:r + 1].float(), reference(q[r:r + 1], key, value, table, n, n - 1),
                                   atol=2e-2, rtol=2e-2)
    segments = [(0, 3, 297, tables[0])]
    out = torch.zeros_like(q)
    ta.paged_prefill(q, key, value, out, ta.prefill_launch(segments, block_size, DEVICE))
    torch.testing.assert_close(out.float(), reference(q, key, value, tables[0], 300, 297), atol=2e-2, rtol=2e-2)


def test_the_kernels_compile_for_an_h100_without_one():
    """Ahead-of-time compilation for compute capability 9.0 (Triton's own compiler and ptxas,
    no GPU needed): the kernels the interpreter checks also build for the hardware. bfloat16,
    the GPU default (float32 builds too, ~35 s more; bench/RESULTS.md). In a subprocess, since
    this process imported triton in interpreter mode."""
    dtype = "bf16"
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from executors.models.triton_attention import compile_for; "
            f"print(json.dumps(compile_for(90, {dtype!r}, head_dim=128, group=2)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    attention = {"decode", "decode_split", "prefill", "decode_sinks", "prefill_sinks"}
    assert set(shared) == {*attention, "merge", "merge_sinks", "prologue", "prologue_norm", "glu_silu",
                           "glu_gelu_tanh", "gemv", "gemv_partial", "gemv_split_sum"}
    # An H100 block's shared memory; the small fused kernels may need none.
    assert all(0 < shared[k] <= 227 * 1024 for k in attention), shared
    assert all(0 <= shared[k] <= 227 * 1024 for k in set(shared) - attention), shared


@needs_kernels
def test_the_merge_falls_back_to_torch_ops_when_its_kernel_cannot_run(monkeypatch, caplog):
    from executors.models import triton_attention_launch as launch_module

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no such kernel here")
            return launch

    monkeypatch.setattr(launch_module, "_merge_kernel", Broken())
    monkeypatch.setattr(launch_module, "_merge_kernel_failed", [])
    lengths, block_size = [40, 9], 16
    tables = scattered_tables(lengths, block_size, 20)
    key, value = make_pool(20, block_size, 2, 16)
    q = torch.randn(2, 4, 16, device=DEVICE)
    for _ in range(2):  # warned once, then the torch ops without trying again
        out = torch.zeros_like(q)
        with caplog.at_level("WARNING"):
            ta.paged_decode(q, key, value, out, ta.decode_launch([0, 1], tables, lengths, block_size, 2, DEVICE,
                                                                 partitions=3))
        for r, (table, n) in enumerate(zip(tables, lengths)):
            torch.testing.assert_close(out[r:r + 1], reference(q[r:r + 1], key, value, table, n, n - 1),
                                       atol=1e-5, rtol=0)
    assert caplog.text.count("merge kernel failed") == 1 and "no such kernel here" in caplog.text
