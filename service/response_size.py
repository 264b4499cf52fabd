"""The most bytes a call's response can take, known from its request before it runs.

gRPC refuses to send a message over `max_message_bytes` (RESOURCE_EXHAUSTED), but only
once the message is built: by then a step has appended its tokens, and the caller, told
the step failed, holds a stale handle (a prefill's new cache is left behind until its
lease runs out; a retry replays the same oversized answer). So each handler that computes
bounds its response from the request first, and refuses one that could not be sent
before the executor sees it: such a refusal changes nothing, like every RESOURCE_EXHAUSTED.

The bound is an upper one: the logits, hidden states or log-probabilities exactly, the
protobuf framing around them and the handles generously (a handle lists every block its
cache can hold after the step, each id as long as the pool's last one). Only requests
within a few hundred bytes per item of the limit are refused that would in fact have fit.
"""

from __future__ import annotations

from collections.abc import Sequence

from executors.errors import ResourceExhausted
from executors.types import (
    MAX_TOP_K,
    DecodeInput,
    DType,
    ForwardKind,
    KvCacheHandle,
    LogitsKind,
    LogitsPolicy,
    PrefillInput,
    UnifiedBatchItem,
)

ELEMENT_BYTES = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2}
ROW_FRAMING = 64  # a LogitsOutput around its payload: kind, tags, lengths, a tensor's dtype and shape, one id
ITEM_FRAMING = 192  # a handle's fixed fields and device, an item's own tags and lengths, a seq_id's framing
SERVER_CHOSEN_ID = 128  # a cache id the server picks is never longer than any id may be
RESPONSE_FRAMING = 256  # the response's timing and its own tags


class ResponseBudget:
    """Bounds a stepping call's response and refuses it when the bound passes the limit."""

    def __init__(self, max_message_bytes: int, vocab_size: int, hidden_size: int, block_size: int,
                 max_sequence_length: int, total_blocks: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.block_size = max(block_size, 1)
        self.top_k_entry = varint_bytes(vocab_size - 1) + 4  # an id and a float, each in a packed field
        self.block_id = varint_bytes(total_blocks - 1)
        # The most one item's answer can take: with the default limit a whole batch of them
        # fits, and the per-item sums below are skipped.
        largest_row = max(vocab_size * 4, min(vocab_size, MAX_TOP_K) * self.top_k_entry) + ROW_FRAMING
        self.largest_item = largest_row + self.handle(None, max_sequence_length, SERVER_CHOSEN_ID) + SERVER_CHOSEN_ID

    def fits_anyway(self, rows: int) -> bool:
        """`rows` items (or verified tokens) fit whatever each of them asks for."""
        return rows * self.largest_item + RESPONSE_FRAMING <= self.max_message_bytes

    def row(self, policy: LogitsPolicy) -> int:
        """One next-token output in the form `policy` asks for."""
        if policy.kind is LogitsKind.FULL:
            return self.vocab_size * ELEMENT_BYTES.get(policy.full_dtype, 4) + ROW_FRAMING
        if policy.kind is LogitsKind.TOP_K:  # a k out of range is the executor's to refuse, precisely
            return min(max(policy.k, 0), self.vocab_size, MAX_TOP_K) * self.top_k_entry + ROW_FRAMING
        return min(policy.top_logprobs, self.vocab_size, MAX_TOP_K) * self.top_k_entry + ROW_FRAMING

    def handle(self, cache_id: str | None, end_length: int, name_chars: int = 0, compact: bool = False) -> int:
        """A handle to a cache holding `end_length` tokens after the call, and its item's framing;
        `compact`: without its block ids (HANDLE_DETAIL_COMPACT)."""
        blocks = 0 if compact else -(-max(end_length, 0) // self.block_size)
        id_chars = len(cache_id) if cache_id else SERVER_CHOSEN_ID
        return blocks * self.block_id + id_chars + name_chars + ITEM_FRAMING

    # -- bounds: the most bytes each call's whole response can take ----------------------
    def prefills(self, inputs: Sequence[PrefillInput], compact: bool = False) -> int:
        return RESPONSE_FRAMING + sum(self.row(i.logits_policy)
                                      + self.handle(*_continued(i.kv_cache, len(i.input_ids)), compact=compact)
                                      for i in inputs)

    def decodes(self, inputs: Sequence[DecodeInput], compact: bool = False) -> int:
        return RESPONSE_FRAMING + sum(self.row(i.logits_policy) + self.handle(*_continued(i.kv_cache, 1), compact=compact)
                                      for i in inputs)

    def unified(self, items: Sequence[UnifiedBatchItem], compact: bool = False) -> int:
        return RESPONSE_FRAMING + sum((self.row(i.logits_policy) if i.is_final_chunk else 0)
                                      + self.handle(i.seq_id, i.pos_offset + i.token_count, len(i.seq_id), compact)
                                      for i in items)

    def verify(self, handle: KvCacheHandle, tokens: int, policy: LogitsPolicy, compact: bool = False) -> int:
        return RESPONSE_FRAMING + tokens * self.row(policy) + self.handle(*_continued(handle, tokens), compact=compact)

    def forward(self, tokens: int, kind: ForwardKind, dtype: DType) -> int:
        if kind is ForwardKind.TOKEN_LOGPROBS:
            payload = max(tokens - 1, 0) * 4
        else:
            width = self.hidden_size if kind is ForwardKind.HIDDEN_STATES else self.vocab_size
            payload = tokens * width * ELEMENT_BYTES.get(dtype, 4)
        return RESPONSE_FRAMING + payload + ROW_FRAMING

    # -- checks, before the call runs ------------------------------------------------------
    # `compact`: the call returns its handles without block ids (HANDLE_DETAIL_COMPACT).
    def check_prefills(self, inputs: Sequence[PrefillInput], where: str, compact: bool = False) -> None:
        if not self.fits_anyway(len(inputs)):
            self._check(self.prefills(inputs, compact), where)

    def check_decodes(self, inputs: Sequence[DecodeInput], where: str, compact: bool = False) -> None:
        if not self.fits_anyway(len(inputs)):
            self._check(self.decodes(inputs, compact), where)

    def check_unified(self, items: Sequence[UnifiedBatchItem], where: str, compact: bool = False) -> None:
        if not self.fits_anyway(len(items)):
            self._check(self.unified(items, compact), where)

    def check_verify(self, handle: KvCacheHandle, tokens: int, policy: LogitsPolicy, where: str,
                     compact: bool = False) -> None:
        if not self.fits_anyway(tokens):
            self._check(self.verify(handle, tokens, policy, compact), where)

    def check_forward(self, tokens: int, kind: ForwardKind, dtype: DType, where: str) -> None:
        self._check(self.forward(tokens, kind, dtype), where)

    def _check(self, total: int, where: str) -> None:
        if total > self.max_message_bytes:
            raise ResourceExhausted(
                f"{where}: the response could take up to {total} bytes, more than the server's max_message_bytes "
                f"{self.max_message_bytes}; nothing was run. Ask for fewer rows, a TOP_K, ARGMAX or SAMPLE logits "
                "policy or 16-bit FULL logits, or raise --max-message-bytes",
                field=where, reason="RESPONSE_TOO_LARGE", response_bytes_bound=total,
                max_message_bytes=self.max_message_bytes)


def varint_bytes(value: int) -> int:
    """The bytes protobuf's varint encoding of a non-negative value takes."""
    return max(1, -(-max(value, 0).bit_length() // 7))


def _continued(handle: KvCacheHandle | None, tokens: int) -> tuple[str | None, int]:
    """The cache id and its length after `tokens` more, for a call that continues `handle` (or starts one)."""
    if handle is None:
        return None, tokens
    return handle.cache_id, handle.sequence_length + tokens
