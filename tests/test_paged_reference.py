"""PagedAttentionExecutor over gRPC against a NumPy re-computation (within 1e-5).

Every call goes through a real server on localhost and the real client; the reference
recomputes each sequence from its whole token history with no cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from client import DecodeInput, LogitsPolicy, PrefillInput, UnifiedBatchItem
from tests.paged_reference import PagedModel, log_softmax

MODEL = PagedModel()
TOL = 1e-5
rng = np.random.default_rng(1234)


def prompt(n: int) -> list[int]:
    return rng.integers(0, MODEL.vocab_size, size=n).tolist()


def close(actual: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual, expected, atol=TOL, rtol=0)


@pytest.fixture(autouse=True)
def pool_is_clean_afterwards(client):
    """Every test releases what it made: the pool is back to all blocks free."""
    yield
    kv = client.status().kv_pool
    assert kv.active_caches == 0 and kv.free_blocks == kv.total_blocks and kv.used_blocks == 0


@pytest.mark.parametrize("length", [1, 3, 4, 5, 16, 17, 63])
def test_prefill_matches_reference(client, length):
    tokens = prompt(length)
    out = client.prefill(PrefillInput(tokens))
    close(out.logits.logits, MODEL.last_logits(tokens))
    assert out.kv_cache.sequence_length == length
    assert len(out.kv_cache.block_ids) == -(-length // 4)
    client.release_cache(out.kv_cache)


@pytest.mark.parametrize("chunks", [[7, 9, 1, 20], [4, 4, 4], [1, 1, 1, 1, 1], [13, 2]])
def test_chunked_prefill_matches_one_shot_and_reference(client, chunks):
    tokens = prompt(sum(chunks))
    handle, start = None, 0
    for size in chunks:
        out = client.prefill(PrefillInput(tokens[start:start + size], kv_cache=handle))
        start += size
        handle = out.kv_cache
        assert handle.sequence_length == start
        close(out.logits.logits, MODEL.last_logits(tokens[:start]))
    whole = client.prefill(PrefillInput(tokens))
    close(out.logits.logits, whole.logits.logits)
    client.release_cache(handle)
    client.release_cache(whole.kv_cache)


def test_decode_steps_match_reference(client):
    tokens = prompt(6)
    out = client.prefill(PrefillInput(tokens))
    handle = out.kv_cache
    for _ in range(12):  # crosses three block boundaries at block size 4
        nxt = int(rng.integers(0, MODEL.vocab_size))
        step = client.decode(DecodeInput(nxt, handle))
        tokens.append(nxt)
        handle = step.kv_cache
        assert handle.sequence_length == len(tokens)
        close(step.logits.logits, MODEL.last_logits(tokens))
    client.release_cache(handle)


def test_batch_prefill_matches_reference_and_single_prefills(client):
    prompts = [prompt(n) for n in (1, 5, 8, 23, 40)]
    outs = client.batch_prefill([PrefillInput(p) for p in prompts])
    assert len({o.kv_cache.cache_id for o in outs}) == len(prompts)
    for p, o in zip(prompts, outs):
        close(o.logits.logits, MODEL.last_logits(p))
        single = client.prefill(PrefillInput(p))
        close(o.logits.logits, single.logits.logits)
        client.release_cache(single.kv_cache)
        client.release_cache(o.kv_cache)


def test_batch_decode_matches_reference(client):
    histories = [prompt(n) for n in (2, 7, 12, 30)]
    handles = [o.kv_cache for o in client.batch_prefill([PrefillInput(h) for h in histories])]
    for _ in range(5):
        nxt = rng.integers(0, MODEL.vocab_size, size=len(histories)).tolist()
        outs = client.batch_decode([DecodeInput(t, h) for t, h in zip(nxt, handles)])
        for hist, t, o in zip(histories, nxt, outs):
            hist.append(t)
            close(o.logits.logits, MODEL.last_logits(hist))
        handles = [o.kv_cache for o in outs]
    for h in handles:
        client.release_cache(h)


def test_unified_batch_mixes_chunks_and_decodes(client):
    decoding = prompt(9)
    dec_handle = client.prefill(PrefillInput(decoding)).kv_cache
    chunked = prompt(30)
    first = client.prefill(PrefillInput(chunked[:10])).kv_cache  # a prefill already under way
    fresh = prompt(11)
    nxt = 77
    items = [
        UnifiedBatchItem("", fresh, 0, True),  # a new prompt in one go, server-chosen id
        UnifiedBatchItem(first.cache_id, chunked[10:20], 10, False),  # middle chunk: no logits
        UnifiedBatchItem(dec_handle.cache_id, [nxt], 9, True),  # a decode step
        UnifiedBatchItem("caller-named-seq", fresh[:5], 0, True),  # a new cache under a caller's id
    ]
    results = client.unified_decode(items)
    assert [r.seq_id for r in results][1:] == [first.cache_id, dec_handle.cache_id, "caller-named-seq"]
    assert results[0].seq_id
    close(results[0].logits.logits, MODEL.last_logits(fresh))
    assert results[1].logits is None and results[1].kv_cache.sequence_length == 20
    close(results[2].logits.logits, MODEL.last_logits(decoding + [nxt]))
    close(results[3].logits.logits, MODEL.last_logits(fresh[:5]))
    # The final chunk of the chunked prefill, in a second unified step.
    last = client.unified_decode([UnifiedBatchItem(first.cache_id, chunked[20:], 20, True)])
    close(last[0].logits.logits, MODEL.last_logits(chunked))
    for r in results:
        client.release_cache(r.seq_id)


def test_forward_verify_returns_n_plus_one_rows(client):
    tokens = prompt(10)
    handle = client.prefill(PrefillInput(tokens)).kv_cache
    drafts = prompt(5)  # the last accepted token and 4 drafts
    out = client.forward_verify(handle, drafts)
    assert len(out.outputs) == len(drafts)
    assert out.kv_cache.sequence_length == len(tokens) + len(drafts)
    expected = MODEL.logits(tokens + drafts)[len(tokens):]
    for row, exp in zip(out.outputs, expected):
        close(row.logits, exp)
    client.release_cache(out.kv_cache)


def test_truncate_then_decode_equals_fresh_prefill_then_decode(client):
    tokens = prompt(14)
    handle = client.prefill(PrefillInput(tokens)).kv_cache
    handle = client.forward_verify(handle, prompt(6)).kv_cache  # 20 tokens, 5 blocks
    cut = client.truncate_kv(handle, 9)
    assert cut.kv_cache.sequence_length == 9 and cut.freed_blocks == 5 - 3
    after = client.decode(DecodeInput(42, cut.kv_cache))
    fresh = client.prefill(PrefillInput(tokens[:9]))
    fresh_after = client.decode(DecodeInput(42, fresh.kv_cache))
    close(after.logits.logits, fresh_after.logits.logits)
    close(after.logits.logits, MODEL.last_logits(tokens[:9] + [42]))
    client.release_cache(after.kv_cache)
    client.release_cache(fresh_after.kv_cache)


def test_forward_touches_no_cache(client):
    tokens = prompt(12)
    before = client.status().kv_pool
    logits = client.forward(tokens, output="logits")
    close(logits.output, MODEL.logits(tokens))
    hidden = client.forward(tokens, output="hidden_states")
    close(hidden.output, MODEL.hidden(tokens))
    logprobs = client.forward(tokens, output="token_logprobs")
    expected = log_softmax(MODEL.logits(tokens))[np.arange(len(tokens) - 1), tokens[1:]]
    close(logprobs.output, expected)
    after = client.status().kv_pool
    assert (before.used_blocks, before.active_caches) == (after.used_blocks, after.active_caches)


def test_logits_policies_agree_with_full_logits(client):
    tokens = prompt(9)
    expected = MODEL.last_logits(tokens)
    lp = log_softmax(expected)
    handles = []

    def run(policy):
        out = client.prefill(PrefillInput(tokens, logits_policy=policy))
        handles.append(out.kv_cache)
        return out.logits

    argmax = run(LogitsPolicy.argmax())
    assert argmax.kind == "argmax" and argmax.logits is None
    assert argmax.token_id == int(np.argmax(expected))
    assert argmax.logprob == pytest.approx(lp[argmax.token_id], abs=TOL)

    top = run(LogitsPolicy.top_k(5))
    order = np.argsort(-expected, kind="stable")[:5]
    np.testing.assert_allclose(top.top_logprobs, lp[order], atol=TOL)
    np.testing.assert_allclose(np.sort(top.top_logprobs)[::-1], top.top_logprobs)

    greedy = run(LogitsPolicy.sample(temperature=0.0))
    assert greedy.token_id == argmax.token_id and greedy.sampling_logprob == 0.0

    seeded = [run(LogitsPolicy.sample(temperature=0.8, top_p=0.9, seed=7)).token_id for _ in range(3)]
    assert len(set(seeded)) == 1, "the same seed at the same position draws the same token"

    half = run(LogitsPolicy.full("bfloat16")).logits
    np.testing.assert_allclose(half, expected, rtol=1e-2, atol=1e-2)
    f16 = run(LogitsPolicy.full("float16")).logits
    np.testing.assert_allclose(f16, expected, rtol=1e-3, atol=1e-3)
    for h in handles:
        client.release_cache(h)


def test_sampling_respects_top_k_and_logprob_is_the_models(client):
    tokens = prompt(5)
    expected = MODEL.last_logits(tokens)
    third = np.sort(expected)[-3]
    allowed = set(np.flatnonzero(expected >= third - TOL).tolist())  # ties at the cut stay in
    lp = log_softmax(expected)
    handles = []
    for seed in range(20):
        out = client.prefill(PrefillInput(tokens, logits_policy=LogitsPolicy.sample(1.0, top_k=3, seed=seed)))
        handles.append(out.kv_cache)
        assert out.logits.token_id in allowed
        assert out.logits.logprob == pytest.approx(lp[out.logits.token_id], abs=TOL)
        assert out.logits.sampling_logprob >= out.logits.logprob - TOL  # top-k renormalises upwards
    for h in handles:
        client.release_cache(h)
