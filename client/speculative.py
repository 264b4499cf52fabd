"""Speculative decoding over gRPC: a draft executor proposes, the target verifies in one call.

    spec = SpeculativeDecoder(AsyncExecutorClient(target), AsyncExecutorClient(draft), num_draft_tokens=4)
    result = await spec.generate(prompt_ids, max_tokens=64)
    print(result.token_ids, result.stats.acceptance_rate)

Each round, as the ferrum engine does it:
1. the draft proposes N tokens: N greedy steps on the draft's own cache (the first step
   also feeds whatever the draft has not seen yet: the prompt on the first round, and
   after a fully accepted round the last draft token as well as the target's bonus);
2. one ForwardVerify on the target runs [last, d0 .. dN-1] and returns N+1 rows: row i
   is the target's choice after tokens[i];
3. greedy: the drafts are accepted while d_i equals the target's argmax of row i; the
   first row that disagrees gives the correction, and when all N agree row N gives a
   bonus token, so a round commits k+1 tokens for k accepted drafts;
4. a rejection rolls both caches back with TruncateKv to the committed length (the
   target past its rejected rows, the draft past its unaccepted proposals).

Greedy verification is exact: the committed tokens are the target's own argmax at every
position, so the output equals plain greedy decoding on the target, token for token.

With `temperature > 0` verification samples (Leviathan et al. / Chen et al.): the draft
samples d_i from p_D (its full logits row, softened by the temperature), the target
returns full rows, d_i is accepted with probability min(1, p_T(d_i) / p_D(d_i)), and the
first rejection is replaced by a draw from normalise(max(p_T - p_D, 0)); all accepted
gives a bonus draw from p_T of row N. The output is distributed as sampling from the
target alone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .aio import AsyncExecutorClient
from .errors import ExecutorError
from .types import DecodeInput, KvCacheHandle, LogitsOutput, LogitsPolicy, PrefillInput

__all__ = ["SpeculativeDecoder", "SpeculativeResult", "SpeculativeStats", "accept_greedy", "accept_sampled",
           "softmax"]


@dataclass(slots=True)
class SpeculativeStats:
    rounds: int = 0
    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, accepted
    emitted: int = 0  # tokens committed (accepted + one correction or bonus per round)
    target_calls: int = 0  # prefill + ForwardVerify + TruncateKv on the target
    draft_calls: int = 0  # prefill + decode + TruncateKv on the draft
    full_accepts: int = 0  # rounds in which every draft was accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    def add(self, other: SpeculativeStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(slots=True)
class SpeculativeResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-sequence id, not included) or "length"
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Probabilities of a logits row (or rows) at a temperature > 0, in float64."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def accept_greedy(draft_tokens: Sequence[int], target_tokens: Sequence[int]) -> tuple[int, int]:
    """(accepted, next token): drafts are kept while they equal the target's argmax of the
    same row; the next token is the target's row after the last accepted one."""
    k = 0
    while k < len(draft_tokens) and draft_tokens[k] == target_tokens[k]:
        k += 1
    return k, int(target_tokens[k])


def accept_sampled(draft_tokens: Sequence[int], draft_probs: np.ndarray, target_probs: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """(accepted, next token) by speculative sampling.

    draft_probs: [N, V], the distribution each draft token was drawn from; target_probs:
    [N+1, V], the target's distribution after each verified token.
    """
    n = len(draft_tokens)
    for i in range(n):
        d = int(draft_tokens[i])
        p_t, p_d = target_probs[i, d], draft_probs[i, d]
        if p_d > 0 and rng.random() < min(1.0, p_t / p_d):
            continue
        residual = np.maximum(target_probs[i] - draft_probs[i], 0.0)
        total = residual.sum()
        # p_T == p_D leaves nothing; cannot be reached with p_D(d) > 0 and a rejection, but
        # fall back to p_T rather than divide by zero.
        probs = residual / total if total > 0 else target_probs[i]
        return i, int(rng.choice(len(probs), p=probs / probs.sum()))
    return n, int(rng.choice(target_probs.shape[1], p=target_probs[n] / target_probs[n].sum()))


class SpeculativeDecoder:
    """Speculative decoding with a draft executor and a target executor (two servers, or one).

    `num_draft_tokens` (N) drafts per round; `temperature` 0 verifies greedily (argmax
    only on the wire), above 0 verifies by sampling (full logits rows on the wire);
    `seed` seeds the client-side sampling.
    """

    def __init__(self, target: AsyncExecutorClient, draft: AsyncExecutorClient, *, num_draft_tokens: int = 4,
                 temperature: float = 0.0, seed: int | None = None) -> None:
        if num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be >= 1")
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.target = target
        self.draft = draft
        self.num_draft_tokens = num_draft_tokens
        self.temperature = temperature
        self.rng = np.random.default_rng(seed)
        self.stats = SpeculativeStats()  # over every generation of this decoder
        self._max_lens: tuple[int, int] | None = None

    async def _limits(self) -> tuple[int, int]:
        """(the target's max_sequence_length, the draft's): the output is the target's, however
        short the draft's limit; that only bounds how far the draft can propose."""
        if self._max_lens is None:
            t, d = await asyncio.gather(self.target.info(), self.draft.info())
            if t.vocab_size != d.vocab_size:
                raise ValueError(f"target and draft vocabularies differ ({t.vocab_size} vs {d.vocab_size})")
            self._max_lens = (t.max_sequence_length, d.max_sequence_length)
        return self._max_lens

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int,
                       stop_token_ids: Sequence[int] = ()) -> SpeculativeResult:
        """Run to max_tokens or an end-of-sequence id; both caches are released however it ends."""
        result = SpeculativeResult([], "length")
        async for t in self.stream(prompt_ids, max_tokens=max_tokens, stop_token_ids=stop_token_ids, result=result):
            result.token_ids.append(t)
        return result

    async def stream(self, prompt_ids: Sequence[int], *, max_tokens: int, stop_token_ids: Sequence[int] = (),
                     result: SpeculativeResult | None = None) -> AsyncIterator[int]:
        """Yield tokens as rounds commit them (up to N+1 at a time).

        `result`, when given, receives this generation's stats and finish reason."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        result = result if result is not None else SpeculativeResult([], "length")
        stats = result.stats
        stop = {int(t) for t in stop_token_ids}
        max_len, draft_max_len = await self._limits()
        greedy = self.temperature == 0
        policy = LogitsPolicy.argmax() if greedy else LogitsPolicy.full()
        # Ids chosen here, not by the servers: a call cut off after its server ran it leaves a
        # cache that the clean-up below can still name.
        target_h: KvCacheHandle | None = KvCacheHandle(f"spec-{uuid.uuid4().hex}", 0)
        draft_h: KvCacheHandle | None = None
        draft_id = f"spec-{uuid.uuid4().hex}"
        try:
            # The target reads the prompt and picks the first token; the draft catches up lazily.
            out = await self.target.prefill(PrefillInput(prompt, target_h, logits_policy=policy))
            target_h = out.kv_cache
            stats.target_calls += 1
            first = self._pick(out.logits)
            committed = prompt + [first]  # the target's cache holds all but the last
            emitted = 0
            if first in stop:
                result.finish_reason = "stop"
                return
            yield first
            emitted += 1
            stats.emitted += 1
            draft_len = 0  # tokens in the draft's cache, a prefix of `committed`
            while emitted < max_tokens and len(committed) <= max_len:
                # Drafts this round: never past max_tokens (the round adds n+1) or either model's
                # limit (the target's cache grows to len(committed) + n, the draft's to one less).
                n = max(0, min(self.num_draft_tokens, max_tokens - emitted - 1, max_len - len(committed),
                               draft_max_len - len(committed) + 1))
                last = committed[-1]
                drafts: list[int] = []
                draft_rows: list[np.ndarray] = []
                if n > 0:
                    pending = committed[draft_len:]
                    for i in range(n):
                        if i == 0 and (draft_h is None or len(pending) > 1):
                            d_out = await self.draft.prefill(
                                PrefillInput(pending, draft_h or KvCacheHandle(draft_id, 0), logits_policy=policy))
                        else:
                            feed = pending[0] if i == 0 else drafts[-1]
                            d_out = await self.draft.decode(DecodeInput(feed, draft_h, logits_policy=policy))
                        draft_h = d_out.kv_cache
                        stats.draft_calls += 1
                        if greedy:
                            drafts.append(int(d_out.logits.token_id))
                        else:
                            probs = softmax(d_out.logits.logits, self.temperature)
                            draft_rows.append(probs)
                            drafts.append(int(self.rng.choice(len(probs), p=probs)))
                    draft_len = draft_h.sequence_length
                verify = await self.target.forward_verify(target_h, [last, *drafts], policy)
                target_h = verify.kv_cache
                stats.target_calls += 1
                if greedy:
                    k, nxt = accept_greedy(drafts, [o.token_id for o in verify.outputs])
                else:
                    rows = softmax(np.stack([o.logits for o in verify.outputs]), self.temperature)
                    k, nxt = accept_sampled(drafts, np.stack(draft_rows) if draft_rows else rows[:0], rows, self.rng)
                stats.rounds += 1
                stats.proposed += n
                stats.accepted += k
                stats.full_accepts += n > 0 and k == n
                new = drafts[:k] + [nxt]
                base = len(committed)  # the target held committed[:-1]; verify added n+1 rows
                committed.extend(new)
                keep = base + k  # = len(committed) - 1: all but the new last token
                if target_h.sequence_length > keep:
                    target_h = (await self.target.truncate_kv(target_h, keep)).kv_cache
                    stats.target_calls += 1
                if draft_h is not None and draft_len > keep:
                    draft_h = (await self.draft.truncate_kv(draft_h, keep)).kv_cache
                    draft_len = keep
                    stats.draft_calls += 1
                for t in new:
                    if t in stop:
                        result.finish_reason = "stop"
                        return
                    yield t
                    emitted += 1
                    stats.emitted += 1
                    if emitted >= max_tokens:
                        return
        finally:
            self.stats.add(stats)
            await asyncio.shield(self._release(target_h, draft_h or KvCacheHandle(draft_id, 0)))

    def _pick(self, out: LogitsOutput) -> int:
        if self.temperature == 0:
            return out.next_token()
        probs = softmax(out.logits, self.temperature)
        return int(self.rng.choice(len(probs), p=probs))

    async def _release(self, target_h: KvCacheHandle | None, draft_h: KvCacheHandle | None) -> None:
        # By id: a handle's length is stale when its last call was cut off (and a release
        # of an id its server never created is a no-op).
        calls = [c.release_cache(h.cache_id) for c, h in ((self.target, target_h), (self.draft, draft_h))
                 if h is not None]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, ExecutorError):
                raise result
