"""A table of bad requests: each gets its precise status code, and the server keeps serving.

Malformed messages the typed client would never build are sent through the raw stub.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from client import DecodeInput, ExecutorError, KvCacheHandle, LogitsPolicy, PrefillInput, UnifiedBatchItem
from generated.modelexec.v1 import executor_pb2 as pb
from generated.modelexec.v1 import executor_pb2_grpc as pb_grpc
from tests.paged_reference import PagedModel

C = grpc.StatusCode
MODEL = PagedModel()


@pytest.fixture
def stub(paged_server):
    with grpc.insecure_channel(paged_server.address) as channel:
        yield pb_grpc.ModelExecutorServiceStub(channel)


@pytest.fixture
def live(client):
    """A live cache of 5 tokens, released afterwards."""
    out = client.prefill(PrefillInput([1, 2, 3, 4, 5]))
    yield out.kv_cache
    client.release_cache(out.kv_cache.cache_id)


def expect(code: grpc.StatusCode, fn, *args, **kwargs) -> ExecutorError:
    with pytest.raises(ExecutorError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.code == code, f"expected {code.name}, got {err.code.name}: {err.details_message}"
    assert err.details_message, "every error says what was wrong"
    return err


def raw(code: grpc.StatusCode, method, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        method(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    return info.value


def test_prefill_bad_inputs(client):
    err = expect(C.INVALID_ARGUMENT, client.prefill, PrefillInput([]))
    assert err.metadata.get("field") == "input.input_ids"
    err = expect(C.INVALID_ARGUMENT, client.prefill, PrefillInput([1, 256, 3]))
    assert "input.input_ids[1]" in err.details_message and "vocabulary" in err.details_message
    expect(C.INVALID_ARGUMENT, client.prefill, PrefillInput([1, 2], attention_mask=[1, 0]))
    expect(C.INVALID_ARGUMENT, client.prefill, PrefillInput([1, 2], attention_mask=[1]))
    expect(C.FAILED_PRECONDITION, client.prefill, PrefillInput([1, 2], position_ids=[3, 4]))
    err = expect(C.INVALID_ARGUMENT, client.prefill, PrefillInput([1, 2, 3], position_ids=[0]))
    assert err.metadata.get("field") == "input.position_ids"
    err = expect(C.INVALID_ARGUMENT, client.list_caches, ["fine", "a b"])
    assert err.metadata.get("field") == "cache_ids[1]"
    expect(C.INVALID_ARGUMENT, client.list_caches, [""])
    expect(C.OUT_OF_RANGE, client.prefill, PrefillInput([1] * 513))
    expect(C.INVALID_ARGUMENT, client.prefill, PrefillInput([1], kv_cache=KvCacheHandle("bad id!", 0)))


@pytest.mark.parametrize(
    "policy",
    [
        LogitsPolicy.top_k(0),
        LogitsPolicy.top_k(257),
        LogitsPolicy.sample(-1.0),
        LogitsPolicy.sample(math.nan),
        LogitsPolicy.sample(math.inf),
        LogitsPolicy.sample(1.0, top_p=0.0),
        LogitsPolicy.sample(1.0, top_p=1.5),
    ],
    ids=["k0", "k_over_vocab", "neg_temp", "nan_temp", "inf_temp", "top_p_0", "top_p_gt_1"],
)
def test_bad_logits_policies(client, policy):
    err = expect(C.INVALID_ARGUMENT, client.prefill, PrefillInput([1, 2], logits_policy=policy))
    assert err.metadata["field"].startswith("input.logits_policy")


def test_full_logits_must_be_a_float_dtype(stub):
    req = pb.PrefillRequest(input=pb.PrefillInput(
        input_ids=[1], logits_policy=pb.LogitsPolicy(full=pb.FullLogits(dtype=pb.DATA_TYPE_INT32))))
    raw(C.INVALID_ARGUMENT, stub.Prefill, req)
    req.input.logits_policy.full.dtype = 77  # not a DataType at all
    raw(C.INVALID_ARGUMENT, stub.Prefill, req)


def test_decode_bad_inputs(client, stub, live):
    expect(C.NOT_FOUND, client.decode, DecodeInput(1, KvCacheHandle("never-made", 5)))
    err = expect(C.FAILED_PRECONDITION, client.decode, DecodeInput(1, KvCacheHandle(live.cache_id, 4)))
    assert "stale" in err.details_message and err.reason == "STALE_CACHE_HANDLE"
    expect(C.INVALID_ARGUMENT, client.decode, DecodeInput(999, live))
    expect(C.FAILED_PRECONDITION, client.decode, DecodeInput(1, live, position_id=9))
    handle = pb.KvCacheHandle(cache_id=live.cache_id, block_table=pb.BlockTable(sequence_length=5))
    raw(C.INVALID_ARGUMENT, stub.Decode, pb.DecodeRequest(input=pb.DecodeInput(kv_cache=handle)))  # no token
    raw(C.INVALID_ARGUMENT, stub.Decode, pb.DecodeRequest(input=pb.DecodeInput(token_id=1)))  # no cache
    raw(C.INVALID_ARGUMENT, stub.Decode, pb.DecodeRequest(input=pb.DecodeInput(
        token_id=1, kv_cache=pb.KvCacheHandle())))  # no cache id


def test_released_cache_says_so(client):
    out = client.prefill(PrefillInput([1, 2, 3]))
    first = client.release_cache(out.kv_cache)
    assert first.released and first.freed_blocks == 1
    again = client.release_cache(out.kv_cache)  # idempotent
    assert not again.released and again.freed_blocks == 0
    err = expect(C.NOT_FOUND, client.decode, DecodeInput(1, out.kv_cache))
    assert err.reason == "CACHE_RELEASED"
    err = expect(C.NOT_FOUND, client.release_cache, "no-such-cache")
    assert err.reason == "CACHE_NOT_FOUND"


def test_batch_bad_inputs(client, live):
    expect(C.INVALID_ARGUMENT, client.batch_prefill, [])
    expect(C.INVALID_ARGUMENT, client.batch_decode, [])
    expect(C.INVALID_ARGUMENT, client.batch_decode, [DecodeInput(1, live), DecodeInput(2, live)])
    expect(C.INVALID_ARGUMENT, client.batch_prefill, [PrefillInput([1])] * 65)
    # One bad item fails the whole batch before anything changes.
    before = client.status().kv_pool
    err = expect(C.INVALID_ARGUMENT, client.batch_prefill, [PrefillInput([1, 2]), PrefillInput([300])])
    assert err.metadata["field"] == "inputs[1].input_ids[0]"
    err = expect(C.NOT_FOUND, client.batch_decode, [DecodeInput(1, live), DecodeInput(1, KvCacheHandle("gone", 3))])
    after = client.status().kv_pool
    assert (after.used_blocks, after.active_caches) == (before.used_blocks, before.active_caches)
    assert client.decode(DecodeInput(7, live)).kv_cache.sequence_length == 6


def test_unified_bad_inputs(client, live):
    expect(C.INVALID_ARGUMENT, client.unified_decode, [])
    expect(C.FAILED_PRECONDITION, client.unified_decode, [UnifiedBatchItem(live.cache_id, [1], 3, True)])
    expect(C.INVALID_ARGUMENT, client.unified_decode, [UnifiedBatchItem("", [1], 3, True)])
    expect(C.NOT_FOUND, client.unified_decode, [UnifiedBatchItem("not-there", [1], 3, True)])
    expect(C.INVALID_ARGUMENT, client.unified_decode, [UnifiedBatchItem(live.cache_id, [], 5, True)])
    expect(C.FAILED_PRECONDITION, client.unified_decode, [UnifiedBatchItem(live.cache_id, [1], 0, True)])


def test_forward_and_verify_bad_inputs(client, stub, live):
    expect(C.INVALID_ARGUMENT, client.forward, [])
    expect(C.INVALID_ARGUMENT, client.forward, [5], output="token_logprobs")
    expect(C.OUT_OF_RANGE, client.forward, [1] * 513)
    raw(C.INVALID_ARGUMENT, stub.Forward, pb.ForwardRequest(input_ids=[1], output=42))
    raw(C.INVALID_ARGUMENT, stub.Forward, pb.ForwardRequest(input_ids=[1], dtype=pb.DATA_TYPE_INT8))
    expect(C.INVALID_ARGUMENT, client.forward_verify, live, [])
    expect(C.FAILED_PRECONDITION, client.forward_verify, KvCacheHandle(live.cache_id, 2), [1, 2])
    raw(C.INVALID_ARGUMENT, stub.ForwardVerify, pb.ForwardVerifyRequest(tokens=[1]))


def test_truncate_bad_inputs(client, stub, live):
    err = expect(C.OUT_OF_RANGE, client.truncate_kv, live, 6)
    assert err.metadata["cache_length"] == "5"
    expect(C.NOT_FOUND, client.truncate_kv, "unknown-cache", 1)
    raw(C.INVALID_ARGUMENT, stub.TruncateKv, pb.TruncateKvRequest(new_length=1))
    # Idempotent: to the current length, and the same truncation twice.
    assert client.truncate_kv(live, 5).freed_blocks == 0
    assert client.truncate_kv(live, 3).kv_cache.sequence_length == 3
    assert client.truncate_kv(live, 3).freed_blocks == 0


def test_undecodable_request_bytes(paged_server):
    with grpc.insecure_channel(paged_server.address) as channel:
        call = channel.unary_unary("/modelexec.v1.ModelExecutorService/Prefill")  # raw bytes in and out
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff not a protobuf", timeout=10)
    assert info.value.code() == C.INVALID_ARGUMENT


def test_shutdown_is_refused_unless_allowed(client):
    expect(C.PERMISSION_DENIED, client.shutdown)
    assert client.info().vocab_size == 256


def test_kv_exhaustion_leaves_other_sequences_intact(make_server):
    from client import ExecutorClient

    running = make_server(num_blocks=8)  # 32 tokens at block size 4
    with ExecutorClient(running.address) as c:
        keep_tokens = [9, 8, 7, 6, 5, 4]
        keep = c.prefill(PrefillInput(keep_tokens)).kv_cache  # 2 blocks
        err = expect(C.RESOURCE_EXHAUSTED, c.prefill, PrefillInput(list(range(30))))  # needs 8
        assert err.reason == "KV_CACHE_EXHAUSTED"
        assert (err.blocks_needed, err.blocks_free) == (8, 6)
        # All or nothing: the first two prompts would fit (3 blocks each), the third would not.
        err = expect(C.RESOURCE_EXHAUSTED, c.batch_prefill, [PrefillInput([1] * 12)] * 3)
        assert (err.blocks_needed, err.blocks_free) == (9, 6)
        kv = c.status().kv_pool
        assert (kv.used_blocks, kv.free_blocks, kv.active_caches) == (2, 6, 1)
        assert kv.allocation_failures == 2
        step = c.decode(DecodeInput(3, keep))  # the survivor is untouched
        np.testing.assert_allclose(step.logits.logits, MODEL.last_logits(keep_tokens + [3]), atol=1e-5)
        c.release_cache(step.kv_cache)
        # And the pool recovers completely.
        big = c.prefill(PrefillInput(list(range(32))))
        assert c.status().kv_pool.free_blocks == 0
        c.release_cache(big.kv_cache)
        assert c.status().kv_pool.free_blocks == 8


def test_request_limits(make_server):
    from client import ExecutorClient

    running = make_server(max_tokens_per_request=100, max_batch_size=4, max_message_bytes=4096)
    with ExecutorClient(running.address) as c:
        limits = c.capabilities().limits
        assert (limits.max_tokens_per_request, limits.max_batch_size, limits.max_message_bytes) == (100, 4, 4096)
        expect(C.INVALID_ARGUMENT, c.prefill, PrefillInput([1] * 101))
        expect(C.INVALID_ARGUMENT, c.batch_prefill, [PrefillInput([1])] * 5)
        expect(C.RESOURCE_EXHAUSTED, c.prefill, PrefillInput([1], metadata={"blob": "x" * 8000}))  # over 4 KiB
        assert c.prefill(PrefillInput([1] * 100)).kv_cache.sequence_length == 100


def test_server_still_serves_and_pool_is_exact_after_all_that(client):
    out = client.prefill(PrefillInput([4, 5, 6]))
    np.testing.assert_allclose(out.logits.logits, MODEL.last_logits([4, 5, 6]), atol=1e-5)
    client.release_cache(out.kv_cache)
    kv = client.status().kv_pool
    assert kv.active_caches == 0 and kv.free_blocks == kv.total_blocks


@pytest.mark.parametrize(
    "meta, field",
    [
        ({"ferrum_require_full_logits": "yes"}, "input.metadata.ferrum_require_full_logits"),
        ({"ferrum_kv_capacity_hint": -3}, "input.metadata.ferrum_kv_capacity_hint"),
        ({"ferrum_kv_capacity_hint": 2.5}, "input.metadata.ferrum_kv_capacity_hint"),
        ({"ferrum_lora_adapter": ""}, "input.metadata.ferrum_lora_adapter"),
        ({"ferrum_lora_path": "/adapters/a"}, "input.metadata.ferrum_lora_path"),
        ({f"k{i}": i for i in range(65)}, "input.metadata"),
        ({"x" * 129: 1}, "input.metadata"),
    ],
    ids=["bool_as_string", "negative_hint", "fractional_hint", "lora_empty_name", "lora_path_alone", "too_many",
         "long_key"],
)
def test_metadata_types_are_checked(client, meta, field):
    err = expect(C.INVALID_ARGUMENT, client.prefill, PrefillInput([1], metadata=meta))
    assert err.metadata["field"] == field


def test_well_typed_metadata_is_accepted(client):
    meta = {"ferrum_require_full_logits": True, "ferrum_kv_capacity_hint": 64, "trace": {"a": [1, "b", None]}}
    out = client.prefill(PrefillInput([1, 2], metadata=meta))
    client.release_cache(out.kv_cache)
