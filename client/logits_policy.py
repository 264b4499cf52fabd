"""What a caller asks a step to return for its next token: LogitsPolicy, and the
LogitsAdjustments (penalties, bias, allow-list) an argmax or sample policy applies first.

Ranges are checked by the server, not here, so the server's INVALID_ARGUMENT stays the
single source of truth (its message names the field at fault).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeAlias

LogitsDType: TypeAlias = Literal["float32", "bfloat16", "float16"]
LogitsKindName: TypeAlias = Literal["full", "argmax", "top_k", "sample"]

_LOGITS_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class LogitsAdjustments:
    """Changes to the logits an argmax or sample policy chooses from, in this order:
    penalties on the penalized ids (repetition on each, then frequency * count, and
    presence where the count is at least 1, subtracted; a count is how often the id was
    generated, 0 for an id seen only in the prompt), the bias added, every token outside
    `allowed_token_ids` (when given) masked out, then `banned_token_ids`. The server keeps
    no history: send the tokens to penalize with each step.

    `build()` counts the tokens for you; the fields are the wire form.
    """

    penalized_token_ids: tuple[int, ...] = ()
    penalized_token_counts: tuple[int, ...] = ()  # times generated, same order (0: prompt only); empty: 1 each
    repetition_penalty: float | None = None  # None: 1, none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token
    banned_token_ids: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        generated_tokens: Iterable[int] = (),
        *,
        prompt_tokens: Iterable[int] = (),
        repetition_penalty: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        allowed_token_ids: Iterable[int] = (),
        banned_token_ids: Iterable[int] = (),
    ) -> LogitsAdjustments:
        """From the tokens generated so far (repeats included), which every penalty counts,
        and the prompt's, which only the repetition penalty does (vLLM's scopes); a bias
        per token id; the ids that may be chosen, and those that may not."""
        counts = Counter(int(t) for t in generated_tokens)
        for token in prompt_tokens:
            counts.setdefault(int(token), 0)
        return cls(
            penalized_token_ids=tuple(counts),
            penalized_token_counts=tuple(counts.values()) if any(c != 1 for c in counts.values()) else (),
            repetition_penalty=repetition_penalty,
            presence_penalty=float(presence_penalty),
            frequency_penalty=float(frequency_penalty),
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())),
            allowed_token_ids=tuple(int(t) for t in allowed_token_ids),
            banned_token_ids=tuple(int(t) for t in banned_token_ids),
        )


@dataclass(frozen=True, slots=True)
class LogitsPolicy:
    """What an item returns in place of a full logits row (unset/None: full float32).

    Build with the constructors; `k` is the number of entries for "top_k" and the top-k
    filter for "sample" (0 keeps all). `adjustments` apply to "argmax" and "sample", and
    `top_logprobs` asks them for the most likely ids too (OpenAI's top_logprobs).
    """

    kind: LogitsKindName
    dtype: LogitsDType = "float32"
    k: int = 0
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    min_p: float | None = None
    adjustments: LogitsAdjustments | None = None
    top_logprobs: int = 0

    @classmethod
    def full(cls, dtype: LogitsDType = "float32") -> LogitsPolicy:
        """The whole row; the 16-bit dtypes halve the bytes on the wire."""
        if dtype not in _LOGITS_DTYPES:
            raise ValueError(f"full logits dtype must be one of {_LOGITS_DTYPES}, got {dtype!r}")
        return cls(kind="full", dtype=dtype)

    @classmethod
    def argmax(cls, adjustments: LogitsAdjustments | None = None, top_logprobs: int = 0) -> LogitsPolicy:
        """The greedy token id (ties go to the lowest id), of the adjusted logits where
        `adjustments` are given; with top_logprobs, that many most likely ids as well."""
        return cls(kind="argmax", adjustments=adjustments, top_logprobs=int(top_logprobs))

    @classmethod
    def top_k(cls, k: int) -> LogitsPolicy:
        """The k most likely ids with their log-probabilities."""
        return cls(kind="top_k", k=int(k))

    @classmethod
    def sample(
        cls,
        temperature: float,
        top_k: int = 0,
        top_p: float | None = None,
        seed: int | None = None,
        min_p: float | None = None,
        adjustments: LogitsAdjustments | None = None,
        top_logprobs: int = 0,
    ) -> LogitsPolicy:
        """One token sampled on the executor; temperature 0 is greedy."""
        return cls(kind="sample", k=int(top_k), temperature=float(temperature), top_p=top_p, seed=seed,
                   min_p=min_p, adjustments=adjustments, top_logprobs=int(top_logprobs))


def with_banned(policy: LogitsPolicy, banned: Iterable[int]) -> LogitsPolicy:
    """`policy` with `banned` added to its banned ids (an argmax or sample policy): how a
    generation loop keeps end-of-sequence ids out until a minimum length."""
    if policy.kind not in ("argmax", "sample"):
        raise ValueError(f"a ban applies to argmax and sample policies, not {policy.kind!r}")
    adjustments = policy.adjustments or LogitsAdjustments()
    ids = tuple(sorted(set(adjustments.banned_token_ids) | {int(t) for t in banned}))
    return replace(policy, adjustments=replace(adjustments, banned_token_ids=ids))


@dataclass(frozen=True, slots=True)
class Penalties:
    """Penalties over a sequence's own tokens, which a generation loop (the CLI's generate,
    the scheduler) turns into each step's LogitsAdjustments: the repetition penalty over
    the prompt and the generated tokens, presence and frequency over the generated ones
    (vLLM's scopes). None and 0 are off."""

    repetition: float | None = None
    presence: float = 0.0
    frequency: float = 0.0

    def __bool__(self) -> bool:
        return self.repetition is not None or bool(self.presence) or bool(self.frequency)

    def apply(self, policy: LogitsPolicy, prompt: Sequence[int], generated: Sequence[int]) -> LogitsPolicy:
        """`policy` for the next step, its bias, allow-list and ban kept."""
        if policy.kind not in ("argmax", "sample"):
            raise ValueError(f"penalties apply to argmax and sample policies, not {policy.kind!r}")
        made = LogitsAdjustments.build(generated, prompt_tokens=prompt, repetition_penalty=self.repetition,
                                       presence_penalty=self.presence, frequency_penalty=self.frequency)
        if policy.adjustments is not None:
            made = replace(made, logit_bias=policy.adjustments.logit_bias,
                           allowed_token_ids=policy.adjustments.allowed_token_ids,
                           banned_token_ids=policy.adjustments.banned_token_ids)
        return replace(policy, adjustments=made)
