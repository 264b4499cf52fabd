"""All proto <-> domain conversion, behind one import so both clients share it line for line.

Request builders are named `<rpc>_request`, response parsers `<rpc>_response`; the
building blocks (tensors, handles, policies, metadata) are public so servers and test
fakes can reuse the exact same encoding.

This module is the façade: the code lives in the modules below, and every name is
re-exported here (the same objects, so calls through `convert.x` add no layer):

- convert_tensors: ndarray <-> Tensor, DataType names, bfloat16 bits
- convert_common: metadata maps and Values, devices, KV cache handles, call timing
- convert_logits: logits policies and logits outputs
- convert_requests: the step and cache request builders (`*_request`, `*_to_proto`)
- convert_responses: the response readers (`*_response`)
- convert_transfer: KV export/import messages
- convert_lora: LoRA adapter load/upload/unload requests
"""

from __future__ import annotations

from .convert_common import (
    LORA_ADAPTER_KEY,
    cache_id_of,
    device_from_proto,
    device_to_proto,
    fill_handle,
    handle_from_proto,
    handle_to_proto,
    metadata_from_proto,
    metadata_to_proto,
    python_to_value,
    timing_from_proto,
    value_to_python,
)
from .convert_logits import logits_from_proto, policy_from_proto, policy_to_proto
from .convert_lora import (
    LORA_ADAPTER_FILES,
    load_lora_adapter_request,
    unload_lora_adapter_request,
    upload_lora_adapter_request,
)
from .convert_requests import (
    batch_decode_request,
    batch_prefill_request,
    decode_input_to_proto,
    decode_request,
    forward_request,
    forward_verify_request,
    prefill_input_to_proto,
    prefill_request,
    release_cache_request,
    shutdown_request,
    token_list,
    truncate_kv_request,
    unified_decode_request,
    unified_item_to_proto,
)
from .convert_responses import (
    batch_decode_response,
    batch_prefill_response,
    cache_metrics_response,
    decode_response,
    forward_response,
    forward_verify_response,
    lora_metrics_response,
    prefill_response,
    release_cache_response,
    truncate_kv_response,
    unified_decode_response,
)
from .convert_tensors import (
    DTYPE_BY_NAME,
    bfloat16_bits_to_float32,
    data_type,
    float32_to_bfloat16_bits,
    ndarray_to_tensor,
    tensor_to_ndarray,
)
from .convert_transfer import (
    export_kv_request,
    import_kv_request,
    import_kv_response,
    serialize_import_kv_request,
)

__all__ = [
    "DTYPE_BY_NAME",
    "LORA_ADAPTER_FILES",
    "LORA_ADAPTER_KEY",
    "batch_decode_request",
    "batch_decode_response",
    "batch_prefill_request",
    "batch_prefill_response",
    "bfloat16_bits_to_float32",
    "cache_id_of",
    "cache_metrics_response",
    "data_type",
    "decode_input_to_proto",
    "decode_request",
    "decode_response",
    "device_from_proto",
    "device_to_proto",
    "export_kv_request",
    "fill_handle",
    "float32_to_bfloat16_bits",
    "forward_request",
    "forward_response",
    "forward_verify_request",
    "forward_verify_response",
    "handle_from_proto",
    "handle_to_proto",
    "import_kv_request",
    "import_kv_response",
    "load_lora_adapter_request",
    "logits_from_proto",
    "lora_metrics_response",
    "metadata_from_proto",
    "metadata_to_proto",
    "ndarray_to_tensor",
    "policy_from_proto",
    "policy_to_proto",
    "prefill_input_to_proto",
    "prefill_request",
    "prefill_response",
    "python_to_value",
    "release_cache_request",
    "release_cache_response",
    "serialize_import_kv_request",
    "shutdown_request",
    "tensor_to_ndarray",
    "timing_from_proto",
    "token_list",
    "truncate_kv_request",
    "truncate_kv_response",
    "unified_decode_request",
    "unified_decode_response",
    "unified_item_to_proto",
    "unload_lora_adapter_request",
    "upload_lora_adapter_request",
    "value_to_python",
]
