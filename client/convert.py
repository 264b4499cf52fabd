"""All proto <-> domain conversion, in one module so both clients share it line for line.

Request builders are named `<rpc>_request`, response parsers `<rpc>_response`; the
building blocks (tensors, handles, policies, metadata) are public so servers and test
fakes can reuse the exact same encoding.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format, struct_pb2

from ._proto import executor_pb2 as pb
from .types import (
    CallTiming,
    DecodeInput,
    DecodeOutput,
    ForwardOutput,
    ForwardVerifyOutput,
    ImportResult,
    KvCacheHandle,
    LogitsOutput,
    LogitsPolicy,
    PrefillInput,
    PrefillOutput,
    ReleaseResult,
    TokenIds,
    TruncateResult,
    UnifiedBatch,
    UnifiedBatchItem,
    UnifiedItemResult,
)

# ---------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------

# Wire layout of each DataType; BFLOAT16 is carried as raw uint16 bits (NumPy has no bf16).
_WIRE_DTYPES: dict[int, np.dtype] = {
    pb.DATA_TYPE_FLOAT32: np.dtype("<f4"),
    pb.DATA_TYPE_FLOAT16: np.dtype("<f2"),
    pb.DATA_TYPE_BFLOAT16: np.dtype("<u2"),
    pb.DATA_TYPE_INT32: np.dtype("<i4"),
    pb.DATA_TYPE_INT64: np.dtype("<i8"),
    pb.DATA_TYPE_UINT32: np.dtype("<u4"),
    pb.DATA_TYPE_INT8: np.dtype("i1"),
    pb.DATA_TYPE_UINT8: np.dtype("u1"),
    pb.DATA_TYPE_BOOL: np.dtype("?"),
}

DTYPE_BY_NAME: dict[str, int] = {
    "float32": pb.DATA_TYPE_FLOAT32,
    "float16": pb.DATA_TYPE_FLOAT16,
    "bfloat16": pb.DATA_TYPE_BFLOAT16,
    "int32": pb.DATA_TYPE_INT32,
    "int64": pb.DATA_TYPE_INT64,
    "uint32": pb.DATA_TYPE_UINT32,
    "int8": pb.DATA_TYPE_INT8,
    "uint8": pb.DATA_TYPE_UINT8,
    "bool": pb.DATA_TYPE_BOOL,
}

# DataType inferred from an ndarray's own dtype when the caller names none.
_DTYPE_BY_NUMPY: dict[np.dtype, int] = {
    np.dtype(v).newbyteorder("="): k for k, v in _WIRE_DTYPES.items() if k != pb.DATA_TYPE_BFLOAT16
}


def data_type(dtype: str | int) -> int:
    """A DataType enum value from its short name ("bfloat16") or the enum itself."""
    if isinstance(dtype, str):
        try:
            return DTYPE_BY_NAME[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BY_NAME)}") from None
    if int(dtype) not in _WIRE_DTYPES:
        raise ValueError(f"unsupported DataType {dtype!r}")
    return int(dtype)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact bf16 -> fp32: bf16 is the upper half of an fp32, so shift and reinterpret."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits with round-to-nearest-even, keeping NaNs NaN (as torch does)."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def tensor_to_ndarray(tensor: pb.Tensor) -> np.ndarray:
    """Decode a Tensor, checking its byte length against its shape.

    BFLOAT16 comes out as float32 (exact). Other dtypes are zero-copy, read-only views
    over the message bytes: a logits row is decoded on every step, so no copy is made.
    """
    if tensor.dtype not in _WIRE_DTYPES:
        raise ValueError(f"Tensor has unsupported dtype {tensor.dtype}")
    wire = _WIRE_DTYPES[tensor.dtype]
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"Tensor shape {shape} has a negative dimension")
    data = tensor.data
    expected = math.prod(shape) * wire.itemsize
    if len(data) != expected:
        raise ValueError(
            f"Tensor of dtype {pb.DataType.Name(tensor.dtype)} and shape {list(shape)} needs "
            f"{expected} bytes, got {len(data)}"
        )
    if tensor.dtype == pb.DATA_TYPE_BOOL:
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size and raw.max() > 1:
            raise ValueError("BOOL Tensor holds a byte other than 0 or 1")
    array = np.frombuffer(data, dtype=wire).reshape(shape)
    if tensor.dtype == pb.DATA_TYPE_BFLOAT16:
        return bfloat16_bits_to_float32(array)
    if not wire.isnative:
        array = array.astype(wire.newbyteorder("="))
    return array


def ndarray_to_tensor(array: Any, dtype: str | int | None = None) -> pb.Tensor:
    """Encode an array as a row-major little-endian Tensor.

    With no dtype the array's own dtype must map to a DataType (float64 does not: name
    one). For BFLOAT16 a uint16 array is taken as raw bits, anything else is rounded.
    """
    a = np.asarray(array)
    if dtype is None:
        try:
            code = _DTYPE_BY_NUMPY[a.dtype.newbyteorder("=")]
        except KeyError:
            raise ValueError(f"no DataType for numpy dtype {a.dtype}; pass dtype=") from None
    else:
        code = data_type(dtype)
    if code == pb.DATA_TYPE_BFLOAT16:
        bits = a.astype(np.uint16) if a.dtype == np.uint16 else float32_to_bfloat16_bits(a)
        data = bits.astype("<u2").tobytes()
    else:
        data = a.astype(_WIRE_DTYPES[code], copy=False).tobytes(order="C")
    return pb.Tensor(dtype=code, shape=a.shape, data=data)


# ---------------------------------------------------------------------------------------
# Metadata (map<string, google.protobuf.Value>)
# ---------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Normalise NumPy scalars/arrays and tuples to what json_format accepts."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def python_to_value(value: Any) -> struct_pb2.Value:
    """A JSON-like Python value as a google.protobuf.Value (numbers become doubles)."""
    return json_format.ParseDict(_plain(value), struct_pb2.Value())


def value_to_python(value: struct_pb2.Value) -> Any:
    """A google.protobuf.Value as a Python value; numbers come back as float."""
    return json_format.MessageToDict(value)


def metadata_to_proto(metadata: Mapping[str, Any] | None, target: MutableMapping[str, Any]) -> None:
    """Fill a proto metadata map field in place (proto map fields cannot be assigned)."""
    for key, value in (metadata or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"metadata keys must be str, got {type(key).__name__}")
        target[key].CopyFrom(python_to_value(value))


LORA_ADAPTER_KEY = "ferrum_lora_adapter"


def _item_metadata(
    metadata: Mapping[str, Any] | None, lora_adapter: str | None, target: MutableMapping[str, Any]
) -> None:
    """An item's metadata, with its `lora_adapter` put under the key the server reads."""
    metadata_to_proto(metadata, target)
    if lora_adapter is None:
        return
    if metadata and metadata.get(LORA_ADAPTER_KEY, lora_adapter) != lora_adapter:
        raise ValueError(f"lora_adapter {lora_adapter!r} contradicts metadata[{LORA_ADAPTER_KEY!r}] "
                         f"{metadata[LORA_ADAPTER_KEY]!r}")
    target[LORA_ADAPTER_KEY].string_value = lora_adapter


def metadata_from_proto(source: Mapping[str, struct_pb2.Value]) -> dict[str, Any]:
    """A proto metadata map as a plain dict."""
    return {key: value_to_python(value) for key, value in source.items()}


# ---------------------------------------------------------------------------------------
# Handles, devices, timing
# ---------------------------------------------------------------------------------------

_DEVICE_NAMES: dict[int, str] = {
    pb.DEVICE_TYPE_CPU: "cpu",
    pb.DEVICE_TYPE_CUDA: "cuda",
    pb.DEVICE_TYPE_ROCM: "rocm",
    pb.DEVICE_TYPE_METAL: "metal",
}
_DEVICE_TYPES: dict[str, int] = {name: code for code, name in _DEVICE_NAMES.items()}


def device_to_proto(device: str) -> pb.Device:
    """Parse "cuda:1" as Device(CUDA, 1); a bare "cpu"/"cuda" is index 0, "" is unset."""
    if not device:
        return pb.Device()
    name, _, index = device.partition(":")
    if name not in _DEVICE_TYPES or (index and not index.isdigit()):
        raise ValueError(f"bad device {device!r}; expected e.g. 'cpu', 'cuda:0', 'rocm:1', 'metal'")
    return pb.Device(type=_DEVICE_TYPES[name], index=int(index or 0))


_DEVICE_NAMED: dict[tuple[int, int], str] = {}


def device_from_proto(device: pb.Device) -> str:
    """Name a device as "cuda:0" (CPU 0 as plain "cpu", unset as the empty string)."""
    key = (device.type, device.index)
    known = _DEVICE_NAMED.get(key)
    if known is not None:
        return known
    name = _DEVICE_NAMES.get(device.type)
    if name is None:
        known = ""
    elif device.type == pb.DEVICE_TYPE_CPU and device.index == 0:
        known = "cpu"
    else:
        known = f"{name}:{device.index}"
    if len(_DEVICE_NAMED) < 256:  # a server names a handful
        _DEVICE_NAMED[key] = known
    return known


_DEVICE_WIRE: dict[str, pb.Device] = {}


def fill_handle(target: pb.KvCacheHandle, handle: KvCacheHandle) -> None:
    """Fill a KvCacheHandle field in place (a decode step's requests carry one per item:
    filling beats building messages and copying them in, 3x at batch 32)."""
    target.cache_id = handle.cache_id
    table = target.block_table
    table.block_ids.extend(handle.block_ids)
    table.sequence_length = handle.sequence_length
    table.block_size = handle.block_size
    target.num_layers = handle.num_layers
    target.num_kv_heads = handle.num_kv_heads
    target.head_dim = handle.head_dim
    device = _DEVICE_WIRE.get(handle.device)
    if device is None:
        device = device_to_proto(handle.device)
        if len(_DEVICE_WIRE) < 256:
            _DEVICE_WIRE[handle.device] = device
    target.device.CopyFrom(device)


def handle_to_proto(handle: KvCacheHandle) -> pb.KvCacheHandle:
    """The wire form of a handle, sent back unchanged as the contract asks."""
    msg = pb.KvCacheHandle()
    fill_handle(msg, handle)
    return msg


def handle_from_proto(handle: pb.KvCacheHandle) -> KvCacheHandle:
    """The domain form of a returned handle."""
    table = handle.block_table
    return KvCacheHandle(
        cache_id=handle.cache_id,
        sequence_length=table.sequence_length,
        block_ids=tuple(table.block_ids),
        block_size=table.block_size,
        num_layers=handle.num_layers,
        num_kv_heads=handle.num_kv_heads,
        head_dim=handle.head_dim,
        device=device_from_proto(handle.device),
    )


def cache_id_of(cache: KvCacheHandle | str) -> str:
    """Calls that address a cache by id accept the handle or the bare id."""
    return cache.cache_id if isinstance(cache, KvCacheHandle) else str(cache)


def timing_from_proto(timing: pb.CallTiming) -> CallTiming:
    """The domain form of CallTiming."""
    return CallTiming(queue_ns=timing.queue_ns, executor_ns=timing.executor_ns, total_ns=timing.total_ns)


# ---------------------------------------------------------------------------------------
# Logits policies and outputs
# ---------------------------------------------------------------------------------------

_KIND_NAMES: dict[int, str] = {
    pb.LOGITS_KIND_FULL: "full",
    pb.LOGITS_KIND_ARGMAX: "argmax",
    pb.LOGITS_KIND_TOP_K: "top_k",
    pb.LOGITS_KIND_SAMPLE: "sample",
}
_LOGITS_DTYPE_NAMES: dict[int, str] = {
    pb.DATA_TYPE_FLOAT32: "float32",
    pb.DATA_TYPE_BFLOAT16: "bfloat16",
    pb.DATA_TYPE_FLOAT16: "float16",
}


def policy_to_proto(policy: LogitsPolicy) -> pb.LogitsPolicy:
    """The wire form of a policy (callers leave the field unset for None)."""
    if policy.kind == "full":
        return pb.LogitsPolicy(full=pb.FullLogits(dtype=data_type(policy.dtype)))
    if policy.kind == "argmax":
        return pb.LogitsPolicy(argmax=pb.ArgmaxToken())
    if policy.kind == "top_k":
        return pb.LogitsPolicy(top_k=pb.TopKLogprobs(k=policy.k))
    if policy.kind == "sample":
        sample = pb.SampleToken(temperature=policy.temperature, top_k=policy.k)
        if policy.top_p is not None:
            sample.top_p = policy.top_p
        if policy.seed is not None:
            sample.seed = policy.seed
        return pb.LogitsPolicy(sample=sample)
    raise ValueError(f"unknown logits policy kind {policy.kind!r}")


def policy_from_proto(policy: pb.LogitsPolicy) -> LogitsPolicy | None:
    """The domain form of a policy; None when unset (full float32)."""
    which = policy.WhichOneof("policy")
    if which is None:
        return None
    if which == "full":
        return LogitsPolicy.full(_LOGITS_DTYPE_NAMES.get(policy.full.dtype, "float32"))  # type: ignore[arg-type]
    if which == "argmax":
        return LogitsPolicy.argmax()
    if which == "top_k":
        return LogitsPolicy.top_k(policy.top_k.k)
    s = policy.sample
    return LogitsPolicy.sample(
        s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else None,
        seed=s.seed if s.HasField("seed") else None,
    )


def _set_policy(target: Any, policy: LogitsPolicy | None) -> None:
    """target.logits_policy from policy (left unset for None), in place."""
    if policy is None:
        return
    if policy.kind == "argmax":
        target.logits_policy.argmax.SetInParent()
    else:
        target.logits_policy.CopyFrom(policy_to_proto(policy))


def logits_from_proto(output: pb.LogitsOutput) -> LogitsOutput:
    """The domain form of one LogitsOutput; only the fields of its kind are set."""
    kind = _KIND_NAMES.get(output.kind, "unspecified")
    if kind == "argmax":  # a decode step's usual answer: one constructor call
        return LogitsOutput(kind, token_id=output.token_id, logprob=output.logprob)
    result = LogitsOutput(kind=kind)
    if kind == "full":
        result.logits = tensor_to_ndarray(output.logits)
    elif kind == "sample":
        result.token_id = output.token_id
        result.logprob = output.logprob
        result.sampling_logprob = output.sampling_logprob
    elif kind == "top_k":
        result.top_token_ids = np.array(output.top_token_ids, dtype=np.int64)
        result.top_logprobs = np.array(output.top_logprobs, dtype=np.float32)
    return result


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------


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
        fill_handle(msg.kv_cache, item.kv_cache)
    _item_metadata(item.metadata, item.lora_adapter, msg.metadata)
    _set_policy(msg, item.logits_policy)
    return msg


def decode_input_to_proto(item: DecodeInput, msg: pb.DecodeInput | None = None) -> pb.DecodeInput:
    """One DecodeInput on the wire (filled into msg where given)."""
    msg = pb.DecodeInput() if msg is None else msg
    msg.token_id = int(item.token_id)
    fill_handle(msg.kv_cache, item.kv_cache)
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
    if item.metadata or item.lora_adapter is not None:
        _item_metadata(item.metadata, item.lora_adapter, msg.metadata)
    _set_policy(msg, item.logits_policy)
    return msg


def prefill_request(item: PrefillInput) -> pb.PrefillRequest:
    return pb.PrefillRequest(input=prefill_input_to_proto(item))


def decode_request(item: DecodeInput) -> pb.DecodeRequest:
    request = pb.DecodeRequest()
    decode_input_to_proto(item, request.input)
    return request


def batch_prefill_request(items: Sequence[PrefillInput]) -> pb.BatchPrefillRequest:
    return pb.BatchPrefillRequest(inputs=[prefill_input_to_proto(i) for i in items])


def batch_decode_request(items: Sequence[DecodeInput]) -> pb.BatchDecodeRequest:
    request = pb.BatchDecodeRequest()
    for item in items:
        decode_input_to_proto(item, request.inputs.add())
    return request


def unified_decode_request(batch: UnifiedBatch | Sequence[UnifiedBatchItem]) -> pb.UnifiedDecodeRequest:
    items = batch.items if isinstance(batch, UnifiedBatch) else batch
    request = pb.UnifiedDecodeRequest()
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
    kv_cache: KvCacheHandle, tokens: TokenIds, logits_policy: LogitsPolicy | None = None
) -> pb.ForwardVerifyRequest:
    msg = pb.ForwardVerifyRequest(kv_cache=handle_to_proto(kv_cache), tokens=token_list(tokens))
    _set_policy(msg, logits_policy)
    return msg


def truncate_kv_request(cache: KvCacheHandle | str, new_length: int) -> pb.TruncateKvRequest:
    return pb.TruncateKvRequest(cache_id=cache_id_of(cache), new_length=int(new_length))


def release_cache_request(cache: KvCacheHandle | str, expected_length: int | None = None) -> pb.ReleaseCacheRequest:
    msg = pb.ReleaseCacheRequest(cache_id=cache_id_of(cache))
    if expected_length is not None:
        msg.expected_length = int(expected_length)
    return msg


def export_kv_request(cache: KvCacheHandle | str, start: int | None = None, end: int | None = None,
                      max_chunk_bytes: int = 0) -> pb.ExportKvRequest:
    msg = pb.ExportKvRequest(cache_id=cache_id_of(cache), max_chunk_bytes=int(max_chunk_bytes))
    if start is not None:
        msg.start_position = int(start)
    if end is not None:
        msg.end_position = int(end)
    return msg


def import_kv_request(export: pb.ExportKvResponse | bytes,
                      cache_id: str | None = None) -> pb.ImportKvRequest | bytes:
    """One message of an ExportKv stream as the ImportKv message that forwards it: the
    description becomes the start (naming the cache to create, or none for a server-chosen
    id), a chunk stays a chunk. A serialized chunk stays serialized: ExportKvResponse and
    ImportKvRequest both carry it as field 2, so its bytes are already the import's message."""
    if isinstance(export, bytes):
        parsed = pb.ExportKvResponse.FromString(export) if export[:1] != _CHUNK_TAG else None
        if parsed is None:
            return export
        export = parsed
    if export.WhichOneof("item") == "description":
        return pb.ImportKvRequest(start=pb.ImportKvStart(description=export.description, cache_id=cache_id or ""))
    out = pb.ImportKvRequest()
    out.chunk.CopyFrom(export.chunk)  # not ImportKvRequest(chunk=...): that serialises ~7x slower (upb)
    return out


_CHUNK_TAG = bytes([2 << 3 | 2])  # field 2, length-delimited: the oneof's chunk


def serialize_import_kv_request(message: pb.ImportKvRequest | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def import_kv_response(resp: pb.ImportKvResponse) -> ImportResult:
    return ImportResult(kv_cache=handle_from_proto(resp.kv_cache), imported_tokens=resp.imported_tokens,
                        replayed=resp.replayed, timing=timing_from_proto(resp.timing))


def shutdown_request(grace_seconds: float = 0.0) -> pb.ShutdownRequest:
    return pb.ShutdownRequest(grace_seconds=float(grace_seconds))


def load_lora_adapter_request(name: str, path: str) -> pb.LoadLoraAdapterRequest:
    """Load from a directory on the server, relative to its --lora-dir."""
    return pb.LoadLoraAdapterRequest(name=name, path=path)


# The two files of a PEFT adapter directory that LoadLoraAdapter takes inline.
LORA_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def upload_lora_adapter_request(name: str, local_dir: str | os.PathLike[str]) -> pb.LoadLoraAdapterRequest:
    """Load from a PEFT adapter directory on this machine: its two files travel inline."""
    directory = Path(local_dir)
    missing = [f for f in LORA_ADAPTER_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} is not a PEFT adapter directory: {', '.join(missing)} missing")
    config, weights = (directory / f for f in LORA_ADAPTER_FILES)
    return pb.LoadLoraAdapterRequest(name=name, inline=pb.InlineLoraAdapter(
        adapter_config_json=config.read_bytes(), adapter_model_safetensors=weights.read_bytes()))


def unload_lora_adapter_request(name: str) -> pb.UnloadLoraAdapterRequest:
    return pb.UnloadLoraAdapterRequest(name=name)


# ---------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------


def prefill_response(resp: pb.PrefillResponse) -> PrefillOutput:
    return _prefill_output(resp.output, timing_from_proto(resp.timing))


def decode_response(resp: pb.DecodeResponse) -> DecodeOutput:
    return _decode_output(resp.output, timing_from_proto(resp.timing))


def batch_prefill_response(resp: pb.BatchPrefillResponse) -> list[PrefillOutput]:
    """Each output carries the call's single timing."""
    timing = timing_from_proto(resp.timing)
    return [_prefill_output(o, timing) for o in resp.outputs]


def batch_decode_response(resp: pb.BatchDecodeResponse) -> list[DecodeOutput]:
    """Each output carries the call's single timing."""
    timing = timing_from_proto(resp.timing)
    return [_decode_output(o, timing) for o in resp.outputs]


def unified_decode_response(resp: pb.UnifiedDecodeResponse) -> list[UnifiedItemResult]:
    """Each result carries the call's single timing; logits is None for non-final items."""
    timing = timing_from_proto(resp.timing)
    return [
        UnifiedItemResult(
            seq_id=r.seq_id,
            logits=logits_from_proto(r.logits) if r.HasField("logits") else None,
            kv_cache=handle_from_proto(r.kv_cache),
            timing=timing,
        )
        for r in resp.results
    ]


def forward_response(resp: pb.ForwardResponse) -> ForwardOutput:
    return ForwardOutput(
        output=tensor_to_ndarray(resp.output),
        kind=_FORWARD_NAMES.get(resp.kind, "logits"),
        timing=timing_from_proto(resp.timing),
    )


def forward_verify_response(resp: pb.ForwardVerifyResponse) -> ForwardVerifyOutput:
    return ForwardVerifyOutput(
        outputs=[logits_from_proto(o) for o in resp.outputs],
        kv_cache=handle_from_proto(resp.kv_cache),
        timing=timing_from_proto(resp.timing),
    )


def truncate_kv_response(resp: pb.TruncateKvResponse) -> TruncateResult:
    return TruncateResult(
        kv_cache=handle_from_proto(resp.kv_cache),
        freed_blocks=resp.freed_blocks,
        timing=timing_from_proto(resp.timing),
    )


def release_cache_response(resp: pb.ReleaseCacheResponse) -> ReleaseResult:
    return ReleaseResult(released=resp.released, freed_blocks=resp.freed_blocks, timing=timing_from_proto(resp.timing))


def cache_metrics_response(resp: pb.GetCacheMetricsResponse) -> pb.CacheMetrics | None:
    """None when the executor keeps no cache metrics (the field is optional)."""
    return resp.metrics if resp.HasField("metrics") else None


def lora_metrics_response(resp: pb.GetLoraMetricsResponse) -> pb.LoraMetrics | None:
    """None when the executor has no LoRA support (the field is optional)."""
    return resp.metrics if resp.HasField("metrics") else None


def _prefill_output(output: pb.PrefillOutput, timing: CallTiming) -> PrefillOutput:
    return PrefillOutput(
        logits=logits_from_proto(output.logits), kv_cache=handle_from_proto(output.kv_cache), timing=timing
    )


def _decode_output(output: pb.DecodeOutput, timing: CallTiming) -> DecodeOutput:
    return DecodeOutput(
        logits=logits_from_proto(output.logits), kv_cache=handle_from_proto(output.kv_cache), timing=timing
    )
