"""A decode graph's few-row matmuls: per shape, the faster of torch's (cuBLAS) and triton_gemv.py's.

On an H100 a batch-1 decode step spends about half its device time in one-row matmuls that
cuBLAS streams at 0.45-1.5 TB/s, shape by shape, of the ~3 TB/s a copy reaches
(bench/RESULTS.md, runs 20 and 24). triton_gemv.py streams each weight once at full width, but which block shape does so
best depends on N, K and the row count, and for some shapes cuBLAS may stay ahead. So nothing
is guessed: the first call of each (rows, N, K, bias?, residual?, dtype) outside a capture (a
decode graph's warm-up step, which runs before its capture) checks each Triton block shape
against torch's result, times torch's matmul and each shape that passed over every layer's
weight of that shape (more bytes than the L2 holds, as in a step), and keeps the fastest.

Only decode graphs take these: replayed, a Triton kernel costs what torch's does to start,
while an eager step would pay Triton's Python launch (tens of microseconds) per matmul. The
executor turns them on with `LlmExecutorConfig.triton_gemv` (`--triton-gemv`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from executors.models import step_ops
from executors.models.triton_gemv import MAX_ROWS, gemv

log = logging.getLogger(__name__)

# (block_n, block_k, num_warps, split): narrow tiles keep every SM busy at N = 1024 (the o and
# down projections of a 0.6B model: 256 programs at block_n 4). On the H100 of run 24 this one
# beat 8x256 and 16x256 at every shape and row count, so those two are no longer tried (each
# costs compilations at start-up).
CANDIDATES: tuple[tuple[int, int, int, int], ...] = ((4, 512, 4, 1),)
# It streamed at 0.6-1.45 TB/s there, each program with a single 4 KB tile in flight, too few
# bytes to cover the memory's latency. More in flight, two ways (untimed yet: the timing at
# capture decides): long tiles of 8-16 KB for one or two rows, and K split among 4-8 programs
# per column block (their partial sums added by a second kernel) for up to four.
LONG_TILES: tuple[tuple[int, int, int, int], ...] = ((4, 1024, 4, 1), (4, 2048, 8, 1), (8, 1024, 8, 1))
SPLIT_TILES: tuple[tuple[int, int, int, int], ...] = ((8, 256, 4, 4), (8, 512, 4, 4), (16, 256, 4, 8))

# A block shape whose result is further than this from torch's (relative L2) is not used:
# float32 accumulation both ways, so only the inputs' rounding differs.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# ~5 ms at an H100's clock: long enough for the host to queue every timed call behind it, so
# the events time the device's work back to back, not Python's launches.
SLEEP_CYCLES = 10_000_000

Key = tuple[int, int, int, bool, bool, torch.dtype]
Config = tuple[int, ...]  # (block_n, block_k, num_warps[, split])


def default_candidates(rows: int) -> tuple[Config, ...]:
    if rows <= 2:
        return CANDIDATES + LONG_TILES + SPLIT_TILES
    return CANDIDATES + SPLIT_TILES if rows <= 4 else CANDIDATES


def config_name(cfg: Config) -> str:
    block_n, block_k, warps, *split = cfg
    return f"triton {block_n}x{block_k}/{warps}" + (f" split {split[0]}" if split and split[0] > 1 else "")


def device_ms(fn: Callable[[], object], passes: int = 3) -> float:
    """The least device time of `fn` over `passes`, each queued behind a sleep on the device."""
    fn()  # compiles and warms up
    best = float("inf")
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


class FewRowMatmuls:
    """linear / residual_linear for steps of up to MAX_ROWS rows, each shape's choice made once."""

    max_rows = MAX_ROWS  # read by fast_forward, which does not import triton

    def __init__(self, weights: Iterable[torch.Tensor], candidates: Sequence[Config] | None = None,
                 timer: Callable[[Callable[[], object]], float] | None = device_ms) -> None:
        """`weights`: every matmul weight a step reads, grouped here by shape for the timing.
        `candidates`: the block shapes to try (default_candidates for the step's rows when None).
        `timer=None` (a CPU, in Triton's interpreter): the first block shape that computes
        right, untimed."""
        self.by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
        for w in weights:
            self.by_shape.setdefault(tuple(w.shape), []).append(w)
        self.candidates, self.timer = (tuple(candidates) if candidates is not None else None), timer
        self.choice: dict[Key, Config | None] = {}  # None: torch's matmul
        self.timings: dict[Key, dict[str, float]] = {}  # ms over every layer's weight, per contender

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        cfg = self._config(x, weight, bias, None)
        return step_ops.linear(x, weight, bias) if cfg is None else gemv(x, weight, bias, None, *cfg)

    def residual_linear(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        """residual + x @ weight.T (+ bias); as step_ops.residual_linear, residual may change in place."""
        cfg = self._config(x, weight, bias, residual)
        if cfg is None:
            return step_ops.residual_linear(residual, x, weight, bias)
        return gemv(x, weight, bias, residual, *cfg)

    def chosen(self) -> dict[str, str]:
        """Each shape's choice, for status: "rows x N x K [+bias] [+residual]" -> "torch" or "triton BNxBK/W"."""
        return {f"{m}x{n}x{k}{'+bias' if b else ''}{'+residual' if r else ''}":
                ("torch" if cfg is None else config_name(cfg))
                for (m, n, k, b, r, _), cfg in sorted(self.choice.items(), key=str)}

    def _config(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None) -> Config | None:
        m = x.shape[0]
        if m > MAX_ROWS or weight.layout is not torch.strided or x.stride(-1) != 1 or weight.stride(-1) != 1:
            return None
        key = (m, weight.shape[0], weight.shape[1], bias is not None, residual is not None, x.dtype)
        if key in self.choice:
            return self.choice[key]
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # nothing can be timed inside a capture; its warm-up step chose already
        self.choice[key] = self._choose(key, x, weight, bias, residual)
        return self.choice[key]

    def _choose(self, key: Key, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None) -> Config | None:
        weights = self.by_shape.get(tuple(weight.shape), [weight])

        # The reference out of place; torch timed as the step calls it, adding in place into a
        # scratch copy of the residual (the step's residual must not change here).
        want = F.linear(x, weight, bias).float() + (residual.float() if residual is not None else 0)
        scratch = residual.clone() if residual is not None else None

        def with_torch(w: torch.Tensor) -> torch.Tensor:
            if residual is None:
                return step_ops.linear(x, w, bias)
            return step_ops.residual_linear(scratch, x, w, bias)

        passed = []
        for cfg in self.candidates or default_candidates(key[0]):
            try:
                got = gemv(x, weight, bias, residual, *cfg).float()
            except Exception as e:  # noqa: BLE001 - a shape Triton cannot build here is skipped, with why
                log.warning("few-row matmul %s: Triton block shape %s failed to run: %s", key[:5], cfg, e)
                continue
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            if err <= TOLERANCE.get(x.dtype, 1e-2):
                passed.append(cfg)
            else:
                log.warning("few-row matmul %s: Triton block shape %s is %.3g from torch's result, not used",
                            key[:5], cfg, err)
        if self.timer is None:
            return passed[0] if passed else None
        named = {config_name(cfg): cfg for cfg in passed}
        times = {"torch": self.timer(lambda: [with_torch(w) for w in weights])}
        for name, cfg in named.items():
            times[name] = self.timer(lambda cfg=cfg: [gemv(x, w, bias, residual, *cfg) for w in weights])
        self.timings[key] = times
        best = min(times, key=times.__getitem__)
        log.info("few-row matmul %s over %d weights: %s -> %s", key[:5], len(weights),
                 ", ".join(f"{name} {ms * 1e3:.0f} us" for name, ms in times.items()), best)
        return named.get(best)
