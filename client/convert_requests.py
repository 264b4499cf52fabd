"""Request builders: `<rpc>_request` and the `*_to_proto` of the items they carry.

These run on every step of a decode loop, so decode and unified items (and their handles)
are filled into the request's own fields rather than built as messages and copied in. The KV
transfer and LoRA adapter requests are in convert_transfer and convert_lora; client.convert
re-exports all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ._proto import executor_pb2 as pb
from .convert_common import _item_metadata, cache_id_of, fill_request_handle
from .convert_logits import _set_policy
from .convert_tensors import data_type
from .types import (
    DecodeInput,
    KvCacheHandle,
    LogitsPolicy,
    PrefillInput,
    TokenIds,
    UnifiedBatch,
    UnifiedBatchItem,
)


def token_list(tokens: TokenIds | Iterable[int], name: str = "tokens") -> list[int]:
    """Token ids as a list of ints; an ndarray must be 1-D and of an integer dtype."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        return tokens.tolist()
    return [int(t) for t in tokens]


def prefill_input_to_proto(item: PrefillInput) -> pb.PrefillInput:
    """One PrefillInput on the wire."""
    msg = pb.PrefillInput(input_ids=token_list(item.input_ids, "input_ids"))
    if item.attention_mask is not None:
        msg.attention_mask.extend(token_list(item.attention_mask, "attention_mask"))
    if item.position_ids is not None:
        msg.position_ids.extend(token_list(item.position_ids, "position_ids"))
    if item.kv_cache is not None:
        fill_request_handle(msg.kv_cache, item.kv_cache)
    _item_metadata(item.metadata, item.lora_adapter, msg.metadata)
    _set_policy(msg, item.logits_policy)
    return msg


def decode_input_to_proto(item: DecodeInput, msg: pb.DecodeInput | None = None) -> pb.DecodeInput:
    """One DecodeInput on the wire (filled into msg where given)."""
    msg = pb.DecodeInput() if msg is None else msg
    msg.token_id = int(item.token_id)
    fill_request_handle(msg.kv_cache, item.kv_cache)
    if item.position_id is not None:
        msg.position_id = int(item.position_id)
    if item.metadata or item.lora_adapter is not None:
        _item_metadata(item.metadata, item.lora_adapter, msg.metadata)
    _set_policy(msg, item.logits_policy)
    return msg


def unified_item_to_proto(item: UnifiedBatchItem, msg: pb.UnifiedBatchItem | None = None) -> pb.UnifiedBatchItem:
    """One UnifiedBatchItem on the wire (filled into msg where given)."""
    msg = pb.UnifiedBatchItem() if msg is None else msg
    msg.seq_id = item.seq_id
    msg.q_tokens.extend(token_list(item.q_tokens, "q_tokens"))
    msg.pos_offset = int(item.pos_offset)
    msg.is_final_chunk = bool(item.is_final_chunk)
    msg.feed_sampled_token = bool(item.feed_sampled_token)
    if item.metadata or item.lora_adapter is not None:
        _item_metadata(item.metadata, item.lora_adapter, msg.metadata)
    _set_policy(msg, item.logits_policy)
    return msg


# `compact` below: ask for the returned handles without block ids (HANDLE_DETAIL_COMPACT).
def handle_detail(compact: bool) -> int:
    return pb.HANDLE_DETAIL_COMPACT if compact else pb.HANDLE_DETAIL_UNSPECIFIED


def prefill_request(item: PrefillInput, compact: bool = False) -> pb.PrefillRequest:
    return pb.PrefillRequest(input=prefill_input_to_proto(item), handle_detail=handle_detail(compact))


def decode_request(item: DecodeInput, compact: bool = False) -> pb.DecodeRequest:
    request = pb.DecodeRequest(handle_detail=handle_detail(compact))
    decode_input_to_proto(item, request.input)
    return request


def batch_prefill_request(items: Sequence[PrefillInput], compact: bool = False) -> pb.BatchPrefillRequest:
    return pb.BatchPrefillRequest(inputs=[prefill_input_to_proto(i) for i in items], handle_detail=handle_detail(compact))


def batch_decode_request(items: Sequence[DecodeInput], compact: bool = False) -> pb.BatchDecodeRequest:
    request = pb.BatchDecodeRequest(handle_detail=handle_detail(compact))
    for item in items:
        decode_input_to_proto(item, request.inputs.add())
    return request


def unified_decode_request(batch: UnifiedBatch | Sequence[UnifiedBatchItem],
                           compact: bool = False) -> pb.UnifiedDecodeRequest:
    items = batch.items if isinstance(batch, UnifiedBatch) else batch
    request = pb.UnifiedDecodeRequest(handle_detail=handle_detail(compact))
    for item in items:
        unified_item_to_proto(item, request.batch.items.add())
    return request


_FORWARD_OUTPUTS: dict[str, int] = {
    "logits": pb.FORWARD_OUTPUT_LOGITS,
    "hidden_states": pb.FORWARD_OUTPUT_HIDDEN_STATES,
    "token_logprobs": pb.FORWARD_OUTPUT_TOKEN_LOGPROBS,
}
_FORWARD_NAMES: dict[int, str] = {code: name for name, code in _FORWARD_OUTPUTS.items()}
_FORWARD_NAMES[pb.FORWARD_OUTPUT_UNSPECIFIED] = "logits"


def forward_request(input_ids: TokenIds, output: str = "logits", dtype: str = "float32") -> pb.ForwardRequest:
    if output not in _FORWARD_OUTPUTS:
        raise ValueError(f"forward output must be one of {sorted(_FORWARD_OUTPUTS)}, got {output!r}")
    return pb.ForwardRequest(
        input_ids=token_list(input_ids, "input_ids"), output=_FORWARD_OUTPUTS[output], dtype=data_type(dtype)
    )


def forward_verify_request(
    kv_cache: KvCacheHandle, tokens: TokenIds, logits_policy: LogitsPolicy | None = None, compact: bool = False
) -> pb.ForwardVerifyRequest:
    msg = pb.ForwardVerifyRequest(tokens=token_list(tokens), handle_detail=handle_detail(compact))
    fill_request_handle(msg.kv_cache, kv_cache)
    _set_policy(msg, logits_policy)
    return msg


def truncate_kv_request(cache: KvCacheHandle | str, new_length: int) -> pb.TruncateKvRequest:
    return pb.TruncateKvRequest(cache_id=cache_id_of(cache), new_length=int(new_length))


def release_cache_request(cache: KvCacheHandle | str, expected_length: int | None = None) -> pb.ReleaseCacheRequest:
    msg = pb.ReleaseCacheRequest(cache_id=cache_id_of(cache))
    if expected_length is not None:
        msg.expected_length = int(expected_length)
    return msg


def shutdown_request(grace_seconds: float = 0.0) -> pb.ShutdownRequest:
    return pb.ShutdownRequest(grace_seconds=float(grace_seconds))
