"""The triton attention backend and the fixed-shape decode step against the reference (fp32, 1e-4).

As test_cpu_paths.py: two LlmExecutors share a tiny random model and receive the same
calls, one with attention_backend="triton" (Triton's interpreter here, the compiled
kernels on a GPU), the other the plain reference computation. A third runs decode steps
through DecodeGraphs (captured as CUDA graphs on a GPU, the same static-buffer step run
eagerly on a CPU), so bucketing, padding rows and the scratch block are checked too.
The interpreter is slow: the scenarios are few and small.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.types import (
    DecodeInput,
    DType,
    ForwardKind,
    LogitsKind,
    LogitsPolicy,
    PrefillInput,
    UnifiedBatchItem,
)
from tests.conftest import triton_kernels_unrunnable
from tests.models.test_cpu_paths import BLOCK, TOL, VOCAB, tiny_model

pytestmark = pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))
pytest.importorskip("triton")

CUDA = torch.cuda.is_available()


class Trio:
    """A triton executor, a triton executor with decode graphs and a reference, in lockstep."""

    def __init__(self, family: str, num_blocks: int = 40, max_batch_size: int = 6, **config) -> None:
        model = tiny_model(family)
        device = "cuda" if CUDA else "cpu"
        if CUDA:
            model = model.to(device)
        cfg = LlmExecutorConfig(model_dir=f"/nonexistent/{family}", block_size=BLOCK, num_blocks=num_blocks,
                                device=device, dtype="float32", max_batch_size=max_batch_size,
                                attention_backend="triton", max_sequence_length=160, **config)
        self.executors = [
            LlmExecutor(cfg, model, decode_graphs=False),
            LlmExecutor(cfg, model, decode_graphs=True),
            LlmExecutor(cfg, model, reference=True),
        ]
        self.loop = asyncio.new_event_loop()

    @property
    def graphed(self) -> LlmExecutor:
        return self.executors[1]

    def all(self, method: str, *args):
        return [self.loop.run_until_complete(getattr(ex, method)(*args)) for ex in self.executors]

    def close(self) -> None:
        for ex in self.executors:
            ex.worker.close()
        self.loop.close()


# smollm3: a NoPE layer skips the fused prologue; olmo2: its q/k norms keep the prologue off;
# cohere: LayerNorms and parallel attention and MLP around the prologue; starcoder2: an ungated
# MLP, which the fused GLU kernel does not take; gpt_oss: attention sinks in the kernels, a
# sliding layer, stacked experts with biases; deepseek_v3: latent rows (one KV head of 40,
# not a power of two) through the kernels, the prologue off
@pytest.fixture(params=["llama", "qwen3", "smollm3", "olmo2", "cohere", "starcoder2", "gpt_oss", "deepseek_v3"])
def trio(request):
    t = Trio(request.param)
    yield t
    t.close()


rng = np.random.default_rng(5)


def tokens(n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def same(*outs) -> None:
    first = outs[-1].logits.logits.array  # the reference's
    for o in outs[:-1]:
        np.testing.assert_allclose(o.logits.logits.array, first, atol=TOL, rtol=0)


def fragment(t: Trio) -> None:
    """Hold every other block of each pool (straight through the KV manager: no forward is
    needed to allocate): later caches get scattered blocks."""
    for ex in t.executors:
        ids = [ex.kv.create(None)[0] for _ in range(ex.kv.allocator.num_free)]
        for cache_id in ids:
            ex.kv.extend(cache_id, BLOCK)
        for cache_id in ids[::2]:
            ex.kv.release(cache_id)


def test_prefill_chunks_and_decode_across_block_boundaries(trio):
    fragment(trio)
    outs = trio.all("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (1, 7, 3, 16)])
    for group in zip(*outs):
        same(*group)
    seq, handle = tokens(23), None
    for lo, hi in [(0, 6), (6, 7), (7, 23)]:  # chunked prefill: a cached context plus new tokens
        step = trio.all("prefill", PrefillInput(input_ids=seq[lo:hi], kv_cache=handle))
        same(*step)
        handle = step[0].kv_cache
    assert any(y != x + 1 for x, y in zip(handle.block_ids, handle.block_ids[1:])), "blocks should be scattered"
    for t in tokens(3):  # crosses a block boundary
        step = trio.all("decode", DecodeInput(token_id=t, kv_cache=handle))
        same(*step)
        handle = step[0].kv_cache
    for h in [o.kv_cache for o in outs[0]] + [handle]:
        trio.all("release_cache", h.cache_id)


@pytest.fixture
def qwen3_trio():
    t = Trio("qwen3")  # one family: the buckets do not depend on it, and the interpreter is slow
    yield t
    t.close()


def test_batch_decode_through_every_bucket_with_padding_rows(qwen3_trio):
    """Batches of 1..6 rows run the buckets 1, 2, 4 and 6 (padded), in shuffled row orders."""
    trio = qwen3_trio
    lengths = [1, 2, 5, 9, 16, 23]
    outs = trio.all("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in lengths])
    handles = [o.kv_cache for o in outs[0]]
    replays = trio.graphed.graphs.replays
    for n in (6, 3, 1, 5, 2):
        chosen = [handles[i] for i in rng.permutation(len(handles))[:n]]
        step = trio.all("batch_decode", [DecodeInput(token_id=t, kv_cache=h) for t, h in zip(tokens(n), chosen)])
        for group in zip(*step):
            same(*group)
        fresh = {x.kv_cache.cache_id: x.kv_cache for x in step[0]}
        handles = [fresh.get(h.cache_id, h) for h in handles]
    assert trio.graphed.graphs.replays == replays + 5
    assert trio.graphed.graphs.buckets == [1, 2, 4, 6]
    for h in handles:
        trio.all("release_cache", h.cache_id)


def test_unified_batches_verification_and_sampling_policies(trio):
    dec = trio.all("prefill", PrefillInput(input_ids=tokens(9)))[0].kv_cache
    part = trio.all("prefill", PrefillInput(input_ids=tokens(6)))[0].kv_cache
    items = [
        UnifiedBatchItem(seq_id="", q_tokens=tokens(5), pos_offset=0, is_final_chunk=True),
        UnifiedBatchItem(seq_id=part.cache_id, q_tokens=tokens(4), pos_offset=6, is_final_chunk=True),
        UnifiedBatchItem(seq_id=dec.cache_id, q_tokens=tokens(1), pos_offset=9, is_final_chunk=True),
    ]
    outs = trio.all("unified_decode", items)
    for group in zip(*outs):
        first = group[-1].logits.logits.array
        for o in group[:-1]:
            np.testing.assert_allclose(o.logits.logits.array, first, atol=TOL, rtol=0)
    seq = tokens(4)
    verify = trio.all("forward_verify", outs[0][2].kv_cache, seq, LogitsPolicy())
    for group in zip(*(v.outputs for v in verify)):
        for o in group[:-1]:
            np.testing.assert_allclose(o.logits.array, group[-1].logits.array, atol=TOL, rtol=0)
    # Argmax and seeded sampling pick the same tokens through every path.
    handle = verify[0].kv_cache
    for policy in (LogitsPolicy(kind=LogitsKind.ARGMAX),
                   LogitsPolicy(kind=LogitsKind.SAMPLE, temperature=0.8, top_p=0.9, seed=7)):
        step = trio.all("decode", DecodeInput(token_id=3, kv_cache=handle, logits_policy=policy))
        assert len({s.logits.token_id for s in step}) == 1
        np.testing.assert_allclose([s.logits.logprob for s in step], step[-1].logits.logprob, atol=TOL, rtol=0)
        handle = step[0].kv_cache
        trio.all("truncate_kv", handle.cache_id, handle.sequence_length - 1)
        handle = trio.executors[0]._handle(handle.cache_id)
    fa = trio.all("forward", seq, ForwardKind.LOGITS, DType.FLOAT32)
    np.testing.assert_allclose(fa[0].array, fa[-1].array, atol=TOL, rtol=0)
    for h in (outs[0][0].kv_cache, part, dec):
        trio.all("release_cache", h.cache_id)


def test_stale_pool_contents_never_reach_the_kernels():
    t = Trio("llama")
    try:
        for ex in t.executors:
            ex.pool._storage.fill_(float("nan"))
        outs = t.all("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (3, 6)])
        handles = [o.kv_cache for o in outs[0]]
        for _ in range(3):
            step = t.all("batch_decode", [DecodeInput(token_id=x, kv_cache=h) for x, h in zip(tokens(2), handles)])
            for group in zip(*step):
                assert np.isfinite(group[0].logits.logits.array).all()
                same(*group)
            handles = [x.kv_cache for x in step[0]]
    finally:
        t.close()


def test_backend_choice_and_refusals():
    model = tiny_model("llama")
    auto = LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/llama", num_blocks=8), model)
    try:
        assert auto.attention_backend == "sdpa" and auto.graphs is None  # auto on a CPU device
    finally:
        auto.worker.close()
    if CUDA:
        auto = LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/llama", num_blocks=8, device="cuda",
                                             dtype="float32", max_batch_size=4), model.to("cuda"))
        try:
            assert auto.attention_backend == "triton" and auto.graphs is not None
        finally:
            auto.worker.close()
    with pytest.raises(ValueError, match="attention_backend must be"):
        LlmExecutorConfig(model_dir="x", attention_backend="flash")
    with pytest.raises(ValueError, match="decode graphs need the triton attention backend"):
        LlmExecutor(LlmExecutorConfig(model_dir="x", num_blocks=8, attention_backend="sdpa"), model,
                    decode_graphs=True)


def test_a_wrong_kernel_is_refused_at_start_up(monkeypatch):
    """The start-up self-check compares the kernels with SDPA at the model's shapes: a kernel
    that computes wrongly stops an explicit triton backend (auto falls back to sdpa, on CUDA)."""
    from executors.models import triton_attention

    device = "cuda" if CUDA else "cpu"
    assert triton_attention.self_check(device, torch.float32, 4, 2, 16, BLOCK) is None
    monkeypatch.setattr(triton_attention, "paged_decode", lambda *args, **kwargs: None)
    problem = triton_attention.self_check(device, torch.float32, 4, 2, 16, BLOCK)
    assert problem is not None and "differ from SDPA" in problem
    with pytest.raises(ValueError, match="attention_backend triton: the kernels differ from SDPA"):
        LlmExecutor(LlmExecutorConfig(model_dir="x", num_blocks=8, attention_backend="triton", device=device,
                                      dtype="float32"), tiny_model("llama").to(device))


def test_kernels_that_drop_the_sinks_are_refused_for_a_model_with_them(monkeypatch):
    """GPT-OSS's start-up check runs the kernels with sinks: ones that ignore them fail it."""
    from executors.models import triton_attention

    device = "cuda" if CUDA else "cpu"
    assert triton_attention.self_check(device, torch.float32, 4, 2, 16, BLOCK, sinks=True) is None
    real = triton_attention.paged_prefill
    monkeypatch.setattr(triton_attention, "paged_prefill", lambda *a, sinks=None, **k: real(*a, **k))
    assert triton_attention.self_check(device, torch.float32, 4, 2, 16, BLOCK) is None  # none to drop
    problem = triton_attention.self_check(device, torch.float32, 4, 2, 16, BLOCK, sinks=True)
    assert problem is not None and "differ from SDPA" in problem
    with pytest.raises(ValueError, match="attention_backend triton: the kernels differ from SDPA"):
        LlmExecutor(LlmExecutorConfig(model_dir="x", num_blocks=8, attention_backend="triton", device=device,
                                      dtype="float32"), tiny_model("gpt_oss").to(device))


def test_decode_graphs_with_the_few_row_matmuls(monkeypatch):
    """triton_gemv: the graphs' matmuls of up to 8 rows go through triton_gemv.py where its
    result matched torch's (untimed here, on a CPU; timed against torch's on a GPU), qwen2's
    biases too; every bucket's logits match the reference's, and status names the choices."""
    from executors.models import cpu_layout

    # Row-major weights, as on a GPU: a float32 CPU model without the kernels may store some
    # column-major (MKL's faster one-row layout, timed at load), which the kernel does not take.
    monkeypatch.setattr(cpu_layout, "relayout", lambda model: None)
    t = Trio("qwen2", triton_gemv=True, cpu_kernels=False)  # the CPU kernels' panels would take the matmuls
    try:
        matmuls = t.graphed.graphs.matmuls
        assert t.executors[0].graphs is None  # the eager executor has no graphs, so none of this
        outs = t.all("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (3, 9, 17, 5, 1, 12)])
        handles = [o.kv_cache for o in outs[0]]
        for n in (6, 1, 3):
            step = t.all("batch_decode", [DecodeInput(token_id=x, kv_cache=h) for x, h in zip(tokens(n), handles)])
            for group in zip(*step):
                same(*group)
            handles = [x.kv_cache for x in step[0]] + handles[n:]
        chosen = t.graphed.info().metadata["few_row_matmuls"]
        assert chosen == matmuls.chosen()
        rows = {key.split("x")[0] for key in chosen}
        # On a GPU each bucket chose in its warm-up before the capture; on a CPU (no capture)
        # each bucket chooses at its first step: 6, 1 and 3 rows ran the buckets 6, 1 and 4.
        assert rows == ({"1", "2", "4", "6"} if CUDA else {"1", "4", "6"}), chosen
        if CUDA:  # timed: torch's may win a shape
            assert set(matmuls.timings) == set(matmuls.choice), matmuls.timings
        else:
            assert all(v.startswith("triton ") for v in chosen.values()), chosen
        assert any("+bias" in key for key in chosen) and any("+residual" in key for key in chosen)
    finally:
        t.close()


def test_decode_graphs_size_their_partitions_for_each_step(monkeypatch):
    """A bucket's partition count is fixed at capture and their length set each step for the
    step's longest context, so short contexts split too: with 3 partitions a step up to 101
    keys splits into 48-key partitions, a step of 7 keys into 16-key ones (a length fixed for
    the longest sequence allowed would have been 64), and both give the reference's logits."""
    from executors import decode_graphs
    from executors.models.triton_attention import partition_length

    monkeypatch.setattr(decode_graphs, "decode_partitions", lambda batch, kv_heads, max_length, device: 3)
    t = Trio("llama")
    try:
        graphs = t.graphed.graphs
        assert partition_length(graphs.max_sequence_length, 3) == 64
        outs = t.all("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (6, 100)])
        step = t.all("batch_decode", [DecodeInput(token_id=x, kv_cache=o.kv_cache)
                                      for x, o in zip(tokens(2), outs[0])])
        for group in zip(*step):
            same(*group)
        assert graphs._long_np[4, 0] == partition_length(101, 3) == 48
        alone = t.all("decode", DecodeInput(token_id=3, kv_cache=step[0][0].kv_cache))
        same(*alone)
        assert graphs._long_np[4, 0] == partition_length(8, 3) == 16
        for h in (alone[0].kv_cache, step[0][1].kv_cache):
            t.all("release_cache", h.cache_id)
    finally:
        t.close()


def test_decode_graph_check_rows_stay_in_the_scratch_block():
    """The post-capture check's rows (distinct tokens and lengths, all in the scratch block) run
    through the static buffers without touching any sequence's blocks."""
    t = Trio("llama")
    try:
        graphs, pool = t.graphed.graphs, t.graphed.pool
        before = pool._storage[:, :, :pool.num_blocks].clone()
        graphs._verify(1)
        first_slot = pool._storage[:, :, pool.scratch_block, 0].clone()
        for n in (3, 4):  # 3 rows replay in the graph of 4: one padding row beside them
            graphs._verify(n)
            # The padding row stores its K and V elsewhere: where it shared slot 0 with the first
            # check row, the two raced on a GPU (run 24), and on a CPU the padding's K won. (Not
            # bit for bit: on a GPU the buckets' matmuls round differently.)
            torch.testing.assert_close(pool._storage[:, :, pool.scratch_block, 0], first_slot, atol=1e-4, rtol=0)
        assert torch.equal(pool._storage[:, :, :pool.num_blocks], before)
        assert torch.count_nonzero(pool._storage[:, :, pool.scratch_block]) > 0
    finally:
        t.close()


def test_argmax_rows_computed_in_the_graph_beside_other_policies(qwen3_trio):
    """A decode graph computes every row's argmax and log-probability with the logits; a step
    mixing ARGMAX rows with top-k rows takes the ARGMAX rows' pairs from it, the rest from the logits."""
    trio = qwen3_trio
    outs = trio.all("batch_prefill", [PrefillInput(input_ids=tokens(n)) for n in (3, 7, 12)])
    policies = [LogitsPolicy(kind=LogitsKind.ARGMAX), LogitsPolicy(kind=LogitsKind.TOP_K, k=3),
                LogitsPolicy(kind=LogitsKind.ARGMAX)]
    replays = trio.graphed.graphs.replays
    steps = [trio.loop.run_until_complete(ex.batch_decode(
        [DecodeInput(token_id=5, kv_cache=o.kv_cache, logits_policy=p) for o, p in zip(outs_ex, policies)]))
        for ex, outs_ex in zip(trio.executors, outs)]
    assert trio.graphed.graphs.replays == replays + 1
    for rows in zip(*steps):
        want = rows[-1].logits
        for got in rows[:-1]:
            if want.kind is LogitsKind.ARGMAX:
                assert got.logits.token_id == want.token_id
                assert abs(got.logits.logprob - want.logprob) <= TOL
            else:
                assert got.logits.top_token_ids == want.top_token_ids
                np.testing.assert_allclose(got.logits.top_logprobs, want.top_logprobs, atol=TOL, rtol=0)
    for ex, step in zip(trio.executors, steps):
        for s in step:
            trio.loop.run_until_complete(ex.release_cache(s.kv_cache.cache_id))
