"""Response readers: `<rpc>_response` and the `_*_output` helpers, proto -> domain types.

Like the request builders they run on every decode step, so each output is read straight
into its dataclass. client.convert re-exports them.
"""

from __future__ import annotations

from ._proto import executor_pb2 as pb
from .convert_common import handle_from_proto, timing_from_proto
from .convert_logits import logits_from_proto
from .convert_requests import _FORWARD_NAMES
from .convert_tensors import tensor_to_ndarray
from .types import (
    CallTiming,
    DecodeOutput,
    ForwardOutput,
    ForwardVerifyOutput,
    PrefillOutput,
    ReleaseResult,
    TruncateResult,
    UnifiedItemResult,
)


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
