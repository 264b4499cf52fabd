"""feed_sampled_token: a decode step of the token its cache's latest step sampled, and a
StepSession that keeps such steps in flight (send/receive), through a real server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client import (
    AsyncExecutorClient,
    FailedPreconditionError,
    InvalidArgumentError,
    LogitsPolicy,
    NotFoundError,
    UnifiedBatchItem,
)
from tests.paged_reference import PagedModel

MODEL = PagedModel()
PROMPT = [5, 17, 3, 99, 42, 7]


def greedy(tokens: list[int]) -> int:
    return int(np.argmax(MODEL.last_logits(tokens)))


def fed(seq_id: str, pos: int, policy: LogitsPolicy | None = None) -> UnifiedBatchItem:
    return UnifiedBatchItem(seq_id, [], pos, True, logits_policy=policy or LogitsPolicy.argmax(),
                            feed_sampled_token=True)


def test_a_fed_step_runs_the_token_the_latest_step_sampled(client):
    (first,) = client.unified_decode([UnifiedBatchItem("feed-a", PROMPT, 0, True,
                                                       logits_policy=LogitsPolicy.argmax())])
    t1 = first.logits.token_id
    assert t1 == greedy(PROMPT)
    (second,) = client.unified_decode([fed("feed-a", len(PROMPT))])
    assert second.kv_cache.sequence_length == len(PROMPT) + 1
    assert second.logits.token_id == greedy(PROMPT + [t1])
    t2 = second.logits.token_id
    # A retry of the fed step that succeeded is answered from its record: same token, no growth.
    (again,) = client.unified_decode([fed("feed-a", len(PROMPT))])
    assert again.logits.token_id == t2 and again.kv_cache.sequence_length == len(PROMPT) + 1
    # A FULL step returns the logits after the fed token, and leaves no token to feed.
    (third,) = client.unified_decode([fed("feed-a", len(PROMPT) + 1, LogitsPolicy.full())])
    np.testing.assert_allclose(third.logits.logits, MODEL.last_logits(PROMPT + [t1, t2]), atol=1e-5)
    with pytest.raises(FailedPreconditionError) as info:
        client.unified_decode([fed("feed-a", len(PROMPT) + 2)])
    assert info.value.reason == "NO_SAMPLED_TOKEN" and "feed_sampled_token" in str(info.value)
    # A position that does not continue the cache is a stale handle, fed or not.
    with pytest.raises(FailedPreconditionError) as info:
        client.unified_decode([fed("feed-a", 3)])
    assert info.value.reason == "STALE_CACHE_HANDLE"
    # A sampled token feeds too; a truncation takes the token away.
    (sampled,) = client.unified_decode([UnifiedBatchItem("feed-a", [8], len(PROMPT) + 2, True,
                                                         logits_policy=LogitsPolicy.sample(0.7, seed=3))])
    (after,) = client.unified_decode([fed("feed-a", len(PROMPT) + 3, LogitsPolicy.full())])
    np.testing.assert_allclose(after.logits.logits,
                               MODEL.last_logits(PROMPT + [t1, t2, 8, sampled.logits.token_id]), atol=1e-5)
    client.truncate_kv("feed-a", 5)
    client.unified_decode([UnifiedBatchItem("feed-a", [1, 2], 5, False)])  # a chunk: no logits
    with pytest.raises(FailedPreconditionError) as info:
        client.unified_decode([fed("feed-a", 7)])
    assert info.value.reason == "NO_SAMPLED_TOKEN"
    client.release_cache("feed-a")


@pytest.mark.parametrize(("item", "field"), [
    (UnifiedBatchItem("feed-b", [3], 6, True, feed_sampled_token=True), "q_tokens"),
    (UnifiedBatchItem("feed-b", [], 6, False, feed_sampled_token=True), "is_final_chunk"),
    (UnifiedBatchItem("feed-b", [], 0, True, feed_sampled_token=True), "pos_offset"),
    (UnifiedBatchItem("", [], 6, True, feed_sampled_token=True), "seq_id"),
])
def test_malformed_fed_items_are_refused(client, item, field):
    with pytest.raises(InvalidArgumentError) as info:
        client.unified_decode([item])
    assert field in str(info.value)


def test_a_fed_step_on_an_unknown_cache_is_not_found(client):
    with pytest.raises(NotFoundError):
        client.unified_decode([fed("never-made", 4)])


def run_greedy(client, seqs: dict[str, list[int]], steps: int, ahead: int) -> dict[str, list[int]]:
    """`steps` greedy tokens per sequence through one session, `ahead` steps in flight (1: step by step)."""
    tokens = {s: [] for s in seqs}
    with client.step_session() as session:
        if ahead == 1:
            out = session.step([UnifiedBatchItem(s, p, 0, True, logits_policy=LogitsPolicy.argmax())
                                for s, p in seqs.items()])
            for _ in range(steps):
                for r in out:
                    tokens[r.seq_id].append(r.logits.token_id)
                out = session.step([UnifiedBatchItem(r.seq_id, [r.logits.token_id], r.kv_cache.sequence_length, True,
                                                     logits_policy=LogitsPolicy.argmax()) for r in out])
        else:
            session.send([UnifiedBatchItem(s, p, 0, True, logits_policy=LogitsPolicy.argmax()) for s, p in seqs.items()])
            sent = 1
            for i in range(steps):
                while sent < min(i + ahead, steps + 1):  # each fed step continues the one before it
                    session.send([fed(s, len(p) + sent - 1) for s, p in seqs.items()])
                    sent += 1
                for r in session.receive():
                    tokens[r.seq_id].append(r.logits.token_id)
            for _ in range(sent - steps):
                session.receive()
    for s in seqs:
        client.release_cache(s)
    return tokens


def test_a_session_with_steps_in_flight_gives_the_step_by_step_tokens(client):
    seqs = {"pipe-a": PROMPT, "pipe-b": [9, 9, 2]}
    want = run_greedy(client, seqs, 6, ahead=1)
    for s, p in seqs.items():  # the reference model's own greedy continuation
        ids = list(p)
        for t in want[s]:
            assert t == greedy(ids)
            ids.append(t)
    assert run_greedy(client, seqs, 6, ahead=3) == want
    assert run_greedy(client, seqs, 6, ahead=6) == want  # past the server's read-ahead of 4


def test_a_failed_step_in_flight_fails_the_fed_steps_behind_it(client):
    with client.step_session() as session:
        session.send([UnifiedBatchItem("fail-a", PROMPT, 0, True, logits_policy=LogitsPolicy.argmax())])
        session.send([UnifiedBatchItem("fail-a", [1], 2, True)])  # stale: the cache holds 6
        session.send([fed("fail-a", 7)])  # counted on the failed step: the cache holds 6
        session.send([fed("fail-a", 6)])  # the prefill's token, still the latest sampled
        assert session.receive()[0].kv_cache.sequence_length == 6
        with pytest.raises(FailedPreconditionError):
            session.receive()
        with pytest.raises(FailedPreconditionError) as info:
            session.receive()
        assert info.value.reason == "STALE_CACHE_HANDLE"
        last = session.receive()
        assert last[0].logits.token_id == greedy(PROMPT + [greedy(PROMPT)])
        with pytest.raises(RuntimeError, match="no step sent"):
            session.receive()
        session.send([fed("fail-a", 7)])
        with pytest.raises(RuntimeError, match="unanswered"):
            session.step([fed("fail-a", 8)])
        assert session.receive()[0].kv_cache.sequence_length == 8
    client.release_cache("fail-a")


def test_the_async_session_keeps_steps_in_flight(paged_server):
    async def drive() -> list[int]:
        async with AsyncExecutorClient(paged_server.address) as c, c.step_session() as session:
            await session.send([UnifiedBatchItem("async-a", PROMPT, 0, True, logits_policy=LogitsPolicy.argmax())])
            for i in range(3):
                await session.send([fed("async-a", len(PROMPT) + i)])
            got = [(await session.receive())[0].logits.token_id for _ in range(4)]
            with pytest.raises(RuntimeError, match="no step sent"):
                await session.receive()
            await c.release_cache("async-a")
            return got

    got = asyncio.run(drive())
    ids = list(PROMPT)
    for t in got:
        assert t == greedy(ids)
        ids.append(t)
