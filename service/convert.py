"""Conversion between modelexec.v1 messages and executor domain types, in one place.

Structural checks happen here (required fields, enum values, byte lengths); anything that
needs the model or the caches (vocabulary range, cache lengths) is the executor's job.
Errors name the field at fault as a path from the request root ("inputs[2].kv_cache").
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2

from executors import descriptions as desc
from executors import types as t
from executors.adapters import ADAPTER_NAME
from executors.adjustments import LogitsAdjustments
from executors.errors import InvalidParameter
from generated.modelexec.v1 import executor_pb2 as pb

# -- enums -----------------------------------------------------------------------------------
DTYPE_TO_PB = {
    t.DType.FLOAT32: pb.DATA_TYPE_FLOAT32,
    t.DType.FLOAT16: pb.DATA_TYPE_FLOAT16,
    t.DType.BFLOAT16: pb.DATA_TYPE_BFLOAT16,
    t.DType.INT32: pb.DATA_TYPE_INT32,
    t.DType.INT64: pb.DATA_TYPE_INT64,
    t.DType.UINT32: pb.DATA_TYPE_UINT32,
    t.DType.INT8: pb.DATA_TYPE_INT8,
    t.DType.UINT8: pb.DATA_TYPE_UINT8,
    t.DType.BOOL: pb.DATA_TYPE_BOOL,
}
DTYPE_FROM_PB = {v: k for k, v in DTYPE_TO_PB.items()}
# Little-endian NumPy layout of each dtype on the wire (bfloat16 travels as its uint16 bits).
WIRE_NUMPY = {
    t.DType.FLOAT32: "<f4", t.DType.FLOAT16: "<f2", t.DType.BFLOAT16: "<u2", t.DType.INT32: "<i4",
    t.DType.INT64: "<i8", t.DType.UINT32: "<u4", t.DType.INT8: "i1", t.DType.UINT8: "u1", t.DType.BOOL: "u1",
}
LOGITS_KIND_TO_PB = {
    t.LogitsKind.FULL: pb.LOGITS_KIND_FULL,
    t.LogitsKind.ARGMAX: pb.LOGITS_KIND_ARGMAX,
    t.LogitsKind.TOP_K: pb.LOGITS_KIND_TOP_K,
    t.LogitsKind.SAMPLE: pb.LOGITS_KIND_SAMPLE,
}
FORWARD_FROM_PB = {
    pb.FORWARD_OUTPUT_UNSPECIFIED: t.ForwardKind.LOGITS,
    pb.FORWARD_OUTPUT_LOGITS: t.ForwardKind.LOGITS,
    pb.FORWARD_OUTPUT_HIDDEN_STATES: t.ForwardKind.HIDDEN_STATES,
    pb.FORWARD_OUTPUT_TOKEN_LOGPROBS: t.ForwardKind.TOKEN_LOGPROBS,
}
FORWARD_TO_PB = {
    t.ForwardKind.LOGITS: pb.FORWARD_OUTPUT_LOGITS,
    t.ForwardKind.HIDDEN_STATES: pb.FORWARD_OUTPUT_HIDDEN_STATES,
    t.ForwardKind.TOKEN_LOGPROBS: pb.FORWARD_OUTPUT_TOKEN_LOGPROBS,
}
DEVICE_TYPE_TO_PB = {"cpu": pb.DEVICE_TYPE_CPU, "cuda": pb.DEVICE_TYPE_CUDA, "rocm": pb.DEVICE_TYPE_ROCM,
                     "mps": pb.DEVICE_TYPE_METAL, "metal": pb.DEVICE_TYPE_METAL}
MODEL_TYPE_TO_PB = {m: pb.ModelType.Value(f"MODEL_TYPE_{m.name}") for m in desc.ModelType}
ATTENTION_TO_PB = {a: pb.AttentionType.Value(f"ATTENTION_TYPE_{a.name}") for a in desc.AttentionType}
STATE_TO_PB = {s: pb.ExecutorState.Value(f"EXECUTOR_STATE_{s.name}") for s in desc.ExecutorState}


def _dtype(value: int, where: str, default: t.DType | None = None) -> t.DType:
    if value == pb.DATA_TYPE_UNSPECIFIED and default is not None:
        return default
    try:
        return DTYPE_FROM_PB[value]
    except KeyError:
        raise InvalidParameter(f"{where} = {value} is not a supported DataType", field=where) from None


# -- requests --------------------------------------------------------------------------------
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_CHARS = 128
# Keys the ferrum engine gives a meaning to, and what each must hold.
KNOWN_METADATA_KINDS = {
    "ferrum_require_full_logits": "boolean",
    "ferrum_lora_adapter": "string",
    "ferrum_lora_path": "string",
    "ferrum_kv_capacity_hint": "count",
    "ferrum_kv_admission_target_len": "count",
}


def json_kind(value: Any) -> str:
    """The JSON kind of a metadata value; whole non-negative numbers are also a "count"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "count" if value >= 0 and float(value).is_integer() else "number"
    return {str: "string", list: "list", dict: "object"}[type(value)]


def metadata(fields: Any, where: str) -> dict[str, Any]:
    if not fields:  # the usual case: nothing to check, no JSON conversion
        return {}
    if len(fields) > MAX_METADATA_ENTRIES:
        raise InvalidParameter(f"{where} has {len(fields)} entries, more than {MAX_METADATA_ENTRIES}", field=where)
    try:
        values = json_format.MessageToDict(struct_pb2.Struct(fields=fields))
    except (json_format.Error, ValueError) as e:
        raise InvalidParameter(f"{where} is not valid JSON-like metadata: {e}", field=where) from None
    for key, value in values.items():
        if not 0 < len(key) <= MAX_METADATA_KEY_CHARS:
            raise InvalidParameter(f"{where} keys must have 1 to {MAX_METADATA_KEY_CHARS} characters", field=where)
        kind = KNOWN_METADATA_KINDS.get(key)
        if kind is not None and json_kind(value) != kind:
            wanted = "a whole number >= 0" if kind == "count" else f"a {kind}"
            raise InvalidParameter(f"{where}[{key!r}] must be {wanted}, got {value!r}", field=f"{where}.{key}")
    if values.get("ferrum_lora_adapter") == "":
        raise InvalidParameter(f"{where}['ferrum_lora_adapter'] must name a loaded adapter, got ''",
                               field=f"{where}.ferrum_lora_adapter")
    # ferrum sends the adapter's name and path together; adapters are loaded by name here
    # (LoadLoraAdapter, --lora-dir), so a path alone names nothing.
    if "ferrum_lora_path" in values and "ferrum_lora_adapter" not in values:
        raise InvalidParameter(f"{where}['ferrum_lora_path'] needs ferrum_lora_adapter, the loaded adapter's name",
                               field=f"{where}.ferrum_lora_path")
    return values


DEFAULT_POLICY = t.LogitsPolicy()  # frozen: one instance serves every item that leaves it unset
ARGMAX_POLICY = t.LogitsPolicy(t.LogitsKind.ARGMAX)


def logits_policy(msg: pb.LogitsPolicy, where: str) -> t.LogitsPolicy:
    which = msg.WhichOneof("policy")
    adjustments = logits_adjustments(msg.adjustments) if msg.HasField("adjustments") else None
    if which is None:
        return DEFAULT_POLICY if adjustments is None else t.LogitsPolicy(adjustments=adjustments)
    if which == "argmax":
        if adjustments is None and not msg.argmax.top_logprobs:
            return ARGMAX_POLICY
        return t.LogitsPolicy(t.LogitsKind.ARGMAX, adjustments=adjustments, top_logprobs=msg.argmax.top_logprobs)
    if which == "full":
        return t.LogitsPolicy(t.LogitsKind.FULL, full_dtype=_dtype(msg.full.dtype, f"{where}.full.dtype", t.DType.FLOAT32),
                              adjustments=adjustments)
    if which == "top_k":
        return t.LogitsPolicy(t.LogitsKind.TOP_K, k=msg.top_k.k, adjustments=adjustments)
    s = msg.sample
    return t.LogitsPolicy(
        t.LogitsKind.SAMPLE,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        top_logprobs=s.top_logprobs,
        adjustments=adjustments,
    )


def logits_adjustments(msg: pb.LogitsAdjustments) -> LogitsAdjustments:
    """The domain form; ranges are checked with the policy (LogitsPolicy.validate)."""
    return LogitsAdjustments(
        penalized_token_ids=tuple(msg.penalized_token_ids),
        penalized_token_counts=tuple(msg.penalized_token_counts),
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        allowed_token_ids=tuple(msg.allowed_token_ids),
        banned_token_ids=tuple(msg.banned_token_ids),
    )


_HANDLE_DETAILS = (pb.HANDLE_DETAIL_UNSPECIFIED, pb.HANDLE_DETAIL_FULL, pb.HANDLE_DETAIL_COMPACT)


def compact_handles(request) -> bool:
    """Whether a stepping request asks for its handles without block ids (HANDLE_DETAIL_COMPACT)."""
    detail = request.handle_detail
    if detail not in _HANDLE_DETAILS:  # a value of a newer contract, or a mistake: never guessed at
        raise InvalidParameter(f"handle_detail {detail} is not a HandleDetail: use HANDLE_DETAIL_FULL (1) "
                               "or HANDLE_DETAIL_COMPACT (2)", field="handle_detail")
    return detail == pb.HANDLE_DETAIL_COMPACT


def kv_handle(msg: pb.KvCacheHandle, where: str) -> t.KvCacheHandle:
    cache_id = msg.cache_id
    if not cache_id:
        raise InvalidParameter(f"{where}.cache_id is required", field=f"{where}.cache_id")
    return t.KvCacheHandle(cache_id=cache_id, sequence_length=msg.block_table.sequence_length)


def prefill_input(msg: pb.PrefillInput, where: str) -> t.PrefillInput:
    return t.PrefillInput(
        input_ids=msg.input_ids,
        kv_cache=kv_handle(msg.kv_cache, f"{where}.kv_cache") if msg.HasField("kv_cache") else None,
        position_ids=msg.position_ids or None,
        attention_mask=msg.attention_mask or None,
        metadata=metadata(msg.metadata, f"{where}.metadata"),
        logits_policy=logits_policy(msg.logits_policy, f"{where}.logits_policy"),
    )


def decode_input(msg: pb.DecodeInput, where: str) -> t.DecodeInput:
    if not msg.HasField("token_id"):
        raise InvalidParameter(f"{where}.token_id is required", field=f"{where}.token_id")
    if not msg.HasField("kv_cache"):
        raise InvalidParameter(f"{where}.kv_cache is required: decode continues a prefilled cache",
                               field=f"{where}.kv_cache")
    fields = msg.metadata
    return t.DecodeInput(
        token_id=msg.token_id,
        kv_cache=kv_handle(msg.kv_cache, f"{where}.kv_cache"),
        position_id=msg.position_id if msg.HasField("position_id") else None,
        metadata=metadata(fields, f"{where}.metadata") if fields else {},
        logits_policy=logits_policy(msg.logits_policy, f"{where}.logits_policy"),
    )


def item_tokens(msg: pb.UnifiedBatchItem) -> int:
    """Tokens a unified item runs: its q_tokens, or the one a fed item runs."""
    return 1 if msg.feed_sampled_token else len(msg.q_tokens)


def unified_item(msg: pb.UnifiedBatchItem, where: str) -> t.UnifiedBatchItem:
    fields = msg.metadata
    return t.UnifiedBatchItem(
        seq_id=msg.seq_id,
        q_tokens=msg.q_tokens,
        pos_offset=msg.pos_offset,
        is_final_chunk=msg.is_final_chunk,
        metadata=metadata(fields, f"{where}.metadata") if fields else {},
        logits_policy=logits_policy(msg.logits_policy, f"{where}.logits_policy"),
        feed_sampled_token=msg.feed_sampled_token,
    )


def forward_kind(value: int) -> t.ForwardKind:
    try:
        return FORWARD_FROM_PB[value]
    except KeyError:
        raise InvalidParameter(f"output = {value} is not a ForwardOutput", field="output") from None


def forward_dtype(value: int) -> t.DType:
    return _dtype(value, "dtype", t.DType.FLOAT32)


def verify_handle(msg: pb.ForwardVerifyRequest) -> t.KvCacheHandle:
    if not msg.HasField("kv_cache"):
        raise InvalidParameter("kv_cache is required", field="kv_cache")
    return kv_handle(msg.kv_cache, "kv_cache")


def cache_id(value: str) -> str:
    if not value:
        raise InvalidParameter("cache_id is required", field="cache_id")
    return value


def lora_name(value: str) -> str:
    if not ADAPTER_NAME.fullmatch(value):
        raise InvalidParameter(f"name must be 1 to 128 characters from [A-Za-z0-9._:-], got {value!r}", field="name")
    return value


def lora_source(msg: pb.LoadLoraAdapterRequest) -> desc.LoraSource:
    lora_name(msg.name)
    which = msg.WhichOneof("source")
    if which is None:
        raise InvalidParameter("a source is required: path (under the server's --lora-dir) or inline files",
                               field="source")
    if which == "path":
        if not msg.path:
            raise InvalidParameter("path must name a directory under the server's --lora-dir", field="path")
        return desc.LoraSource(path=msg.path)
    for name in ("adapter_config_json", "adapter_model_safetensors"):
        if not getattr(msg.inline, name):
            raise InvalidParameter(f"inline.{name} is empty", field=f"inline.{name}")
    return desc.LoraSource(config_json=msg.inline.adapter_config_json,
                        safetensors=msg.inline.adapter_model_safetensors)
