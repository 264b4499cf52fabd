"""apply_policies against straightforward per-row re-computations, and the sampler's
determinism and distribution."""

from __future__ import annotations

import functools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from executors.adjustments import LogitsAdjustments as Adjust
from executors.logits import _nucleus_floor, apply_policies, argmax_pairs, sampling_uniform, to_host_tensor
from executors.types import DType, LogitsKind, LogitsPolicy

# Probabilities with no ties, on a vocabulary small enough to count every token's draws.
SMALL = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])


def argmax() -> LogitsPolicy:
    return LogitsPolicy(LogitsKind.ARGMAX)


def top_k(k: int) -> LogitsPolicy:
    return LogitsPolicy(LogitsKind.TOP_K, k=k)


def full(dtype: DType = DType.FLOAT32) -> LogitsPolicy:
    return LogitsPolicy(LogitsKind.FULL, full_dtype=dtype)


def sample(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0) -> LogitsPolicy:
    return LogitsPolicy(LogitsKind.SAMPLE, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def rows(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sampled_probs(row: torch.Tensor, p: LogitsPolicy) -> np.ndarray:
    """The distribution a SAMPLE row draws from, by sorting, in float64."""
    scaled = row.double() / p.temperature
    if 0 < p.top_k < scaled.numel():
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, p.top_k).values[-1], -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        probs[order[torch.cumsum(ordered, 0) - ordered >= p.top_p]] = 0.0
    probs[probs < p.min_p * probs.max()] = 0.0
    return (probs / probs.sum()).numpy()


def draws(row: torch.Tensor, p: LogitsPolicy, n: int, kernels=None):
    """n draws from one row, at positions 0..n-1, in one call."""
    return apply_policies(row.expand(n, -1), [p] * n, range(n), kernels=kernels)


def test_sampling_uniform_is_splitmix64():
    # splitmix64 seeded with 0 first outputs 0xE220A8397B1DCDAF, its published test vector.
    assert sampling_uniform(0) == (0xE220A8397B1DCDAF >> 11) * 2.0**-53
    us = [sampling_uniform(s) for s in range(1000)]
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) == 1000


def test_argmax_top_k_full_match_per_row():
    x = rows(12, 500)
    policies = [argmax(), top_k(3), full(), top_k(1), argmax(), full(DType.BFLOAT16),
                top_k(3), top_k(7), full(DType.FLOAT16), argmax(), top_k(7), top_k(1)]
    out = apply_policies(x, policies, range(12))
    for row, p, r in zip(x, policies, out):
        assert r.kind is p.kind
        logprobs = torch.log_softmax(row, dim=-1)
        if p.kind is LogitsKind.ARGMAX:
            assert r.token_id == int(torch.argmax(row))
            assert r.logprob == pytest.approx(float(logprobs[r.token_id]), abs=1e-5)
        elif p.kind is LogitsKind.TOP_K:
            top = torch.topk(logprobs, p.k)
            assert r.top_token_ids == tuple(top.indices.tolist())
            np.testing.assert_allclose(r.top_logprobs, top.values.numpy(), atol=1e-5)
        else:
            expected = to_host_tensor(row, p.full_dtype)
            assert r.logits.dtype is p.full_dtype
            np.testing.assert_array_equal(r.logits.array, expected.array)


def test_a_draw_depends_on_seed_and_position_only(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(8, 6000, seed=1)
    policies = [sample(0.8, seed=1), sample(1.0, top_k=40, seed=2), sample(1.3, top_p=0.9, seed=3),
                sample(0.5, top_k=100, top_p=0.8, seed=4), sample(2.0, seed=2**64 - 1), sample(1.0, top_p=0.5, seed=6),
                sample(0.9, top_k=5, seed=7), sample(1.0, top_k=5999, top_p=0.99, seed=8)]
    positions = [5, 17, 17, 0, 1000, 3, 42, 9]
    together = apply(x, policies, positions)
    alone = [apply(x[i:i + 1], [policies[i]], [positions[i]])[0] for i in range(8)]
    order = list(reversed(range(8)))
    reversed_ = apply(x[order], [policies[i] for i in order], [positions[i] for i in order])[::-1]
    # Rows 1..7 twice (a retried step), in a batch with rows of other kinds.
    mixed = apply(torch.cat([x, x]), [argmax(), *policies[1:], full(), *policies[1:]], positions * 2)
    for i, r in enumerate(together):
        for other in (alone[i], reversed_[i]) + ((mixed[i], mixed[8 + i]) if i else ()):
            assert other.token_id == r.token_id
            assert other.logprob == pytest.approx(r.logprob, abs=1e-6)
            assert other.sampling_logprob == pytest.approx(r.sampling_logprob, abs=1e-6)


def test_positions_and_seeds_draw_differently(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    flat = torch.zeros(1, 1000)
    by_position = [r.token_id for r in draws(flat, sample(seed=5), 300, sampling_kernels)]
    # 300 uniform draws over 1000 tokens: ~259 distinct on average, a few apart at most.
    assert len(set(by_position)) > 220
    by_seed = [r.token_id for r in apply(flat.expand(300, -1), [sample(seed=s) for s in range(300)], [7] * 300)]
    assert len(set(by_seed)) > 220
    fresh = [apply(flat, [sample(seed=None)], [0])[0].token_id for _ in range(10)]
    assert len(set(fresh)) > 1, "seed None must draw afresh on every call"


@pytest.mark.parametrize("policy", [sample(0.7, seed=11), sample(1.0, seed=None), sample(1.6, top_k=5, seed=12),
                                    sample(1.0, top_p=0.8, seed=13), sample(0.9, top_k=6, top_p=0.9, seed=14)])
def test_draws_follow_the_filtered_distribution(policy, sampling_kernels):
    n = 20_000
    expected = sampled_probs(SMALL, policy)
    out = draws(SMALL[None], policy, n, sampling_kernels)
    counts = np.bincount([r.token_id for r in out], minlength=SMALL.numel())
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, "a token cut by top-k or top-p was drawn"
    # Chi-square over the allowed tokens: at most 7 degrees of freedom, whose 1e-9 upper
    # tail starts at 55.9; a wrong temperature or a missed renormalisation scores thousands.
    chi2 = float((((counts - n * expected) ** 2)[allowed] / (n * expected[allowed])).sum())
    assert chi2 < 60, (chi2, counts / n, expected)
    for r in out[:200]:
        assert r.sampling_logprob == pytest.approx(math.log(expected[r.token_id]), abs=1e-5)
        assert r.logprob == pytest.approx(float(torch.log_softmax(SMALL, dim=-1)[r.token_id]), abs=1e-5)


def test_draws_across_blocks_follow_the_distribution(sampling_kernels):
    # Mass on the first and last tokens of the inverse CDF's blocks, and on the last token.
    ids = [0, 127, 128, 255, 256, 300, 383, 384, 511]
    x = torch.full((512,), -40.0)
    x[ids] = torch.linspace(0.0, 1.6, len(ids))
    n = 20_000
    expected = torch.softmax(x.double(), dim=-1).numpy()[ids]
    counts = np.bincount([r.token_id for r in draws(x[None], sample(seed=21), n, sampling_kernels)], minlength=512)
    assert counts.sum() == counts[ids].sum()
    # 8 degrees of freedom: the 1e-9 upper tail starts at 58.3.
    chi2 = float(((counts[ids] - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 65, (chi2, counts[ids] / n, expected)


def test_top_k_and_top_p_cut_where_a_sort_would(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(6, 8000, seed=2)
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
        probs = torch.softmax(x, dim=-1)
        floor = _nucleus_floor(probs, torch.full((6,), top_p))
        for row, f in zip(probs.double(), floor.tolist()):
            ordered, _ = torch.sort(row, descending=True)
            before = torch.cumsum(ordered, 0) - ordered
            keep = before < top_p
            # Where rounding decides, a token whose mass before it is within 1e-5 of top_p.
            unsure = (before - top_p).abs() < 1e-5
            assert bool(((ordered >= f) == keep)[~unsure].all())
    # Every combination in one batch, 40 draws of each.
    policies = [sample(1.0, top_k=k, top_p=p, seed=k) for k in (0, 3, 50) for p in (1.0, 0.6, 0.97) for _ in range(40)]
    batch = torch.stack([x[p.top_k % 6] for p in policies])
    expected_by = {(p.top_k, p.top_p): sampled_probs(x[p.top_k % 6], p) for p in policies[::40]}
    for p, r in zip(policies, apply(batch, policies, range(len(policies)))):
        expected = expected_by[p.top_k, p.top_p]
        assert expected[r.token_id] > 0
        assert r.sampling_logprob == pytest.approx(math.log(expected[r.token_id]), abs=1e-4)


def test_top_p_keeps_ties_with_the_last_token_kept():
    # bfloat16 logits tie often: equally probable tokens are kept or cut together.
    x = rows(4, 5000, seed=3).bfloat16().float()
    probs = torch.softmax(x, dim=-1)
    for top_p in (0.3, 0.8, 0.95):
        for row, f in zip(probs.double(), _nucleus_floor(probs, torch.full((4,), top_p)).tolist()):
            assert float(row[row > f].sum()) < top_p + 1e-6  # every token above the floor is needed
            assert float(row[row >= f].sum()) >= top_p - 1e-6  # and the floor's ties reach top_p
            assert int((row == f).sum()) >= 1


@pytest.mark.parametrize("temperature", [0.0, 1e-30, 1e-39, 1e-50])
def test_zero_and_tiny_temperatures_take_the_argmax(temperature, sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(5, 4000, seed=4)
    out = apply(x, [sample(temperature, top_k=10, top_p=0.5, seed=i) for i in range(5)], range(5))
    for row, r in zip(x, out):
        assert r.token_id == int(torch.argmax(row))
        assert r.sampling_logprob == 0.0
        assert r.logprob == pytest.approx(float(torch.log_softmax(row, dim=-1)[r.token_id]), abs=1e-5)


def test_non_finite_logits_take_the_argmax(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(2, 100, seed=5)
    x[0, 3] = -math.inf
    out = apply(x, [sample(1.0, seed=1), sample(1.0, seed=1)], [0, 0])
    assert out[0].token_id == int(torch.argmax(x[0])) and out[0].sampling_logprob == 0.0
    assert out[1].sampling_logprob < 0.0  # a finite row still samples


def test_mixed_batch_keeps_order(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(40, 257, seed=6)
    makers = [argmax, lambda: top_k(4), full, lambda: sample(0.8, top_p=0.9, seed=1), lambda: sample(0.0),
              lambda: top_k(2), lambda: full(DType.BFLOAT16)]
    rng = random.Random(0)
    policies = [rng.choice(makers)() for _ in range(40)]
    positions = [rng.randrange(10_000) for _ in range(40)]
    out = apply(x, policies, positions)
    assert [r.kind for r in out] == [p.kind for p in policies]
    for i, r in enumerate(out):
        one = apply(x[i:i + 1], [policies[i]], [positions[i]])[0]
        if r.kind is LogitsKind.FULL:
            np.testing.assert_array_equal(r.logits.array, one.logits.array)
        else:
            assert (r.token_id, r.top_token_ids) == (one.token_id, one.top_token_ids)


def test_argmax_and_sample_rows_also_return_the_top_logprobs_they_ask_for(sampling_kernels):
    apply = functools.partial(apply_policies, kernels=sampling_kernels)
    x = rows(9, 3000, seed=7)
    adjusted = Adjust(logit_bias=((5, 100.0),))  # moves the choice, not the model's top ids
    policies = [LogitsPolicy(LogitsKind.ARGMAX, top_logprobs=5), argmax(),
                LogitsPolicy(LogitsKind.SAMPLE, temperature=0.8, seed=1, top_logprobs=5),
                LogitsPolicy(LogitsKind.SAMPLE, temperature=0.0, top_logprobs=1),
                LogitsPolicy(LogitsKind.ARGMAX, top_logprobs=20, adjustments=adjusted), top_k(5),
                LogitsPolicy(LogitsKind.SAMPLE, temperature=1.0, seed=2, top_logprobs=20, adjustments=adjusted),
                sample(0.5), full()]
    for precomputed in (None, argmax_pairs(x)):  # the second: as a decode CUDA graph hands it over
        out = apply(x, policies, range(9), argmax=precomputed)
        plain = apply(x, [replace(p, top_logprobs=0) for p in policies], range(9))
        for row, p, r, alone in zip(x, policies, out, plain):
            assert (r.kind, r.token_id) == (alone.kind, alone.token_id)
            assert r.logprob == (None if alone.logprob is None else pytest.approx(alone.logprob, abs=1e-6))
            if p.kind is LogitsKind.TOP_K:
                continue
            if not p.top_logprobs:
                assert r.top_token_ids == () and r.top_logprobs == ()
                continue
            top = torch.topk(torch.log_softmax(row, dim=-1), p.top_logprobs)
            assert r.top_token_ids == tuple(top.indices.tolist())
            np.testing.assert_allclose(r.top_logprobs, top.values.numpy(), atol=1e-5)
        assert out[4].token_id == out[6].token_id == 5 and 5 not in out[4].top_token_ids


def test_the_cpu_kernel_draws_what_the_torch_path_draws():
    """sampling.c against the torch ops it stands in for, on rows with ties (bfloat16-rounded)
    and without, every cut combined: a token differs only where float32 rounding decides
    (a boundary token kept by one and not the other moves every later cumulative sum), and
    the kernel never draws a token the cuts exclude."""
    from executors.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built on this machine")
    x = torch.cat([rows(40, 5000, seed=8), rows(24, 5000, seed=9).bfloat16().float()])
    rng = random.Random(1)
    policies = [replace(sample(rng.choice([0.5, 0.8, 1.0, 1.7]), top_k=rng.choice([0, 1, 7, 300, 4999, 6000]),
                               top_p=rng.choice([1.0, 0.3, 0.9, 0.99]), seed=i), min_p=rng.choice([0.0, 0.01, 0.2]))
                for i in range(64)]
    positions = [rng.randrange(5000) for _ in range(64)]
    ours = apply_policies(x, policies, positions, kernels=kernels)
    theirs = apply_policies(x, policies, positions)
    same = [a.token_id == b.token_id for a, b in zip(ours, theirs)]
    assert sum(same) >= 58, f"{64 - sum(same)} of 64 draws differ"
    for row, p, a, b, equal in zip(x, policies, ours, theirs, same):
        expected = sampled_probs(row, p)
        kept = torch.from_numpy(expected > 0)
        assert row[a.token_id] >= row[kept].min(), "the kernel drew a token the cuts exclude"
        assert a.logprob == pytest.approx(b.logprob if equal else float(torch.log_softmax(row, -1)[a.token_id]),
                                          abs=1e-5)
        if equal:
            assert a.sampling_logprob == pytest.approx(b.sampling_logprob, abs=1e-4)


@pytest.mark.parametrize("vocab", [1, 3, 13, 130])
def test_the_cpu_kernel_takes_rows_shorter_than_a_vector_or_a_block(vocab):
    """Every length draws what the torch path draws; half of each row sits 90 below its
    largest logit (a probability under 1e-39 of it), which neither path draws."""
    from executors.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built on this machine")
    x = torch.full((64, vocab), -90.0)
    x[:, : (vocab + 1) // 2] = torch.linspace(0.0, 1.0, (vocab + 1) // 2)
    policies = [sample(1.0, top_k=[0, 1, 2][i % 3], top_p=[1.0, 0.5][i % 2], seed=i) for i in range(64)]
    ours = apply_policies(x, policies, range(64), kernels=kernels)
    theirs = apply_policies(x, policies, range(64))
    assert all(r.token_id < (vocab + 1) // 2 for r in ours)
    assert [r.token_id for r in ours] == [r.token_id for r in theirs]
