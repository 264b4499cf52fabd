"""LogitsAdjustments: a sampler's penalties, bias and allow-list, as an item asks for them.

They change the logits an ARGMAX or SAMPLE policy chooses from, in this order:

1. penalties on the listed token ids: CTRL's repetition penalty on each (a positive logit
   divided by it, a negative one multiplied), then `frequency_penalty * count`, and
   `presence_penalty` where the count is at least 1, subtracted (OpenAI's). A count is how
   often the id was generated; 0 marks an id seen only in the prompt, so one list gives
   vLLM's scopes: the repetition penalty over prompt and output, the others over output;
2. `logit_bias` added;
3. with `allowed_token_ids`, every other token masked out;
4. `banned_token_ids` masked out (at least one token must be left).

The executor keeps no token history for the penalties: the caller sends the ids they count
with every step. A retried step is then the same request with the same answer, and a
truncated or moved cache has no penalty state to undo or carry.

Torch-free (the service validates with it); logits_adjust.py applies them to a batch of rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from executors.errors import InvalidParameter

# OpenAI's ranges; they also keep every adjusted logit of a finite row finite.
MAX_PRESENCE_PENALTY = 2.0
MAX_FREQUENCY_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class LogitsAdjustments:
    """One item's adjustments; hashable, so a retried step's request compares equal."""

    penalized_token_ids: tuple[int, ...] = ()  # distinct ids the penalties apply to
    penalized_token_counts: tuple[int, ...] = ()  # times generated, same order (0: prompt only); empty: 1 each
    repetition_penalty: float = 1.0  # 1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias), ids increasing
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token
    banned_token_ids: tuple[int, ...] = ()

    @property
    def penalizes(self) -> bool:
        """Whether the penalties change a logit: ids listed, and a penalty that is not neutral."""
        return bool(self.penalized_token_ids) and (self.repetition_penalty != 1.0 or bool(self.presence_penalty)
                                                   or bool(self.frequency_penalty))

    @property
    def changes_nothing(self) -> bool:
        return not (self.penalizes or self.logit_bias or self.allowed_token_ids or self.banned_token_ids)

    def counts(self) -> tuple[int, ...]:
        """The occurrence of each penalized id (1 each when the caller sent no counts)."""
        return self.penalized_token_counts or (1,) * len(self.penalized_token_ids)

    def validate(self, vocab_size: int, where: str) -> None:
        """Raise InvalidParameter naming the field at fault unless these fit a vocabulary."""
        _check_ids(self.penalized_token_ids, vocab_size, f"{where}.penalized_token_ids")
        if len(set(self.penalized_token_ids)) != len(self.penalized_token_ids):
            raise InvalidParameter(f"{where}.penalized_token_ids must list each id once; send repeats as "
                                   "penalized_token_counts", field=f"{where}.penalized_token_ids")
        counts = self.penalized_token_counts
        if counts and len(counts) != len(self.penalized_token_ids):
            raise InvalidParameter(
                f"{where}.penalized_token_counts has {len(counts)} entries for {len(self.penalized_token_ids)} "
                "penalized_token_ids; send one count per id, or none to count each once",
                field=f"{where}.penalized_token_counts")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidParameter(f"{where}.repetition_penalty must be finite and > 0, got {self.repetition_penalty}",
                                   field=f"{where}.repetition_penalty")
        for name, bound in (("presence_penalty", MAX_PRESENCE_PENALTY), ("frequency_penalty", MAX_FREQUENCY_PENALTY)):
            value = getattr(self, name)
            if not -bound <= value <= bound:  # NaN fails too
                raise InvalidParameter(f"{where}.{name} must be in [-{bound:g}, {bound:g}], got {value}",
                                       field=f"{where}.{name}")
        _check_ids([token for token, _ in self.logit_bias], vocab_size, f"{where}.logit_bias")
        for token, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidParameter(
                    f"{where}.logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
                    field=f"{where}.logit_bias")
        if len(self.allowed_token_ids) > vocab_size:  # the one list a repeat can make longer than the vocabulary
            raise InvalidParameter(f"{where}.allowed_token_ids holds {len(self.allowed_token_ids)} ids, more than the "
                                   f"vocabulary's {vocab_size}", field=f"{where}.allowed_token_ids")
        _check_ids(self.allowed_token_ids, vocab_size, f"{where}.allowed_token_ids")
        if len(self.banned_token_ids) > vocab_size:
            raise InvalidParameter(f"{where}.banned_token_ids holds {len(self.banned_token_ids)} ids, more than the "
                                   f"vocabulary's {vocab_size}", field=f"{where}.banned_token_ids")
        _check_ids(self.banned_token_ids, vocab_size, f"{where}.banned_token_ids")
        if self.banned_token_ids:
            banned = set(self.banned_token_ids)
            left = (set(self.allowed_token_ids) - banned) if self.allowed_token_ids else vocab_size - len(banned)
            if not left:
                raise InvalidParameter(f"{where}.banned_token_ids leaves no token to choose"
                                       + (" among allowed_token_ids" if self.allowed_token_ids else ""),
                                       field=f"{where}.banned_token_ids")


def _check_ids(ids: Sequence[int], vocab_size: int, where: str) -> None:
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        token = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidParameter(f"{where} holds token id {token}, outside the vocabulary [0, {vocab_size})",
                               field=where)
