"""Turning logits rows into what each item's LogitsPolicy asked for.

Argmax, top-k and sampling run where the logits are (the GPU, on one), so that only ids
and a few floats travel to the host unless the caller asked for the whole row.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch

from executors.types import DType, HostTensor, LogitsKind, LogitsPolicy, LogitsResult

TORCH_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}


def to_host_tensor(t: torch.Tensor, dtype: DType) -> HostTensor:
    """Copy a float tensor to the host in `dtype`; bfloat16 keeps its raw bits as uint16."""
    t = t.detach().to(TORCH_DTYPES[dtype]).contiguous().cpu()
    if dtype is DType.BFLOAT16:
        return HostTensor(dtype, t.view(torch.int16).numpy().view(np.uint16))
    return HostTensor(dtype, t.numpy())


def sampling_seed(seed: int | None, position: int) -> int:
    """A generator seed from the caller's seed and the sampled token's position.

    Mixing in the position makes successive steps draw different numbers while a retried
    step (same seed, same position) draws the same one.
    """
    if seed is None:
        return secrets.randbits(63)
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    mixed ^= mixed >> 31
    return mixed & ((1 << 63) - 1)


def _sample_row(row: torch.Tensor, logprobs: torch.Tensor, p: LogitsPolicy, position: int) -> LogitsResult:
    scaled = row / p.temperature if p.temperature > 0 else row
    if p.temperature == 0 or not bool(torch.isfinite(scaled).all()):
        # Temperature 0, or one so small that logits / temperature overflows: the limit of
        # sampling as the temperature goes to 0 is the argmax.
        tok = int(torch.argmax(row))
        return LogitsResult(LogitsKind.SAMPLE, token_id=tok, logprob=float(logprobs[tok]), sampling_logprob=0.0)
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep a token if the mass before it is still below top_p: the smallest set whose
        # mass reaches top_p, and never an empty one.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = order[before >= p.top_p]
        probs = probs.index_fill(0, drop, 0.0)
        probs = probs / probs.sum()
    gen = torch.Generator(device=probs.device).manual_seed(sampling_seed(p.seed, position))
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return LogitsResult(
        LogitsKind.SAMPLE,
        token_id=tok,
        logprob=float(logprobs[tok]),
        sampling_logprob=float(torch.log(probs[tok])),
    )


def apply_policies(
    rows: torch.Tensor, policies: Sequence[LogitsPolicy], positions: Sequence[int]
) -> list[LogitsResult]:
    """One LogitsResult per row of `rows` ([n, vocab]).

    positions[i] is the position of the token row i predicts; it seeds sampling.
    """
    rows = rows.float()
    need_logprobs = any(p.kind is not LogitsKind.FULL for p in policies)
    logprobs = torch.log_softmax(rows, dim=-1) if need_logprobs else None
    results: list[LogitsResult] = []
    for i, p in enumerate(policies):
        if p.kind is LogitsKind.FULL:
            results.append(LogitsResult(LogitsKind.FULL, logits=to_host_tensor(rows[i], p.full_dtype)))
        elif p.kind is LogitsKind.ARGMAX:
            tok = int(torch.argmax(rows[i]))
            results.append(LogitsResult(LogitsKind.ARGMAX, token_id=tok, logprob=float(logprobs[i, tok])))
        elif p.kind is LogitsKind.TOP_K:
            top = torch.topk(logprobs[i], p.k)  # sorted, highest first
            results.append(
                LogitsResult(
                    LogitsKind.TOP_K,
                    top_token_ids=tuple(int(t) for t in top.indices.tolist()),
                    top_logprobs=tuple(float(v) for v in top.values.tolist()),
                )
            )
        else:
            results.append(_sample_row(rows[i], logprobs[i], p, positions[i]))
    return results
