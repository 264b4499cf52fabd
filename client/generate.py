"""Generating text through a running server: tokenize, prefill, decode token by token, stream."""

from __future__ import annotations

from collections.abc import Iterator

from .blocking import ExecutorClient
from .logits_policy import with_banned
from .tokenizer import TextTokenizer
from .types import DecodeInput, LogitsPolicy, Penalties, PrefillInput


def generate_text(
    ex: ExecutorClient,
    tokenizer: TextTokenizer,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    policy: LogitsPolicy,
    stop_ids: set[int],
    penalties: Penalties | None = None,
    min_tokens: int = 0,
) -> Iterator[str]:
    """Yield the text of each new token as it comes; the cache is released however it ends.

    `penalties` are applied to every step's policy over the prompt and the tokens so far;
    `stop_ids` are banned until `min_tokens` tokens came.

    Text is yielded as the difference between successive decodings of all new ids, and held
    back while it ends in a partial UTF-8 character, so multi-token characters print whole.
    """
    new_ids: list[int] = []

    def step_policy() -> LogitsPolicy:
        step = penalties.apply(policy, prompt_ids, new_ids) if penalties else policy
        return with_banned(step, stop_ids) if len(new_ids) < min_tokens and stop_ids else step

    out = ex.prefill(PrefillInput(prompt_ids, logits_policy=step_policy()))
    handle = out.kv_cache
    try:
        shown = ""
        for _ in range(max_tokens):
            token = out.logits.token_id
            if token in stop_ids:
                break
            new_ids.append(token)
            text = tokenizer.decode(new_ids)
            if not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text
            out = ex.decode(DecodeInput(token, handle, logits_policy=step_policy()))
            handle = out.kv_cache
    finally:
        ex.release_cache(handle)
