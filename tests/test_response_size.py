"""A response over max_message_bytes is refused before its call runs, so it changes nothing.

gRPC refuses to send an oversized message only once it is built, when a step has appended
its tokens already. The server bounds each response from its request
(service/response_size.py): the bound must never be below the response's real size, and a
step refused on it must leave every cache, the pool and a retry as they were.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from client import (
    DecodeInput,
    ExecutorClient,
    ExecutorError,
    KvCacheHandle,
    LogitsPolicy,
    PrefillInput,
    UnifiedBatchItem,
)
from executors import types as t
from generated.modelexec.v1 import executor_pb2 as pb
from generated.modelexec.v1 import executor_pb2_grpc as pb_grpc
from service import convert
from service.response_size import ResponseBudget

rng = np.random.default_rng(23)


def budget_of(c: ExecutorClient, limit: int) -> ResponseBudget:
    info, caps = c.info(), c.capabilities()
    return ResponseBudget(limit, info.vocab_size, info.hidden_size, caps.kv_block_size, info.max_sequence_length,
                          c.status().kv_pool.total_blocks)


def random_policy(vocab: int) -> pb.LogitsPolicy:
    kind = rng.integers(0, 5)
    if kind == 0:
        return pb.LogitsPolicy()  # FULL float32 by default
    if kind == 1:
        return pb.LogitsPolicy(full=pb.FullLogits(dtype=pb.DATA_TYPE_BFLOAT16))
    if kind == 2:
        return pb.LogitsPolicy(top_k=pb.TopKLogprobs(k=int(rng.integers(1, vocab + 1))))
    top = int(rng.integers(0, vocab + 1)) if rng.integers(0, 2) else 0  # the most likely ids with the token
    if kind == 3:
        return pb.LogitsPolicy(argmax=pb.ArgmaxToken(top_logprobs=top))
    return pb.LogitsPolicy(sample=pb.SampleToken(temperature=0.7, seed=5, top_logprobs=top))


def cache_id() -> str:
    return "c" * int(rng.integers(1, 129))  # up to the longest id a cache may have


def test_the_bound_is_never_below_the_real_response(paged_server, client):
    """Every stepping call, with every policy and ids up to their longest: bound >= bytes sent."""
    vocab = client.info().vocab_size
    budget = budget_of(client, 2**31 - 1)
    slack = []
    with grpc.insecure_channel(paged_server.address) as channel:
        stub = pb_grpc.ModelExecutorServiceStub(channel)

        def sent(bound: int, response) -> None:
            assert bound >= response.ByteSize(), (bound, response.ByteSize())
            slack.append(bound - response.ByteSize())

        for _ in range(6):
            prompts = [pb.PrefillInput(input_ids=rng.integers(0, vocab, int(rng.integers(1, 40))).tolist(),
                                       kv_cache=pb.KvCacheHandle(cache_id=cache_id()), logits_policy=random_policy(vocab))
                       for _ in range(int(rng.integers(1, 5)))]
            request = pb.BatchPrefillRequest(inputs=prompts)
            done = stub.BatchPrefill(request)
            sent(budget.prefills([convert.prefill_input(m, "inputs") for m in request.inputs]), done)
            anonymous = pb.PrefillRequest(input=pb.PrefillInput(input_ids=[1, 2, 3], logits_policy=random_policy(vocab)))
            first = stub.Prefill(anonymous)  # a server-chosen id
            sent(budget.prefills([convert.prefill_input(anonymous.input, "input")]), first)
            handles = [o.kv_cache for o in done.outputs] + [first.output.kv_cache]

            decodes = pb.BatchDecodeRequest(inputs=[pb.DecodeInput(token_id=7, kv_cache=h, logits_policy=random_policy(vocab))
                                                    for h in handles])
            stepped = stub.BatchDecode(decodes)
            sent(budget.decodes([convert.decode_input(m, "inputs") for m in decodes.inputs]), stepped)
            handles = [o.kv_cache for o in stepped.outputs]

            items = [pb.UnifiedBatchItem(seq_id=h.cache_id, q_tokens=rng.integers(0, vocab, int(rng.integers(1, 9))).tolist(),
                                         pos_offset=h.block_table.sequence_length, is_final_chunk=bool(rng.integers(0, 2)),
                                         logits_policy=random_policy(vocab)) for h in handles]
            unified = pb.UnifiedDecodeRequest(batch=pb.UnifiedBatch(items=items))
            stepped = stub.UnifiedDecode(unified)
            sent(budget.unified([convert.unified_item(m, "items") for m in items]), stepped)

            target = stepped.results[0].kv_cache
            verify = pb.ForwardVerifyRequest(kv_cache=target, tokens=rng.integers(0, vocab, 12).tolist(),
                                             logits_policy=random_policy(vocab))
            sent(budget.verify(convert.verify_handle(verify), len(verify.tokens),
                               convert.logits_policy(verify.logits_policy, "logits_policy")), stub.ForwardVerify(verify))
            for h in stub.ListCaches(pb.ListCachesRequest()).caches:
                stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=h.cache_id))

        for output, kind in ((pb.FORWARD_OUTPUT_LOGITS, t.ForwardKind.LOGITS),
                             (pb.FORWARD_OUTPUT_HIDDEN_STATES, t.ForwardKind.HIDDEN_STATES),
                             (pb.FORWARD_OUTPUT_TOKEN_LOGPROBS, t.ForwardKind.TOKEN_LOGPROBS)):
            for dtype, d in ((pb.DATA_TYPE_FLOAT32, t.DType.FLOAT32), (pb.DATA_TYPE_BFLOAT16, t.DType.BFLOAT16)):
                request = pb.ForwardRequest(input_ids=[3, 1, 4, 1, 5], output=output, dtype=dtype)
                sent(budget.forward(5, kind, d), stub.Forward(request))
    # Generous framing, not a second copy: ~1.5 KB at most for these calls of up to 12 rows.
    assert max(slack) < 2048, max(slack)


def refused(fn, *args) -> ExecutorError:
    with pytest.raises(ExecutorError) as info:
        fn(*args)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    assert info.value.reason == "RESPONSE_TOO_LARGE"
    assert "max_message_bytes" in info.value.details_message
    return info.value


def test_a_step_refused_for_its_response_size_changes_nothing(make_server):
    running = make_server(max_message_bytes=16384)  # 12 rows of float32 logits over 256 tokens: 12 KiB
    with ExecutorClient(running.address, timeout=30) as c:
        held = c.prefill(PrefillInput([1, 2, 3, 4, 5], KvCacheHandle("held", 0),
                                      logits_policy=LogitsPolicy.argmax())).kv_cache
        before = c.status().kv_pool

        refused(c.forward_verify, held, list(range(20)))  # 20 rows of FULL float32 logits: ~21 KiB
        refused(c.forward_verify, held, list(range(20)))  # the retry: refused alike, not replayed wrong
        assert c.status().kv_pool == before
        # The caller's handle is still good, and the same verify fits in TOP_K form.
        out = c.forward_verify(held, list(range(20)), LogitsPolicy.top_k(4))
        assert out.kv_cache.sequence_length == 25
        c.truncate_kv(held, 5)

        refused(c.batch_prefill, [PrefillInput([9] * 8) for _ in range(20)])  # one row fits, twenty do not
        refused(c.batch_decode, [DecodeInput(6, held)] * 20)
        refused(c.unified_decode, [UnifiedBatchItem(f"u{i}", [1, 2], 0, True) for i in range(20)])
        refused(c.forward, list(range(20)))
        after = c.status().kv_pool
        assert (after.used_blocks, after.active_caches) == (before.used_blocks, before.active_caches)
        assert [x.cache_id for x in c.list_caches()] == ["held"]

        with c.step_session() as session:  # a refused step is answered in the stream, which goes on
            with pytest.raises(ExecutorError) as info:
                session.step([UnifiedBatchItem(f"s{i}", [1, 2], 0, True) for i in range(20)])
            assert info.value.reason == "RESPONSE_TOO_LARGE"
            [ok] = session.step([UnifiedBatchItem("held", [7], 5, True, logits_policy=LogitsPolicy.argmax())])
            assert ok.kv_cache.sequence_length == 6
        c.release_cache("held")
        assert c.status().kv_pool.free_blocks == before.total_blocks
