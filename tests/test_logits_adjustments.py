"""Logits adjustments (penalties, bias, allow-list), min_p and top_logprobs: apply_policies
against a per-row float64 re-computation, then through a real server and the real client."""

from __future__ import annotations

import functools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from grpc import StatusCode as C

from client import DecodeInput, InvalidArgumentError, LogitsAdjustments, LogitsPolicy, Penalties, PrefillInput
from executors.adjustments import LogitsAdjustments as Adjust
from executors.errors import InvalidParameter
from executors.logits import apply_policies, argmax_pairs
from executors.logits_adjust import adjust_rows
from executors.types import LogitsKind
from executors.types import LogitsPolicy as Policy
from tests.paged_reference import PagedModel
from tests.test_logits import sampled_probs as cut_probs

MODEL = PagedModel()


def rows(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def reference(row: torch.Tensor, a: Adjust) -> np.ndarray:
    """The adjusted row, token by token, in float64."""
    out = row.double().numpy().copy()
    for token, count in zip(a.penalized_token_ids, a.counts()):
        v = out[token]
        v = v / a.repetition_penalty if v > 0 else v * a.repetition_penalty
        out[token] = v - (a.frequency_penalty * count + (a.presence_penalty if count else 0.0))
    for token, bias in a.logit_bias:
        out[token] += bias
    if a.allowed_token_ids:
        masked = np.full_like(out, -np.inf)
        masked[list(a.allowed_token_ids)] = out[list(a.allowed_token_ids)]
        out = masked
    out[list(a.banned_token_ids)] = -np.inf
    return out


def sampled_probs(row: torch.Tensor, p: Policy) -> np.ndarray:
    """The distribution a SAMPLE row draws from: the cuts' re-computation (tests/test_logits.py)
    over the adjusted row."""
    return cut_probs(torch.from_numpy(reference(row, p.adjustments or Adjust())), p)


def random_adjustments(rng: np.random.Generator, vocab: int, row: torch.Tensor) -> Adjust:
    top = torch.topk(row, 20).indices.tolist()  # penalize the likely tokens, so the argmax moves
    ids = [int(t) for t in rng.choice(top, size=int(rng.integers(1, 12)), replace=False)]
    negative = [int(t) for t in torch.topk(-row, 3).indices]  # negative logits: multiplied instead
    return Adjust(
        penalized_token_ids=tuple(ids + negative),
        penalized_token_counts=tuple(int(c) for c in rng.integers(0, 5, size=len(ids) + 3)),  # 0: prompt only
        repetition_penalty=float(rng.choice([0.8, 1.0, 1.3, 2.0])),
        presence_penalty=float(rng.uniform(-2, 2)),
        frequency_penalty=float(rng.uniform(-2, 2)),
        logit_bias=tuple(sorted({int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, 5)}.items())),
        allowed_token_ids=tuple(int(t) for t in rng.integers(0, vocab, 30)) if rng.random() < 0.5 else (),
        banned_token_ids=tuple(int(t) for t in top[:int(rng.integers(0, 4))]),  # the likeliest, so the ban bites
    )


def penalized_greedy(prompt: list[int], n: int, penalties: Penalties) -> list[int]:
    """Reference: the paged model's logits in NumPy, penalized over prompt (count 0) and
    generated tokens (their counts), greedy."""
    tokens: list[int] = []
    for _ in range(n):
        counts = Counter(tokens)
        ids = list(counts) + [t for t in dict.fromkeys(prompt) if t not in counts]
        adjust = Adjust(tuple(ids), tuple(counts.get(t, 0) for t in ids), penalties.repetition or 1.0,
                        penalties.presence, penalties.frequency)
        logits = torch.from_numpy(MODEL.last_logits(prompt + tokens).astype(np.float32))
        tokens.append(int(np.argmax(reference(logits, adjust))))
    return tokens


def test_adjust_rows_matches_a_per_row_recomputation():
    x = rows(16, 1000, seed=1)
    rng = np.random.default_rng(0)
    adjustments = [random_adjustments(rng, 1000, row) for row in x]
    adjustments[3] = Adjust()  # nothing to do, in the same batch
    adjustments[5] = Adjust(penalized_token_ids=(1, 2))  # ids but neutral penalties
    out = adjust_rows(x, adjustments)
    for i, (row, a) in enumerate(zip(x, adjustments)):
        expected = reference(row, a)
        got = out[i].double().numpy()
        assert np.array_equal(np.isneginf(got), np.isneginf(expected)), i
        finite = np.isfinite(expected)
        np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-6, atol=1e-5)
    assert torch.equal(out[3], x[3]) and torch.equal(out[5], x[5])
    assert not torch.equal(out, x) and torch.equal(x, rows(16, 1000, seed=1)), "the input rows must stay as they were"


def test_argmax_takes_the_adjusted_row_and_reports_the_models_logprob():
    x = rows(12, 700, seed=2)
    rng = np.random.default_rng(1)
    policies = [Policy(LogitsKind.ARGMAX, adjustments=random_adjustments(rng, 700, row)) if i % 3 else
                Policy(LogitsKind.ARGMAX) for i, row in enumerate(x)]
    moved = 0
    for precomputed in (None, argmax_pairs(x)):  # the second: as a decode CUDA graph hands it over
        out = apply_policies(x, policies, range(12), argmax=precomputed)
        for row, p, r in zip(x, policies, out):
            expected = int(np.argmax(reference(row, p.adjustments or Adjust())))
            assert r.token_id == expected
            assert r.logprob == pytest.approx(float(torch.log_softmax(row, dim=-1)[expected]), abs=1e-5)
            moved += expected != int(torch.argmax(row))
    assert moved >= 8, "the adjustments should move most adjusted rows' argmax"


SMALL = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])


@pytest.mark.parametrize("policy", [
    Policy(LogitsKind.SAMPLE, temperature=1.0, seed=1, adjustments=Adjust(allowed_token_ids=(1, 3, 5, 7))),
    Policy(LogitsKind.SAMPLE, temperature=0.8, seed=2, min_p=0.3),
    Policy(LogitsKind.SAMPLE, temperature=1.2, seed=3, top_k=6, top_p=0.9, min_p=0.2),
    Policy(LogitsKind.SAMPLE, temperature=1.0, seed=4, min_p=0.1, adjustments=Adjust(
        penalized_token_ids=(0, 6, 5), penalized_token_counts=(3, 1, 2), repetition_penalty=1.5,
        presence_penalty=0.3, frequency_penalty=0.2, logit_bias=((7, 4.0),))),
], ids=["allowed", "min_p", "top_k_top_p_min_p", "penalties_bias_min_p"])
def test_draws_follow_the_adjusted_and_cut_distribution(policy, sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    n = 20_000
    expected = sampled_probs(SMALL, policy)
    out = apply(SMALL[None].expand(n, -1), [policy] * n, range(n))
    counts = np.bincount([r.token_id for r in out], minlength=SMALL.numel())
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token masked or cut was drawn"
    assert 1 < kept.sum() < SMALL.numel(), "the case should cut some tokens and keep several"
    # Chi-square over the kept tokens (at most 7 degrees of freedom: the 1e-9 tail starts at 55.9).
    chi2 = float((((counts - n * expected) ** 2)[kept] / (n * expected[kept])).sum())
    assert chi2 < 60, (chi2, counts / n, expected)
    for r in out[:200]:
        assert r.sampling_logprob == pytest.approx(math.log(expected[r.token_id]), abs=1e-5)
        assert r.logprob == pytest.approx(float(torch.log_softmax(SMALL, dim=-1)[r.token_id]), abs=1e-5)


def test_min_p_one_keeps_only_the_most_probable_token(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(6, 3000, seed=3)
    out = apply(x, [Policy(LogitsKind.SAMPLE, temperature=1.5, seed=i, min_p=1.0) for i in range(6)], range(6))
    assert [r.token_id for r in out] == torch.argmax(x, dim=-1).tolist()
    assert all(r.sampling_logprob == 0.0 for r in out)


def test_an_allowed_token_stays_choosable_whatever_its_logit(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(3, 500, seed=4)
    x[:, [10, 20]] = -math.inf  # the only allowed tokens are the model's impossible ones
    allowed = Adjust(allowed_token_ids=(10, 20))
    policies = [Policy(LogitsKind.ARGMAX, adjustments=allowed),
                Policy(LogitsKind.SAMPLE, temperature=0.7, seed=1, adjustments=allowed),
                Policy(LogitsKind.SAMPLE, temperature=0.0, adjustments=allowed)]
    for r in apply(x, policies, range(3)):
        assert r.token_id in (10, 20)


def test_adjusted_rows_do_not_depend_on_their_batch_mates(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(10, 2000, seed=5)
    rng = np.random.default_rng(2)
    policies = []
    for i, row in enumerate(x):
        a = random_adjustments(rng, 2000, row) if i % 2 else None
        policies.append(Policy(LogitsKind.ARGMAX, adjustments=a) if i % 3 == 0 else
                        Policy(LogitsKind.SAMPLE, temperature=0.9, top_p=0.95, min_p=0.05, seed=i, adjustments=a))
    together = apply(x, policies, range(10))
    for i, r in enumerate(together):
        alone = apply(x[i:i + 1], [policies[i]], [i])[0]
        assert (alone.token_id, alone.kind) == (r.token_id, r.kind)
        assert alone.logprob == pytest.approx(r.logprob, abs=1e-6)


@pytest.mark.parametrize(("adjustments", "field", "says"), [
    (Adjust(penalized_token_ids=(5, 1000)), "penalized_token_ids", "token id 1000, outside the vocabulary"),
    (Adjust(penalized_token_ids=(5, 5)), "penalized_token_ids", "each id once"),
    (Adjust(penalized_token_ids=(5, 6), penalized_token_counts=(1,)), "penalized_token_counts", "1 entries for 2"),
    (Adjust(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (Adjust(repetition_penalty=math.nan), "repetition_penalty", "> 0"),
    (Adjust(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (Adjust(frequency_penalty=math.nan), "frequency_penalty", "[-2, 2]"),
    (Adjust(logit_bias=((3, 101.0),)), "logit_bias", "logit_bias[3] must be in [-100, 100]"),
    (Adjust(logit_bias=((-1, 1.0),)), "logit_bias", "token id -1"),
    (Adjust(allowed_token_ids=(1, 1000)), "allowed_token_ids", "token id 1000"),
    (Adjust(allowed_token_ids=(1,) * 1001), "allowed_token_ids", "1001 ids, more than the vocabulary's 1000"),
    (Adjust(banned_token_ids=(1000,)), "banned_token_ids", "token id 1000"),
    (Adjust(banned_token_ids=tuple(range(1000))), "banned_token_ids", "leaves no token to choose"),
    (Adjust(allowed_token_ids=(3, 4), banned_token_ids=(4, 3, 9)), "banned_token_ids", "among allowed_token_ids"),
])
def test_bad_adjustments_name_their_field(adjustments, field, says):
    with pytest.raises(InvalidParameter) as err:
        Policy(LogitsKind.ARGMAX, adjustments=adjustments).validate(1000, "input.logits_policy")
    assert err.value.field == f"input.logits_policy.adjustments.{field}"
    assert says in err.value.message


def test_full_and_top_k_refuse_adjustments_that_change_something():
    bias = Adjust(logit_bias=((3, 1.0),))
    for policy in (Policy(LogitsKind.FULL, adjustments=bias), Policy(LogitsKind.TOP_K, k=3, adjustments=bias)):
        with pytest.raises(InvalidParameter, match="apply to ARGMAX and SAMPLE"):
            policy.validate(1000, "p")
    Policy(LogitsKind.FULL, adjustments=Adjust()).validate(1000, "p")  # an empty message is no change
    with pytest.raises(InvalidParameter, match=r"min_p must be in \[0, 1\]"):
        Policy(LogitsKind.SAMPLE, min_p=1.5).validate(1000, "p")


# Through the server (the paged reference executor: vocabulary 256).

def test_adjustments_through_the_server(client):
    prompt = [3, 14, 15, 92]
    raw = torch.from_numpy(MODEL.last_logits(prompt).astype(np.float32))
    likely = [int(t) for t in torch.argsort(raw, descending=True, stable=True)[:4]]
    adjust = LogitsAdjustments.build(
        likely[:3] * 2 + likely[3:], prompt_tokens=prompt,
        repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.25,
        logit_bias={7: 3.0, 200: -100.0}, allowed_token_ids=range(0, 256, 3))
    assert adjust.penalized_token_counts[:4] == (2, 2, 2, 1) and set(adjust.penalized_token_counts[4:]) <= {0}
    out = client.prefill(PrefillInput(prompt, logits_policy=LogitsPolicy.argmax(adjust)))
    mine = Adjust(adjust.penalized_token_ids, adjust.penalized_token_counts, 1.4, 0.5, 0.25,
                  adjust.logit_bias, adjust.allowed_token_ids)
    expected = int(np.argmax(reference(raw, mine)))
    assert out.logits.token_id == expected != int(torch.argmax(raw))
    assert out.logits.logprob == pytest.approx(float(torch.log_softmax(raw, dim=-1)[expected]), abs=1e-4)

    # A sampled step with min_p = 1 keeps only the adjusted row's most probable token; the
    # same step again is a retry: the same answer, and the token is not appended twice.
    # (This model's logits are mostly 0: the allowed are its most likely token and two of those.)
    after = MODEL.last_logits([*prompt, expected])
    best, zeros = int(np.argmax(after)), [int(t) for t in np.flatnonzero(after == 0)[:2]]
    assert after[best] > 0
    step = DecodeInput(expected, out.kv_cache, logits_policy=LogitsPolicy.sample(
        0.9, seed=5, min_p=1.0, adjustments=LogitsAdjustments.build(allowed_token_ids=[zeros[0], best, zeros[1]])))
    first, again = client.decode(step), client.decode(step)
    assert first.logits.token_id == best
    assert (again.logits.token_id, again.kv_cache.sequence_length) == (first.logits.token_id, len(prompt) + 1)
    assert first.logits.sampling_logprob == 0.0
    client.release_cache(out.kv_cache)


def test_top_logprobs_through_the_server(client):
    prompt = [9, 8, 7]
    raw = torch.from_numpy(MODEL.last_logits(prompt).astype(np.float32))
    expected = torch.topk(torch.log_softmax(raw, dim=-1), 6)
    for policy in (LogitsPolicy.argmax(top_logprobs=6), LogitsPolicy.sample(0.7, seed=3, top_logprobs=6)):
        out = client.prefill(PrefillInput(prompt, logits_policy=policy))
        got = out.logits
        assert got.kind == policy.kind and got.token_id is not None
        # This model's logits tie a lot: compare the log-probabilities, and the ids where no tie is.
        np.testing.assert_allclose(got.top_logprobs, expected.values.numpy(), atol=1e-5)
        assert got.top_token_ids[0] == int(torch.argmax(raw))
        client.release_cache(out.kv_cache)
    plain = client.prefill(PrefillInput(prompt, logits_policy=LogitsPolicy.argmax()))
    assert plain.logits.top_token_ids is None  # asked for none, none on the wire
    client.release_cache(plain.kv_cache)


@pytest.mark.parametrize(("policy", "field"), [
    (LogitsPolicy.argmax(LogitsAdjustments.build([1, 256])), "penalized_token_ids"),
    (LogitsPolicy.argmax(LogitsAdjustments.build(logit_bias={3: 150.0})), "logit_bias"),
    (LogitsPolicy.sample(1.0, adjustments=LogitsAdjustments.build(repetition_penalty=-1.0)), "repetition_penalty"),
    (LogitsPolicy.sample(1.0, min_p=-0.5), "sample.min_p"),
    (LogitsPolicy.argmax(top_logprobs=257), "argmax.top_logprobs"),
    (LogitsPolicy.sample(1.0, top_logprobs=2000), "sample.top_logprobs"),
    (LogitsPolicy(kind="top_k", k=3, adjustments=LogitsAdjustments.build(allowed_token_ids=[1])), "adjustments"),
], ids=["id_out_of_vocab", "bias_too_big", "repetition_negative", "min_p_negative", "argmax_top_logprobs_over_vocab",
     "sample_top_logprobs_over_1024", "top_k_adjusted"])
def test_bad_adjustments_through_the_server(client, policy, field):
    with pytest.raises(InvalidArgumentError) as err:
        client.prefill(PrefillInput([1, 2], logits_policy=policy))
    assert err.value.code is C.INVALID_ARGUMENT
    assert err.value.metadata["field"].startswith("input.logits_policy") and err.value.metadata["field"].endswith(field)
    still = client.prefill(PrefillInput([1, 2], logits_policy=LogitsPolicy.argmax()))  # and it goes on serving
    client.release_cache(still.kv_cache)
    kv = client.status().kv_pool
    assert kv.free_blocks == kv.total_blocks, "a refused prefill must leave no cache behind"


def test_a_ban_keeps_its_tokens_out_and_the_rest_choosable(sampling_kernels):
    x = rows(4, 400, seed=6)
    top = torch.argsort(x, dim=-1, descending=True)
    banned = [Adjust(banned_token_ids=tuple(int(t) for t in top[i, :3])) for i in range(4)]
    policies = [Policy(LogitsKind.ARGMAX, adjustments=banned[0]),
                Policy(LogitsKind.SAMPLE, temperature=0.05, seed=1, adjustments=banned[1]),
                Policy(LogitsKind.SAMPLE, temperature=0.0, adjustments=banned[2]),
                Policy(LogitsKind.ARGMAX, adjustments=Adjust(allowed_token_ids=(5, 6, 7), banned_token_ids=(5, 7)))]
    out = apply_policies(x, policies, range(4), kernels=sampling_kernels)
    for i in range(3):  # a cold temperature: the best token left
        assert out[i].token_id == int(top[i, 3])
    assert out[3].token_id == 6
    # Every token impossible already: the ban still holds, the first other token is chosen.
    x[0] = -math.inf
    out = apply_policies(x[:1], [Policy(LogitsKind.ARGMAX, adjustments=Adjust(banned_token_ids=(50, 0, 1)))], [0],
                         kernels=sampling_kernels)
    assert out[0].token_id == 2
