"""One OpenMP thread pool per process: torch's parallel work stays on the executor's worker.

libgomp (torch's OpenMP runtime on Linux) gives each thread that starts a parallel region a
pool of threads of its own, and it keeps that pool until the thread ends. Once it manages
more threads than the process has CPUs, its barriers and region starts spin ~100 times
before they sleep in the kernel, where they spin ~300,000 times otherwise. A step's kernels
meet a barrier every few tens of microseconds: six a layer in a batch-1 step, two a chunk of
rows in a prefill's matmuls. On a 2-CPU machine, one more pool anywhere in the process (the
thread that loaded the model, the one that digests the weights) turned each of those waits
into a sleep and a wake: SmolLM2's batch-1 step took ~12 ms in-process instead of ~8.7, and a
32 x 128 batch_prefill 2.47-2.59 s instead of 2.22-2.31 (bench/RESULTS.md run 23).

So the worker is the one thread that keeps a pool:
- `in_passing_thread` runs the executor's construction (the load, the KV pool's zero fill)
  on a thread that ends with it, taking its pool along;
- `off_worker` runs the work kept off the worker (the weights' digest, reading an adapter)
  on asyncio's threads, each pinned to one OpenMP thread: no pool.

With one pool, libgomp's threads spin ~3 ms after each parallel region before they sleep.
Between two steps served over gRPC that held one of the two CPUs from the server's and the
client's threads: a batch-1 step through unary calls took 17.6 ms against 9.7 on a stream.
`spin_briefly`, called by `python -m service` and `python -m bench` before torch loads
libgomp, makes that ~0.1 ms: still longer than a barrier's wait inside a step or the gap
between two kernels of a forward, far shorter than the gap between two steps. Whoever
embeds an executor elsewhere can set GOMP_SPINCOUNT in the environment for the same.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# GOMP_SPINCOUNT: how long libgomp's waiting threads spin before they sleep, in its own unit
# (~100,000 a millisecond by libgomp's estimate; its default is 300,000).
SPIN_COUNT = 10_000

# The OpenMP runtimes torch links, by file name: GNU's, LLVM's and Intel's.
_RUNTIMES = ("libgomp", "libomp", "libiomp5")


@functools.cache
def openmp_runtime() -> str | None:
    """The path of the OpenMP runtime loaded into this process (torch's), or None where none is
    found (no /proc, or a torch built without OpenMP)."""
    import torch  # noqa: F401  (loads the runtime, before it is looked for)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    return next((p for p in sorted(paths) if p.rsplit("/", 1)[-1].startswith(_RUNTIMES)), None)


@functools.cache
def _set_num_threads() -> Callable[[int], object] | None:
    """The runtime's omp_set_num_threads (dlopen hands back the copy already loaded)."""
    path = openmp_runtime()
    try:
        return None if path is None else ctypes.CDLL(path).omp_set_num_threads
    except (OSError, AttributeError):
        return None


def single_threaded() -> None:
    """From now on the calling thread runs torch's ops on itself alone, without a pool.

    torch.set_num_threads would change every thread's count: OpenMP's count is per thread,
    and torch sets it on a thread's first parallel op from its process-wide setting, so that
    happens first (torch.get_num_threads), then this thread's count goes to one."""
    import torch

    set_threads = _set_num_threads()
    if set_threads is not None:
        torch.get_num_threads()
        set_threads(1)


def spin_briefly() -> bool:
    """Sets GOMP_SPINCOUNT to SPIN_COUNT unless it is set already (the operator's choice wins).
    libgomp reads its environment once, as it loads with torch: whether that is still ahead."""
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    return "torch" not in sys.modules


def _single_threaded_call(fn: Callable[..., T], *args: object) -> T:
    single_threaded()
    return fn(*args)


async def off_worker(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) on one of asyncio's threads, its torch ops single-threaded (no second pool)."""
    return await asyncio.to_thread(_single_threaded_call, fn, *args)


def in_passing_thread(fn: Callable[..., T], *args: object, name: str = "modelexec-load") -> T:
    """fn(*args) on a thread of its own that ends when fn returns, and with it the OpenMP pool
    its torch ops made; fn's result, or its exception raised here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller's thread
            outcome.append((False, e))

    thread = threading.Thread(target=run, name=name, daemon=True)  # a Ctrl-C meanwhile must not wait for it
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
