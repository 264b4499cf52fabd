"""Turning logits rows into what each item's LogitsPolicy asked for.

Argmax, top-k and sampling run where the logits are (the GPU, on one), so that only ids
and a few floats travel to the host unless the caller asked for the whole row.

Rows are handled a kind at a time, each kind with a few tensor ops over all of its rows,
because per-row work (a sort and a torch.Generator for every sampled row) cost far more
than the arithmetic: ~300 ms for 32 sampled rows of a 49152-token vocabulary on a CPU.

How a SAMPLE row draws its token
--------------------------------
The logits are first adjusted where the policy asks (penalties, bias, allow-list:
adjustments.py, logits_adjust.py; ARGMAX rows take the argmax of the adjusted row). The
distribution is softmax(logits / temperature), cut to the top_k most probable tokens
(ties at the cut stay in), then to the nucleus: the most probable tokens until their mass
reaches top_p, plus any token exactly as probable as the last one kept (so the set does
not depend on how a sort orders ties), then to the tokens at least min_p times as probable
as the most probable one, renormalised. Temperature 0, or one so small that
logits / temperature overflows, takes the argmax: sampling's limit as the temperature goes
to 0. The log-probability reported with the token is the model's own, before adjustments.

The draw is by inversion with one counter-based uniform number per row: u in [0, 1) is
splitmix64's output for the state sampling_seed(seed, position), its top 53 bits; the
token is the first, in token-id order, whose cumulative probability exceeds u. A row's
token is therefore a function of its (seed, position) and its logits alone: the same in
any batch, in any order, on a retried step, while another position gets another u. A
seed of None draws the state from the OS, so every call differs. One number per row,
rather than noise per token for a Gumbel-max race, keeps the hashing on the host, in
exact Python integers, and off the vocabulary-sized tensors. Float32 sums locate the
token's block of 128 and float64 sums the token inside it, so draws follow the float32
probabilities to their own precision, and a token of probability 0 (cut, or underflowed)
is never drawn.

A float32 executor with the CPU kernels draws its SAMPLE rows through cpu_kernels/sampling.c
instead: the same cuts and the same inversion in one call per step, its sums in double, so
its token differs from these ops' only where float32 rounding decides (bench/RESULTS.md
run 26b: 3.1 ms for 32 top-p rows where these ops take 13.4).

Top-p needs the probabilities in order only around the nucleus boundary, so instead of
sorting the vocabulary, a row's probabilities go into histogram bins by the top bits of
their float32 encoding (monotone in the value, each bin ~3% wide): the bins' masses from
the top locate the bin where the mass reaches top_p, and only that bin's tokens are
ordered, with one small topk.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from executors.adjustments import LogitsAdjustments
from executors.logits_adjust import adjust_rows
from executors.types import DType, HostTensor, LogitsKind, LogitsPolicy, LogitsResult

if TYPE_CHECKING:
    from executors.cpu_kernels import CpuKernels

TORCH_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}

_MASK64 = (1 << 64) - 1
# A probability's float32 bits >> 18 keep the exponent and 5 mantissa bits: bins whose
# bounds differ by at most a factor 1 + 1/32. Probabilities are at most 1.0, 0x3F800000.
_BIN_SHIFT = 18
_NUM_BINS = (0x3F800000 >> _BIN_SHIFT) + 1
# Tokens per block in the two-level inverse CDF (see _invert); vocabularies are usually
# multiples of 128, which spares padding.
_BLOCK = 128
NO_ADJUSTMENTS = LogitsAdjustments()


def to_host_tensor(t: torch.Tensor, dtype: DType) -> HostTensor:
    """Copy a float tensor to the host in `dtype`; bfloat16 keeps its raw bits as uint16."""
    t = t.detach().to(TORCH_DTYPES[dtype]).contiguous().cpu()
    if dtype is DType.BFLOAT16:
        return HostTensor(dtype, t.view(torch.int16).numpy().view(np.uint16))
    return HostTensor(dtype, t.numpy())


def sampling_seed(seed: int | None, position: int) -> int:
    """The state a row's draw comes from, given the caller's seed and the sampled token's
    position (see sampling_uniform).

    Mixing in the position makes successive steps draw different numbers while a retried
    step (same seed, same position) draws the same one.
    """
    if seed is None:
        return secrets.randbits(63)
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & _MASK64
    mixed ^= mixed >> 31
    return mixed & ((1 << 63) - 1)


def sampling_uniform(state: int) -> float:
    """splitmix64's next output from `state`, as a float in [0, 1) with 53 random bits."""
    z = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def _take(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows idx (increasing) of t; t itself, with no copy, when that is all of them."""
    return t if len(idx) == t.shape[0] else t[torch.tensor(idx, device=t.device)]


def _logprob_at(x: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """log_softmax(x)[r, tok[r]] for every row r, without materialising log_softmax."""
    return x.gather(1, tok[:, None]).squeeze(1) - torch.logsumexp(x, dim=-1)


def argmax_pairs(x: torch.Tensor) -> torch.Tensor:
    """[2, rows] float64: each row's argmax id and its log-probability, ready for one copy to the
    host (ids < 2^53 are exact in float64). Device ops only: a decode CUDA graph computes it."""
    tok = torch.argmax(x, dim=-1)
    return torch.stack((tok.double(), _logprob_at(x, tok).double()))


def _argmax(x: torch.Tensor | None, kernels: CpuKernels | None = None,
            pairs: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """Ids and log-probabilities of x's rows; `pairs`: argmax_pairs(x), computed already (by a
    decode graph; x is then not read and may be None)."""
    if pairs is None and kernels is not None and x.device.type == "cpu":
        found = kernels.argmax_logprob(x)  # one call instead of argmax + logsumexp's five ops
        if found is not None:
            return found
    both = (pairs if pairs is not None else argmax_pairs(x)).tolist()
    return [int(t) for t in both[0]], both[1]


def _top_k(x: torch.Tensor, k: int) -> list[LogitsResult]:
    top = torch.topk(x, k)  # sorted, highest first
    logprobs = top.values - torch.logsumexp(x, dim=-1, keepdim=True)
    return [
        LogitsResult(LogitsKind.TOP_K, top_token_ids=tuple(ids), top_logprobs=tuple(lps))
        for ids, lps in zip(top.indices.tolist(), logprobs.tolist())
    ]


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability top-p keeps (0.0 where it keeps every token).

    A token is kept while the mass of the tokens more probable than it is below top_p,
    as a sort would decide; ties with the last one kept are kept too.
    """
    n, vocab = probs.shape
    if vocab <= _NUM_BINS:
        # A row shorter than the histogram sorts faster than it fills one.
        mass_higher = probs.new_zeros(n)
        cand = torch.sort(probs, dim=-1, descending=True).values
    else:
        bins = (probs.view(torch.int32) >> _BIN_SHIFT).long()  # a float >= 0's bits grow with it
        mass = probs.new_zeros(n, _NUM_BINS).scatter_add_(1, bins, probs)
        above = mass.flip(-1).cumsum(-1)  # above[:, j]: mass of bins _NUM_BINS - 1 - j and up
        # The first bin from the top where the mass reaches top_p; where rounding leaves
        # the total short of it, the bottom bin, so that everything is kept.
        j = (above < top_p[:, None]).sum(-1).clamp(max=_NUM_BINS - 1)
        mass_higher = torch.where(j > 0, above.gather(1, (j - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
        in_bin = bins == (_NUM_BINS - 1 - j)[:, None]
        width = max(1, int(torch.count_nonzero(in_bin, dim=-1).max()))
        # The boundary bin's probabilities, highest first, padded with -1 in narrower rows;
        # those in higher bins are all kept, those in lower ones all cut.
        cand = torch.topk(torch.where(in_bin, probs, -1.0), width).values
    real = cand >= 0
    cand = cand.clamp(min=0.0)
    before = mass_higher[:, None] + (cand.cumsum(-1) - cand)
    kept = ((before < top_p[:, None]) & real).sum(-1)
    # kept is 0 only where the boundary bin is an empty bottom bin: keep everything.
    floor = cand.gather(1, (kept - 1).clamp(min=0)[:, None]).squeeze(1)
    return torch.where(kept > 0, floor, 0.0)


def _draw(scaled: torch.Tensor, policies: list[LogitsPolicy], states: list[int],
          kernels: CpuKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids drawn from the rows of `scaled` (logits / temperature: finite, or -inf where
    masked), and log of the probability each was drawn with; through the CPU kernels'
    one call (sampling.c) where given and the rows are float32 on the CPU."""
    n, vocab = scaled.shape
    dev = scaled.device
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in policies]
    if kernels is not None and dev.type == "cpu" and scaled.dtype == torch.float32:
        found = kernels.sample(scaled, top_k, [p.top_p for p in policies], [p.min_p for p in policies],
                               [sampling_uniform(s) for s in states])
        if found is not None:
            return found
    if any(top_k):
        cut = [i for i, k in enumerate(top_k) if k]
        ks = torch.tensor([top_k[i] - 1 for i in cut], device=dev)
        kth = torch.full((n, 1), float("-inf"), device=dev)
        kth[cut] = torch.topk(_take(scaled, cut), max(top_k)).values.gather(1, ks[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in policies):
        nucleus = [i for i, p in enumerate(policies) if p.top_p < 1.0]
        top_p = torch.tensor([policies[i].top_p for i in nucleus], device=dev)
        floor = torch.zeros(n, 1, device=dev)
        floor[nucleus] = _nucleus_floor(_take(probs, nucleus), top_p)[:, None]
        probs.masked_fill_(probs < floor, 0.0)
    if any(p.min_p > 0 for p in policies):
        # After top_k and top_p: the most probable token survives both, and their cuts
        # change no ratio to it, so the order of the three does not matter for min_p.
        min_p = torch.tensor([p.min_p for p in policies], device=dev)[:, None]
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    u = torch.tensor([sampling_uniform(s) for s in states], dtype=torch.float64, device=dev)
    tok, total = _invert(probs, u)
    drawn_with = torch.log(probs.gather(1, tok[:, None]).squeeze(1).double() / total)
    return tok, drawn_with


def _invert(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first token whose cumulative probability exceeds u times the row's
    total, and the total: u in [0, 1) picks a token with the probability's share of it.

    Cumulative sums in float64 over the whole vocabulary would cost more than everything
    else; block sums locate the block the token is in, and only that block is summed up.
    """
    n, vocab = probs.shape
    pad = -vocab % _BLOCK  # zero-probability padding, never picked
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(n, -1, _BLOCK)
    # Block sums in float32 err by ~1e-7 relative, the probabilities' own precision.
    ends = blocks.sum(-1).double().cumsum(-1)
    total = ends[:, -1]
    zero = torch.zeros_like(total)[:, None]
    # Sums from the last token of positive probability on all equal the total (or the
    # block's sum, below): a target strictly under it lands on a token of positive
    # probability even where u * total rounds up to the total.
    target = torch.minimum(u * total, torch.nextafter(total, zero[:, 0]))[:, None]
    block = torch.searchsorted(ends, target, right=True)
    start = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), zero)
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, _BLOCK)).squeeze(1).cumsum(-1, dtype=torch.float64)
    rest = torch.minimum(target - start, torch.nextafter(inside[:, -1:], zero))
    return (block * _BLOCK + torch.searchsorted(inside, rest, right=True)).squeeze(1), total


def _argmax_adjusted(x: torch.Tensor, choose: torch.Tensor) -> tuple[list[int], list[float]]:
    """The argmax ids of `choose` (x's rows adjusted) and their log-probabilities under x."""
    tok = torch.argmax(choose, dim=-1)
    return tok.tolist(), _logprob_at(x, tok).tolist()


def _sample(x: torch.Tensor, policies: list[LogitsPolicy], positions: list[int],
            choose: torch.Tensor | None = None, kernels: CpuKernels | None = None) -> list[LogitsResult]:
    """x: the rows' logits; choose: the rows the tokens are drawn from (x adjusted; None: x)."""
    adjusted = choose is not None
    choose = x if choose is None else choose
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in policies], device=x.device)
    # Temperature 0, or one so small that logits / temperature overflows (float32 rounding
    # a positive temperature to 0 included): the limit of sampling is the argmax. Division
    # is monotone, so a row overflows where its largest |logit| does; a NaN or an infinite
    # logit makes that one non-finite too. The -inf of an allow-list's masked tokens
    # overflows nothing: the lowest logit is taken among the others.
    # (amax and amin separately: faster than aminmax on a CPU.)
    low = choose.masked_fill(choose == float("-inf"), 0.0).amin(dim=-1) if adjusted else choose.amin(dim=-1)
    finite = torch.isfinite(torch.maximum(choose.amax(dim=-1), -low) / temps).tolist()
    greedy = [p.temperature == 0 or not ok for p, ok in zip(policies, finite)]
    results: list[LogitsResult | None] = [None] * len(policies)
    if any(greedy):
        idx = [i for i, g in enumerate(greedy) if g]
        found = _argmax_adjusted(_take(x, idx), _take(choose, idx)) if adjusted else _argmax(_take(x, idx))
        for i, tok, lp in zip(idx, *found):
            results[i] = LogitsResult(LogitsKind.SAMPLE, token_id=tok, logprob=lp, sampling_logprob=0.0)
    if not all(greedy):
        idx = [i for i, g in enumerate(greedy) if not g]
        states = [sampling_seed(policies[i].seed, positions[i]) for i in idx]
        scaled = _take(choose, idx) / _take(temps[:, None], idx)
        tok, drawn_with = _draw(scaled, [policies[i] for i in idx], states, kernels)
        for i, t, lp, dw in zip(idx, tok.tolist(), _logprob_at(_take(x, idx), tok).tolist(), drawn_with.tolist()):
            results[i] = LogitsResult(LogitsKind.SAMPLE, token_id=t, logprob=lp, sampling_logprob=dw)
    return results


def _adjusted(rows: torch.Tensor, policies: Sequence[LogitsPolicy], idx: list[int]) -> torch.Tensor | None:
    """Rows idx of `rows` with their policies' adjustments applied; None where none adjusts."""
    if not any(policies[i].adjusts for i in idx):
        return None
    return adjust_rows(_take(rows, idx), [policies[i].adjustments or NO_ADJUSTMENTS for i in idx])


def apply_policies(
    rows: torch.Tensor, policies: Sequence[LogitsPolicy], positions: Sequence[int],
    kernels: CpuKernels | None = None, argmax: torch.Tensor | None = None,
) -> list[LogitsResult]:
    """One LogitsResult per row of `rows` ([n, vocab]).

    positions[i] is the position of the token row i predicts; it seeds sampling. `kernels`:
    the CPU kernels (executors/cpu_kernels) that take ARGMAX rows in one call, where built.
    `argmax`: argmax_pairs(rows) where the step computed it already (a decode CUDA graph does,
    so an all-ARGMAX step launches nothing after the replay but one copy to the host).
    """
    rows = rows.float()
    results: list[LogitsResult | None] = [None] * len(policies)
    argmax_rows = [i for i, p in enumerate(policies) if p.kind is LogitsKind.ARGMAX and not p.adjusts]
    adjusted_argmax = [i for i, p in enumerate(policies) if p.kind is LogitsKind.ARGMAX and p.adjusts]
    sample = [i for i, p in enumerate(policies) if p.kind is LogitsKind.SAMPLE]
    for i, p in enumerate(policies):
        if p.kind is LogitsKind.FULL:
            results[i] = LogitsResult(LogitsKind.FULL, logits=to_host_tensor(rows[i], p.full_dtype))
    if argmax_rows:
        if argmax is not None:  # computed by the step already: only the copy to the host is left
            pairs = argmax if len(argmax_rows) == rows.shape[0] else argmax[:, torch.tensor(argmax_rows,
                                                                                               device=argmax.device)]
            found = _argmax(None, pairs=pairs)
        else:
            found = _argmax(_take(rows, argmax_rows), kernels)
        for i, tok, lp in zip(argmax_rows, *found):
            results[i] = LogitsResult(LogitsKind.ARGMAX, token_id=tok, logprob=lp)
    if adjusted_argmax:
        found = _argmax_adjusted(_take(rows, adjusted_argmax), _adjusted(rows, policies, adjusted_argmax))
        for i, tok, lp in zip(adjusted_argmax, *found):
            results[i] = LogitsResult(LogitsKind.ARGMAX, token_id=tok, logprob=lp)
    for k in sorted({p.k for p in policies if p.kind is LogitsKind.TOP_K}):
        idx = [i for i, p in enumerate(policies) if p.kind is LogitsKind.TOP_K and p.k == k]
        for i, r in zip(idx, _top_k(_take(rows, idx), k)):
            results[i] = r
    if sample:
        drawn = _sample(_take(rows, sample), [policies[i] for i in sample], [positions[i] for i in sample],
                        _adjusted(rows, policies, sample), kernels)
        for i, r in zip(sample, drawn):
            results[i] = r
    # The most likely ids with a chosen token (OpenAI's top_logprobs): the model's own, one
    # top-k per distinct count over the rows that asked for it.
    for n in sorted({p.top_logprobs for p in policies if p.top_logprobs}):
        idx = [i for i, p in enumerate(policies) if p.top_logprobs == n]
        for i, top in zip(idx, _top_k(_take(rows, idx), n)):
            results[i] = replace(results[i], top_token_ids=top.top_token_ids, top_logprobs=top.top_logprobs)
    return results
