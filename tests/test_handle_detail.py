"""Compact handles (HandleDetail): a stepping call may ask for its handles without block ids.

A handle's block ids grow with its cache; at long contexts they cost more to send on every
step than the step itself. With HANDLE_DETAIL_COMPACT every other field stays, held_blocks
still counts the blocks, and the response bound leaves the ids out; requests the client
sends carry only what the executor reads of a handle (id and length).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from client import (
    AsyncExecutorClient,
    DecodeInput,
    ExecutorClient,
    ExecutorError,
    KvCacheHandle,
    LogitsPolicy,
    PrefillInput,
    UnifiedBatchItem,
    convert,
)
from client.scheduler import Scheduler
from generated.modelexec.v1 import executor_pb2 as pb
from generated.modelexec.v1 import executor_pb2_grpc as pb_grpc
from tests.test_scheduler import Recording, plain, pool_is_clean

ARGMAX = LogitsPolicy.argmax()
BLOCK = 4


def blocks(length: int) -> int:
    return -(-length // BLOCK)


def check(handle: KvCacheHandle, length: int, compact: bool) -> None:
    assert handle.sequence_length == length and handle.held_blocks == blocks(length), handle
    assert handle.block_size == BLOCK and handle.num_layers > 0 and handle.head_dim > 0, handle
    assert len(handle.block_ids) == (0 if compact else blocks(length)), handle


@pytest.mark.parametrize("compact", [True, False])
def test_every_stepping_call_returns_the_handles_asked_for(make_server, compact):
    server = make_server(block_size=BLOCK)
    with ExecutorClient(server.address, compact_handles=compact) as c:
        first = c.prefill(PrefillInput(list(range(1, 11)), logits_policy=ARGMAX)).kv_cache
        check(first, 10, compact)
        check(c.decode(DecodeInput(5, first, logits_policy=ARGMAX)).kv_cache, 11, compact)
        more = c.batch_prefill([PrefillInput([3] * 9, logits_policy=ARGMAX), PrefillInput([4] * 2, logits_policy=ARGMAX)])
        for out, n in zip(more, (9, 2)):
            check(out.kv_cache, n, compact)
        stepped = c.batch_decode([DecodeInput(1, o.kv_cache, logits_policy=ARGMAX) for o in more])
        for out, n in zip(stepped, (10, 3)):
            check(out.kv_cache, n, compact)
        [unified] = c.unified_decode([UnifiedBatchItem(first.cache_id, [7, 8], 11, True, logits_policy=ARGMAX)])
        check(unified.kv_cache, 13, compact)
        verified = c.forward_verify(unified.kv_cache, [1, 2, 3], ARGMAX)
        check(verified.kv_cache, 16, compact)
        with c.step_session() as session:
            [step] = session.step([UnifiedBatchItem(first.cache_id, [9], 16, True, logits_policy=ARGMAX)])
            check(step.kv_cache, 17, compact)
        # The other way round, call by call and session by session.
        [other] = c.unified_decode([UnifiedBatchItem(first.cache_id, [9], 17, True, logits_policy=ARGMAX)],
                                   compact_handles=not compact)
        check(other.kv_cache, 18, not compact)
        with c.step_session(compact_handles=not compact) as session:
            [step] = session.step([UnifiedBatchItem(first.cache_id, [9], 18, True, logits_policy=ARGMAX)])
            check(step.kv_cache, 19, not compact)
        for h in c.list_caches():
            c.release_cache(h.cache_id)
        pool_is_clean(c)


def test_the_async_client_asks_alike(make_server):
    server = make_server(block_size=BLOCK)

    async def run():
        async with AsyncExecutorClient(server.address, compact_handles=True) as c:
            h = (await c.prefill(PrefillInput([1] * 6, logits_policy=ARGMAX))).kv_cache
            check(h, 6, True)
            [out] = await c.batch_decode([DecodeInput(2, h, logits_policy=ARGMAX)], compact_handles=False)
            check(out.kv_cache, 7, False)
            async with c.step_session() as session:
                [step] = await session.step([UnifiedBatchItem(h.cache_id, [3], 7, True, logits_policy=ARGMAX)])
                check(step.kv_cache, 8, True)
            await c.release_cache(h)

    asyncio.run(asyncio.wait_for(run(), 30))


def test_compact_is_smaller_on_the_wire_and_the_same_otherwise(make_server):
    """The same step asked both ways, through the generated stub (its retry is answered from
    the record): the compact answer is the full one without the block ids."""
    server = make_server(block_size=BLOCK)
    with ExecutorClient(server.address) as c:
        h = c.prefill(PrefillInput(list(range(40)), KvCacheHandle("long", 0), logits_policy=ARGMAX)).kv_cache
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ModelExecutorServiceStub(channel)
        batch = pb.UnifiedBatch(items=[pb.UnifiedBatchItem(seq_id="long", q_tokens=[3], pos_offset=40, is_final_chunk=True,
                                                           logits_policy=pb.LogitsPolicy(argmax=pb.ArgmaxToken()))])
        full = stub.UnifiedDecode(pb.UnifiedDecodeRequest(batch=batch, handle_detail=pb.HANDLE_DETAIL_FULL))
        compact = stub.UnifiedDecode(pb.UnifiedDecodeRequest(batch=batch, handle_detail=pb.HANDLE_DETAIL_COMPACT))
        unset = stub.UnifiedDecode(pb.UnifiedDecodeRequest(batch=batch))
    assert list(full.results[0].kv_cache.block_table.block_ids)[:10] == list(h.block_ids)
    assert len(full.results[0].kv_cache.block_table.block_ids) == 11 == full.results[0].kv_cache.block_table.held_blocks
    assert unset.results[0] == full.results[0]
    expected = pb.UnifiedItemResult()
    expected.CopyFrom(full.results[0])
    del expected.kv_cache.block_table.block_ids[:]
    assert compact.results[0] == expected
    assert compact.ByteSize() < full.ByteSize() - 11


def test_an_unknown_handle_detail_is_refused_and_runs_nothing(make_server):
    server = make_server(block_size=BLOCK)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ModelExecutorServiceStub(channel)
        request = pb.PrefillRequest(input=pb.PrefillInput(input_ids=[1, 2, 3]), handle_detail=7)
        with pytest.raises(grpc.RpcError) as info:
            stub.Prefill(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "handle_detail 7 is not a HandleDetail" in info.value.details()
        session = stub.StepSession(iter([pb.StepSessionRequest(step_id=4, handle_detail=9, batch=pb.UnifiedBatch(
            items=[pb.UnifiedBatchItem(seq_id="s", q_tokens=[1], is_final_chunk=True)]))]))
        [answer] = list(session)
        assert answer.step_id == 4 and answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert answer.error.metadata["field"] == "handle_detail"
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_requests_send_back_only_the_id_and_length_of_a_handle():
    handle = KvCacheHandle("c", 9, (5, 6, 7), 4, 2, 2, 8, "cpu")
    for request in (convert.decode_request(DecodeInput(1, handle)).input.kv_cache,
                    convert.prefill_request(PrefillInput([1], handle)).input.kv_cache,
                    convert.forward_verify_request(handle, [1, 2]).kv_cache):
        assert request == pb.KvCacheHandle(cache_id="c", block_table=pb.BlockTable(sequence_length=9))
    assert convert.batch_decode_request([DecodeInput(1, handle)]).handle_detail == pb.HANDLE_DETAIL_UNSPECIFIED
    assert convert.batch_decode_request([DecodeInput(1, handle)], compact=True).handle_detail == pb.HANDLE_DETAIL_COMPACT


def test_the_response_bound_leaves_out_the_ids_of_compact_handles(make_server):
    """A 1024-byte message limit and 1-token blocks: a 500-token cache's ids (~1 KB) cannot pass
    it, so a full step is refused before it runs (RESPONSE_TOO_LARGE), and a compact one runs."""
    server = make_server(block_size=1, num_blocks=2048, max_message_bytes=1024)
    with ExecutorClient(server.address, compact_handles=True) as c:
        h = c.prefill(PrefillInput([2] * 500, logits_policy=ARGMAX)).kv_cache
        assert h.held_blocks == 500 and h.block_ids == ()
        with pytest.raises(ExecutorError) as info:
            c.decode(DecodeInput(3, h, logits_policy=ARGMAX), compact_handles=False)
        assert info.value.reason == "RESPONSE_TOO_LARGE"
        assert c.decode(DecodeInput(3, h, logits_policy=ARGMAX)).kv_cache.sequence_length == 501
        c.release_cache(h)


def test_the_scheduler_asks_for_compact_handles(make_server):
    """A prompt whose full handles would not pass the server's message limit runs through the
    scheduler (in chunks, then decodes), with the tokens of a plain greedy loop."""
    server = make_server(block_size=1, num_blocks=2048, max_message_bytes=1024)
    prompt = [(7 * i) % 256 for i in range(500)]
    with ExecutorClient(server.address, compact_handles=True) as c:
        expected = plain(c, prompt, 5)

    async def run():
        client = Recording(server.address)
        async with Scheduler(client, max_num_batched_tokens=256, max_num_seqs=4) as sched:
            return await sched.submit(prompt, max_tokens=5).result(), client.batches

    out, batches = asyncio.run(asyncio.wait_for(run(), 60))
    assert (out.finish_reason, out.token_ids) == ("length", expected)
    assert len(batches) == 2 + 4  # two chunks, then a decode for each token after the first
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)
