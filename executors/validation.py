"""Request validation for KvCacheExecutor: each call's arguments checked, no state read.

Every check a request can fail before it reaches the worker is here, with its precise
error message and field path (the tests hold both): token ids against the vocabulary,
attention masks and positions against the cache, a logits policy, the LoRA adapter named
in a request's metadata, a batch's size and its caches named once. Prefill, decode,
unified and verify requests come out as ItemSpecs, which the step (kv_step.py) runs;
whether a cache exists, whose it is and how long it is are the step's to check.
"""

from __future__ import annotations

from collections.abc import Sequence

from executors.errors import FailedPrecondition, InvalidParameter, OutOfRange
from executors.step_items import ItemSpec, Rows
from executors.types import (
    FLOAT_OUTPUT_DTYPES,
    DecodeInput,
    DType,
    ForwardKind,
    KvCacheHandle,
    LogitsPolicy,
    PrefillInput,
    UnifiedBatchItem,
)

LORA_ADAPTER_KEY = "ferrum_lora_adapter"


def check_tokens(tokens: Sequence[int], where: str, vocab_size: int) -> list[int]:
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise InvalidParameter(f"{where} must hold at least one token", field=where)
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParameter(
            f"{where}[{bad}] = {tokens[bad]} is outside the vocabulary [0, {vocab_size})",
            field=f"{where}[{bad}]",
        )
    return tokens


def prefill_spec(inp: PrefillInput, where: str, vocab_size: int) -> ItemSpec:
    tokens = check_tokens(inp.input_ids, f"{where}.input_ids", vocab_size)
    inp.logits_policy.validate(vocab_size, f"{where}.logits_policy")
    if inp.attention_mask is not None and len(inp.attention_mask) > 0:
        if len(inp.attention_mask) != len(tokens):
            raise InvalidParameter(
                f"{where}.attention_mask has {len(inp.attention_mask)} entries for {len(tokens)} input_ids",
                field=f"{where}.attention_mask")
        if any(m != 1 for m in inp.attention_mask):
            raise InvalidParameter(
                f"{where}.attention_mask must be all ones: each input is one unpadded sequence",
                field=f"{where}.attention_mask")
    handle = inp.kv_cache
    start = handle.sequence_length if handle is not None else 0
    if inp.position_ids is not None and len(inp.position_ids) > 0:
        if len(inp.position_ids) != len(tokens):  # malformed, whatever the cache holds
            raise InvalidParameter(
                f"{where}.position_ids has {len(inp.position_ids)} entries for {len(tokens)} input_ids",
                field=f"{where}.position_ids")
        expected = list(range(start, start + len(tokens)))
        if [int(p) for p in inp.position_ids] != expected:
            raise FailedPrecondition(
                f"{where}.position_ids must continue the cache: expected {start}..{start + len(tokens) - 1}",
                field=f"{where}.position_ids", reason="POSITION_MISMATCH")
    adapter = _adapter_name(inp.metadata, where)
    if handle is None:
        return ItemSpec(where, None, 0, True, tokens, Rows.LAST, inp.logits_policy, False, adapter)
    return ItemSpec(where, handle.cache_id, start, start == 0, tokens, Rows.LAST, inp.logits_policy, False,
                    adapter)


def decode_spec(inp: DecodeInput, where: str, vocab_size: int) -> ItemSpec:
    tokens = check_tokens([inp.token_id], f"{where}.token_id", vocab_size)
    inp.logits_policy.validate(vocab_size, f"{where}.logits_policy")
    length = inp.kv_cache.sequence_length
    if inp.position_id is not None and inp.position_id != length:
        raise FailedPrecondition(
            f"{where}.position_id {inp.position_id} does not continue the cache (length {length})",
            field=f"{where}.position_id", reason="POSITION_MISMATCH")
    return ItemSpec(where, inp.kv_cache.cache_id, length, False, tokens, Rows.LAST, inp.logits_policy, True,
                    _adapter_name(inp.metadata, where))


def unified_spec(it: UnifiedBatchItem, where: str, vocab_size: int) -> ItemSpec:
    if it.feed_sampled_token:
        return _fed_spec(it, where, vocab_size)
    tokens = check_tokens(it.q_tokens, f"{where}.q_tokens", vocab_size)
    if it.is_final_chunk:
        it.logits_policy.validate(vocab_size, f"{where}.logits_policy")
    if not it.seq_id and it.pos_offset != 0:
        raise InvalidParameter(f"{where}.seq_id is required when pos_offset > 0", field=f"{where}.seq_id")
    is_decode = it.pos_offset > 0 and len(tokens) == 1 and it.is_final_chunk
    rows = Rows.LAST if it.is_final_chunk else Rows.NONE
    return ItemSpec(where, it.seq_id or None, it.pos_offset, it.pos_offset == 0, tokens, rows,
                    it.logits_policy, is_decode, _adapter_name(it.metadata, where))


def _fed_spec(it: UnifiedBatchItem, where: str, vocab_size: int) -> ItemSpec:
    """A decode step of the token the cache's latest step sampled (found on the worker)."""
    if len(it.q_tokens) > 0:
        raise InvalidParameter(f"{where}.q_tokens must be empty when feed_sampled_token is set: the token "
                               "is the one the cache's latest step sampled", field=f"{where}.q_tokens")
    if not it.is_final_chunk:
        raise InvalidParameter(f"{where}.is_final_chunk must be true with feed_sampled_token: a fed token is "
                               "a decode step", field=f"{where}.is_final_chunk")
    if not it.seq_id or it.pos_offset == 0:
        raise InvalidParameter(f"{where}: feed_sampled_token continues a cache: seq_id and a pos_offset > 0 "
                               "are required", field=f"{where}.pos_offset" if it.seq_id else f"{where}.seq_id")
    it.logits_policy.validate(vocab_size, f"{where}.logits_policy")
    return ItemSpec(where, it.seq_id, it.pos_offset, False, [], Rows.LAST, it.logits_policy, True,
                    _adapter_name(it.metadata, where), feed=True)


def verify_spec(kv_cache: KvCacheHandle, tokens: Sequence[int], policy: LogitsPolicy, vocab_size: int) -> ItemSpec:
    """ForwardVerify: the tokens' logits at every position, continuing an existing cache."""
    tokens = check_tokens(tokens, "tokens", vocab_size)
    policy.validate(vocab_size, "logits_policy")
    return ItemSpec("kv_cache", kv_cache.cache_id, kv_cache.sequence_length, False, tokens, Rows.ALL,
                    policy, is_decode=True)


def check_forward(input_ids: Sequence[int], kind: ForwardKind, dtype: DType, vocab_size: int,
                  max_sequence_length: int) -> list[int]:
    """Forward (no cache): the sequence's tokens, once they and the output asked for are valid."""
    tokens = check_tokens(input_ids, "input_ids", vocab_size)
    if len(tokens) > max_sequence_length:
        raise OutOfRange(
            f"input_ids holds {len(tokens)} tokens, more than max_sequence_length "
            f"{max_sequence_length}", field="input_ids")
    if dtype not in FLOAT_OUTPUT_DTYPES:
        raise InvalidParameter(f"dtype must be FLOAT32, BFLOAT16 or FLOAT16, got {dtype.name}", field="dtype")
    if kind is ForwardKind.TOKEN_LOGPROBS and len(tokens) < 2:
        raise InvalidParameter("TOKEN_LOGPROBS needs at least two input_ids", field="input_ids")
    return tokens


def check_batch(specs: list[ItemSpec], where: str, max_batch_size: int) -> None:
    if not specs:
        raise InvalidParameter(f"{where} must hold at least one item", field=where)
    if len(specs) > max_batch_size:
        raise InvalidParameter(
            f"{where} holds {len(specs)} items, more than max_batch_size {max_batch_size}", field=where)
    seen: dict[str, str] = {}
    for s in specs:
        if s.cache_id is None:
            continue
        if s.cache_id in seen:
            raise InvalidParameter(
                f"{s.where} names cache {s.cache_id!r} already named by {seen[s.cache_id]}: "
                "one item per cache per call", field=s.where)
        seen[s.cache_id] = s.where


def _adapter_name(metadata: dict | None, where: str) -> str | None:
    """The LoRA adapter a request names in its metadata, or None."""
    name = (metadata or {}).get(LORA_ADAPTER_KEY)
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise InvalidParameter(f"{where}.metadata[{LORA_ADAPTER_KEY!r}] must be a non-empty string, got {name!r}",
                               field=f"{where}.metadata.{LORA_ADAPTER_KEY}")
    return name
