"""The small pieces every request and response shares: metadata maps, devices, handles, timing.

Metadata is a map<string, google.protobuf.Value> (with the key that carries an item's LoRA
adapter). A KvCacheHandle and its Device go out with each decode item and come back with each
output, so handles are filled in place and device names are cached for the per-step path.
client.convert re-exports these.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
from google.protobuf import json_format, struct_pb2

from ._proto import executor_pb2 as pb
from .types import CallTiming, KvCacheHandle

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
    table.held_blocks = handle.held_blocks
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


def fill_request_handle(target: pb.KvCacheHandle, handle: KvCacheHandle) -> None:
    """A handle sent back in a request: its id and length, all the executor reads of it. The block
    ids stay out: they grow with the cache (2048 for 32K tokens in 16-token blocks), on every step."""
    target.cache_id = handle.cache_id
    target.block_table.sequence_length = handle.sequence_length


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
        held_blocks=table.held_blocks,  # 0 from a server older than the field: KvCacheHandle counts the ids
    )


def cache_id_of(cache: KvCacheHandle | str) -> str:
    """Calls that address a cache by id accept the handle or the bare id."""
    return cache.cache_id if isinstance(cache, KvCacheHandle) else str(cache)


def timing_from_proto(timing: pb.CallTiming) -> CallTiming:
    """The domain form of CallTiming."""
    return CallTiming(queue_ns=timing.queue_ns, executor_ns=timing.executor_ns, total_ns=timing.total_ns)
