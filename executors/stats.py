"""Counters behind ExecutorStatus and the decode-batch part of CacheMetrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from executors.descriptions import DecodeBatchMetrics, ExecutorState

BUCKETS = (("m1", 1), ("m2", 2), ("m3_4", 4), ("m5_8", 8), ("m9_16", 16), ("m17_32", 32))


def bucket_of(n: int) -> str:
    for name, upper in BUCKETS:
        if n <= upper:
            return name
    return "m_gt_32"


@dataclass(slots=True)
class ExecutorStats:
    """Updated on the worker thread only; read anywhere (a torn read is harmless here)."""

    state: ExecutorState = ExecutorState.INITIALIZING
    current_batch_size: int = 0
    prefill_operations: int = 0
    decode_operations: int = 0
    prefill_calls: int = 0
    prefill_time_ns: int = 0
    decode_calls: int = 0
    decode_time_ns: int = 0
    last_operation_unix_s: float | None = None
    decode_batch_calls: int = 0
    decode_batch_items: int = 0
    decode_batch_max: int = 0
    decode_batch_last: int = 0
    force_full_logits_calls: int = 0
    buckets: dict[str, int] = field(default_factory=lambda: {n: 0 for n, _ in BUCKETS} | {"m_gt_32": 0})

    def begin(self, batch_size: int) -> None:
        self.state = ExecutorState.BUSY
        self.current_batch_size = batch_size

    def end(self, prefill_items: int, decode_items: int, elapsed_ns: int, full_logits: bool) -> None:
        """Account one finished call that ran these items."""
        self.state = ExecutorState.READY
        self.current_batch_size = 0
        self.last_operation_unix_s = time.time()
        self.prefill_operations += prefill_items
        self.decode_operations += decode_items
        if prefill_items:
            self.prefill_calls += 1
            self.prefill_time_ns += elapsed_ns
        elif decode_items:
            self.decode_calls += 1
            self.decode_time_ns += elapsed_ns
        if decode_items:
            self.decode_batch_calls += 1
            self.decode_batch_items += decode_items
            self.decode_batch_max = max(self.decode_batch_max, decode_items)
            self.decode_batch_last = decode_items
            self.force_full_logits_calls += full_logits
            self.buckets[bucket_of(decode_items)] += 1

    @property
    def avg_prefill_time_ms(self) -> float:
        return self.prefill_time_ns / self.prefill_calls / 1e6 if self.prefill_calls else 0.0

    @property
    def avg_decode_time_ms(self) -> float:
        return self.decode_time_ns / self.decode_calls / 1e6 if self.decode_calls else 0.0

    def decode_batch_metrics(self) -> DecodeBatchMetrics:
        calls = self.decode_batch_calls
        return DecodeBatchMetrics(
            calls=calls,
            total_items=self.decode_batch_items,
            avg_items_per_call=self.decode_batch_items / calls if calls else 0.0,
            max_items=self.decode_batch_max,
            last_items=self.decode_batch_last,
            force_full_logits_calls=self.force_full_logits_calls,
            singleton_fast_path_calls=self.buckets["m1"],
            unsupported_fallback_calls=0,
            lora_fallback_calls=0,
            bucket_calls=dict(self.buckets),
        )
