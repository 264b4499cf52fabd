"""keep_freed_memory(): glibc's malloc tuned for a process that receives large messages.

A client asking for FULL logits receives megabytes a step (a batch-32 step of SmolLM2: 32 x
49152 float32, 6.3 MB), and grpc and protobuf allocate fresh buffers for every message.
With glibc's defaults each buffer above its mmap threshold is a new mapping whose pages
fault in as they are first written, and freed memory at the heap's top goes back to the
kernel, to be faulted in again by the next message. On the 2-core EPYC of
bench/RESULTS.md (a KVM guest, where page faults are dear), a round trip that received a
fresh 6.3 MB response took 13.4-17.5 ms, and 5.4-7.4 ms once the client process had called
this (run 14).

It is process-wide and opt-in: a library should not change its host process's allocator
behind its back. A scheduler that asks for FULL logits calls it once at start. The cost is
memory: up to `trim_threshold` bytes of freed heap stay with the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems: 4 MiB * sizeof(long).
MAX_MMAP_THRESHOLD = 32 << 20


def keep_freed_memory(mmap_threshold: int = MAX_MMAP_THRESHOLD, trim_threshold: int = 128 << 20) -> bool:
    """Serve allocations up to `mmap_threshold` bytes from the heap, and keep up to
    `trim_threshold` bytes of freed memory at its top for reuse. Returns whether the C
    library took both settings: False where there is no glibc (musl's mallopt does nothing,
    macOS has none) or a value is out of range."""
    if not 0 <= mmap_threshold <= MAX_MMAP_THRESHOLD or trim_threshold < 0:
        raise ValueError(f"mmap_threshold must be in [0, {MAX_MMAP_THRESHOLD}] and trim_threshold >= 0, "
                         f"got {mmap_threshold} and {trim_threshold}")
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
