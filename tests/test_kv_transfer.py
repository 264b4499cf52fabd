"""ExportKv / ImportKv / ListCaches between two real servers of the paged reference executor.

A moved cache must continue exactly as the original (bitwise: same dtype, same device
kind), whatever the receiver's block size; every refusal must leave both pools exactly as
they were; a retried import must not undo its own success.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
import pytest

from client import (
    AlreadyExistsError,
    AsyncExecutorClient,
    DataLossError,
    DeadlineExceededError,
    DecodeInput,
    ExecutorClient,
    FailedPreconditionError,
    InvalidArgumentError,
    LogitsPolicy,
    NotFoundError,
    OutOfRangeError,
    PrefillInput,
    ResourceExhaustedError,
)
from client.transfer import move_cache
from generated.modelexec.v1 import executor_pb2 as pb
from tests.conftest import PAGED_TEST_CONFIG, start_server

FULL = LogitsPolicy.full()
PROMPT = list(range(3, 40))  # 37 tokens: several blocks, the last partly filled


@pytest.fixture(scope="module")
def servers():
    """A (block size 4), B (block size 8), C (another model: head_dim 16)."""
    from executors.paged import PagedAttentionExecutor, PagedExecutorConfig

    a = start_server(PAGED_TEST_CONFIG)
    b = start_server(replace(PAGED_TEST_CONFIG, block_size=8))
    c = start_server(PAGED_TEST_CONFIG, PagedAttentionExecutor(PagedExecutorConfig(head_dim=16, block_size=4)))
    yield a, b, c
    for s in (a, b, c):
        s.stop()


@pytest.fixture
def clients(servers):
    cs = [ExecutorClient(s.address, timeout=30) for s in servers]
    yield cs
    for c in cs:
        for info in c.list_caches():
            c.release_cache(info.cache_id)
        wait_all_free(c)
        c.close()


def wait_all_free(c: ExecutorClient) -> None:
    """Every block back in the pool (clean-up of a failed import is queued on the worker)."""
    for _ in range(100):
        pool = c.status().kv_pool
        if pool.used_blocks == 0:
            break
        time.sleep(0.02)
    pool = c.status().kv_pool
    assert (pool.used_blocks, pool.active_caches) == (0, 0), pool


def logits(out) -> np.ndarray:
    return out.logits.logits


def test_a_moved_cache_continues_bitwise_like_the_original_whatever_the_block_size(clients):
    a, b, _ = clients
    orig = a.prefill(PrefillInput(PROMPT, logits_policy=FULL)).kv_cache
    for target, target_id in ((a, "same-size"), (b, "other-size")):
        moved = target.import_kv(a.export_kv(orig, max_chunk_bytes=700), target_id)
        assert (moved.kv_cache.cache_id, moved.kv_cache.sequence_length, moved.imported_tokens) == (
            target_id, len(PROMPT), len(PROMPT))
        assert not moved.replayed
        ho, hm = orig, moved.kv_cache
        for tok in (5, 77, 200):  # a few steps on each: identical logits every time
            do = a.decode(DecodeInput(tok, ho, logits_policy=FULL))
            dm = target.decode(DecodeInput(tok, hm, logits_policy=FULL))
            np.testing.assert_array_equal(logits(do), logits(dm))
            ho, hm = do.kv_cache, dm.kv_cache
        vo = a.forward_verify(ho, [9, 10, 11], FULL)
        vm = target.forward_verify(hm, [9, 10, 11], FULL)
        for x, y in zip(vo.outputs, vm.outputs):
            np.testing.assert_array_equal(x.logits, y.logits)
        to = a.truncate_kv(vo.kv_cache, len(PROMPT) + 1)
        tm = target.truncate_kv(vm.kv_cache, len(PROMPT) + 1)
        np.testing.assert_array_equal(logits(a.decode(DecodeInput(42, to.kv_cache, logits_policy=FULL))),
                                      logits(target.decode(DecodeInput(42, tm.kv_cache, logits_policy=FULL))))
        assert target.release_cache(target_id).released
        orig = a.truncate_kv(orig.cache_id, len(PROMPT)).kv_cache
    assert a.release_cache(orig).released


def test_the_export_is_a_snapshot_and_the_stream_is_described_first(clients):
    a, b, _ = clients
    h = a.prefill(PrefillInput(PROMPT, logits_policy=FULL)).kv_cache
    stream = a.export_kv(h, start=0, end=20, max_chunk_bytes=300)
    first = next(stream)
    d = first.description
    assert (d.cache_id, d.start_position, d.end_position, d.cache_length, d.block_size) == (h.cache_id, 0, 20, 37, 4)
    assert list(d.token_ids) == PROMPT[:20] and d.fingerprint.kv_dtype == pb.DATA_TYPE_FLOAT32
    assert len(d.fingerprint.weights_digest) == 64 and d.fingerprint.device_type == pb.DEVICE_TYPE_CPU
    # The source is truncated and rewritten while the stream is read: the stream does not change.
    a.truncate_kv(h, 2)
    a.prefill(PrefillInput([250] * 30, kv_cache=replace(h, sequence_length=2), logits_policy=FULL))
    chunks = [m.chunk for m in stream]
    assert len(chunks) == d.num_chunks and sum(len(c.key) + len(c.value) for c in chunks) == d.total_bytes
    assert max(len(c.key) + len(c.value) for c in chunks) <= 300  # one layer of one position is 256 bytes
    moved = b.import_kv([first, *(pb.ExportKvResponse(chunk=c) for c in chunks)], "snap")
    fresh = b.prefill(PrefillInput(PROMPT[:21], logits_policy=FULL))
    step = b.decode(DecodeInput(PROMPT[20], moved.kv_cache, logits_policy=FULL))
    np.testing.assert_array_equal(logits(step), logits(fresh))
    assert all(c.position_start // 4 == (c.position_start + c.position_count - 1) // 4 for c in chunks)


def test_a_retried_import_is_replayed_and_an_extension_continues_a_cache(clients):
    a, b, _ = clients
    h = a.prefill(PrefillInput(PROMPT, logits_policy=FULL)).kv_cache
    first = b.import_kv(a.export_kv(h), "twice")
    again = b.import_kv(a.export_kv(h, max_chunk_bytes=200), "twice")  # chunked otherwise: the same import
    assert again.replayed and again.kv_cache == first.kv_cache and again.imported_tokens == 0
    assert b.status().kv_pool.used_blocks == -(-len(PROMPT) // 8)
    with pytest.raises(AlreadyExistsError):
        b.import_kv(a.export_kv(h, end=10), "twice")
    # Two steps on the source, then only their tail moves.
    h2 = a.decode(DecodeInput(7, h, logits_policy=FULL)).kv_cache
    h3 = a.decode(DecodeInput(8, h2, logits_policy=FULL)).kv_cache
    ext = b.import_kv(a.export_kv(h3, start=len(PROMPT)), "twice")
    assert (ext.kv_cache.sequence_length, ext.imported_tokens) == (len(PROMPT) + 2, 2)
    np.testing.assert_array_equal(logits(a.decode(DecodeInput(9, h3, logits_policy=FULL))),
                                  logits(b.decode(DecodeInput(9, ext.kv_cache, logits_policy=FULL))))
    # A tail that does not continue the target is refused, and the target is untouched.
    with pytest.raises(FailedPreconditionError) as e:
        b.import_kv(a.export_kv(h3.cache_id, start=len(PROMPT)), "twice")
    assert e.value.reason == "STALE_CACHE_HANDLE"
    with pytest.raises(InvalidArgumentError):
        b.import_kv(a.export_kv(h3.cache_id, start=5), None)
    with pytest.raises(NotFoundError):
        b.import_kv(a.export_kv(h3.cache_id, start=5), "nowhere")
    assert b.list_caches(["twice"])[0].sequence_length == len(PROMPT) + 3


def test_imported_blocks_join_the_receivers_prefix_cache(clients):
    a, b, _ = clients
    h = a.prefill(PrefillInput(PROMPT, logits_policy=FULL)).kv_cache
    b.import_kv(a.export_kv(h), "seed")
    before = b.cache_metrics().saved_prefill_tokens
    out = b.prefill(PrefillInput(PROMPT + [1], logits_policy=FULL))
    assert b.cache_metrics().saved_prefill_tokens - before == 32  # four full blocks of 8
    np.testing.assert_array_equal(logits(out), logits(a.decode(DecodeInput(1, h, logits_policy=FULL))))


def test_list_caches_and_a_conditional_release(clients):
    a, _, _ = clients
    assert a.capabilities().supports_kv_transfer
    h = a.prefill(PrefillInput(PROMPT[:9], kv_cache=None, logits_policy=FULL)).kv_cache
    infos = {i.cache_id: i for i in a.list_caches()}
    assert infos[h.cache_id].sequence_length == 9 and infos[h.cache_id].num_blocks == 3
    assert [i.cache_id for i in a.list_caches([h.cache_id, "no-such-cache"])] == [h.cache_id]
    with pytest.raises(FailedPreconditionError) as e:
        a.release_cache(h, expected_length=8)
    assert (e.value.reason, e.value.metadata["cache_length"]) == ("STALE_CACHE_HANDLE", "9")
    assert a.release_cache(h, expected_length=9).released
    assert not a.release_cache(h, expected_length=9).released  # idempotent


def test_refusals_leave_both_pools_exactly_as_they_were(clients, servers):
    a, b, c = clients
    h = a.prefill(PrefillInput(PROMPT, logits_policy=FULL)).kv_cache
    stream = list(a.export_kv(h, max_chunk_bytes=300))
    used_a = a.status().kv_pool.used_blocks

    with pytest.raises(FailedPreconditionError) as e:  # another model
        c.import_kv(stream, "x")
    assert e.value.reason == "KV_FINGERPRINT_MISMATCH" and "head_dim" in str(e.value)
    other_dtype = pb.ExportKvResponse()
    other_dtype.CopyFrom(stream[0])
    other_dtype.description.fingerprint.kv_dtype = pb.DATA_TYPE_BFLOAT16
    with pytest.raises(FailedPreconditionError, match="kv_dtype is BFLOAT16 in the stream but FLOAT32 here"):
        b.import_kv([other_dtype, *stream[1:]], "x")

    bad = pb.ExportKvResponse()
    bad.CopyFrom(stream[5])
    bad.chunk.key = bytes([bad.chunk.key[0] ^ 1]) + bad.chunk.key[1:]
    with pytest.raises(DataLossError) as e:
        b.import_kv([*stream[:5], bad, *stream[6:]], "x")
    assert e.value.reason == "KV_CHUNK_CHECKSUM"
    with pytest.raises(DataLossError) as e:
        b.import_kv(stream[:-1], "x")
    assert e.value.reason == "KV_STREAM_SHORT"
    with pytest.raises(DataLossError) as e:
        b.import_kv([stream[0], *stream[2:]], "x")
    assert e.value.reason == "KV_CHUNK_OUT_OF_ORDER"
    with pytest.raises(InvalidArgumentError):
        b.import_kv(stream[1:], "x")  # no description first
    with pytest.raises(InvalidArgumentError):
        b.import_kv(stream, "not a valid id!")
    with pytest.raises(OutOfRangeError):
        list(a.export_kv(h, end=len(PROMPT) + 1))
    with pytest.raises(NotFoundError):
        list(a.export_kv("no-such-cache"))
    wait_all_free(b)
    assert "x" not in {i.cache_id for i in b.list_caches()}
    assert a.status().kv_pool.used_blocks == used_a


def test_no_room_is_refused_up_front_with_the_blocks_needed(make_server, clients):
    a = clients[0]
    small = make_server(num_blocks=4)  # 16 tokens of room
    h = a.prefill(PrefillInput(PROMPT, logits_policy=FULL)).kv_cache
    with ExecutorClient(small.address, timeout=30) as s:
        with pytest.raises(ResourceExhaustedError) as e:
            s.import_kv(a.export_kv(h), "big")
        assert e.value.metadata["blocks_needed"] == str(-(-len(PROMPT) // 4))
        wait_all_free(s)


def test_a_cancelled_or_expired_import_creates_nothing(servers, clients):
    a, b, _ = clients
    h = a.prefill(PrefillInput(PROMPT, logits_policy=FULL)).kv_cache
    stream = list(a.export_kv(h, max_chunk_bytes=300))

    async def drive() -> None:
        async with AsyncExecutorClient(servers[1].address) as cb:
            async def stalled():
                for m in stream[:4]:
                    yield m
                await asyncio.sleep(30)

            with pytest.raises(DeadlineExceededError):
                await cb.import_kv(stalled(), "stalled", timeout=1.0)
            task = asyncio.ensure_future(cb.import_kv(stalled(), "cancelled"))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(drive())
    wait_all_free(b)


def test_move_cache_keeps_up_with_a_cache_that_is_decoding_meanwhile(servers, clients):
    a, b, _ = clients

    async def drive() -> tuple[list, object]:
        async with AsyncExecutorClient(servers[0].address) as ca, AsyncExecutorClient(servers[1].address) as cb:
            h = (await ca.prefill(PrefillInput(PROMPT, kv_cache=None, logits_policy=FULL))).kv_cache
            tokens, steps = [], 0

            async def decoding():
                nonlocal h, steps
                while steps < 6:
                    try:
                        out = await ca.decode(DecodeInput(11 + steps, h, logits_policy=FULL))
                    except NotFoundError:  # released at the source: it lives on the target now
                        return
                    h, steps = out.kv_cache, steps + 1
                    tokens.append(11 + steps - 1)
                    await asyncio.sleep(0)

            dec = asyncio.ensure_future(decoding())
            await asyncio.sleep(0)
            moved = await move_cache(ca, cb, h.cache_id, max_chunk_bytes=256)
            await dec
            return tokens, moved

    tokens, moved = asyncio.run(drive())
    assert moved.kv_cache.sequence_length == len(PROMPT) + len(tokens)
    assert b.list_caches([moved.kv_cache.cache_id])[0].sequence_length == len(PROMPT) + len(tokens)
    reference = b.prefill(PrefillInput(PROMPT + tokens + [3], logits_policy=FULL))
    step = b.decode(DecodeInput(3, moved.kv_cache, logits_policy=FULL))
    np.testing.assert_array_equal(logits(step), logits(reference))
    assert a.list_caches() == []


def test_a_cancelled_export_lets_its_snapshot_go(servers, clients):
    a = clients[0]
    h = a.prefill(PrefillInput(PROMPT, logits_policy=FULL)).kv_cache

    async def drive() -> None:
        async with AsyncExecutorClient(servers[0].address) as ca:
            stream = ca.export_kv(h.cache_id, max_chunk_bytes=64)
            await anext(stream)
            await anext(stream)
            await stream.aclose()  # cancels the call mid-stream

    asyncio.run(drive())
    a.release_cache(h)
    wait_all_free(a)  # a pin left behind would keep the blocks used


def test_caches_move_under_their_owners_identity(make_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice tok-alice\nbob tok-bob\n")
    src, dst = make_server(auth_token_file=str(tokens)), make_server(auth_token_file=str(tokens))
    with ExecutorClient(src.address, token="tok-alice") as alice, ExecutorClient(src.address, token="tok-bob") as bob, \
            ExecutorClient(dst.address, token="tok-alice") as alice_dst, \
            ExecutorClient(dst.address, token="tok-bob") as bob_dst:
        h = alice.prefill(PrefillInput(PROMPT)).kv_cache
        assert [i.cache_id for i in alice.list_caches()] == [h.cache_id] and bob.list_caches() == []
        from client import PermissionDeniedError

        with pytest.raises(PermissionDeniedError):
            list(bob.export_kv(h))
        moved = alice_dst.import_kv(alice.export_kv(h), "mine").kv_cache
        assert bob_dst.list_caches() == [] and [i.cache_id for i in alice_dst.list_caches()] == ["mine"]
        with pytest.raises(PermissionDeniedError):
            bob_dst.decode(DecodeInput(1, moved))
        alice_dst.release_cache(moved)
        alice.release_cache(h)


def test_an_export_that_fails_fails_the_async_import_with_its_own_error(servers, clients):
    async def drive() -> None:
        async with AsyncExecutorClient(servers[0].address) as ca, AsyncExecutorClient(servers[1].address) as cb:
            with pytest.raises(NotFoundError, match="no-such-cache"):
                await cb.import_kv(ca.export_kv("no-such-cache"), "x")
            h = (await ca.prefill(PrefillInput(PROMPT))).kv_cache
            with pytest.raises(OutOfRangeError):
                await cb.import_kv(ca.export_kv(h, end=len(PROMPT) + 5), "x")
            await ca.release_cache(h)

    asyncio.run(drive())
    with pytest.raises(NotFoundError, match="no-such-cache"):
        clients[1].import_kv(clients[0].export_kv("no-such-cache"), "x")
    wait_all_free(clients[1])
