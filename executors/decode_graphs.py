"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is mostly kernel launches: ~10 per layer, each a
few microseconds of CPU, against a few microseconds of GPU work. A CUDA graph records the
whole step (embedding, every layer with the paged decode kernel, the lm_head) once per
bucket of batch sizes and replays it with one launch.

What makes the step capturable:
- Every input lives in a static buffer sized for the largest bucket: token ids, positions,
  slot mapping, block tables ([rows, blocks of a max-length sequence]) and lengths. A step
  stages them in pinned host memory and copies them over in two non-blocking copies.
- Attention goes through the Triton paged-decode kernel, which reads block tables and
  lengths from those buffers, so nothing about the batch's lengths is baked into the
  graph. Its context-partition count is fixed per bucket at capture, for the longest
  sequence the executor accepts; partitions past a row's length exit at once.
- A batch of n rows runs the smallest bucket >= n. Padding rows decode token 0 at
  position 0 over one key in the pool's scratch block, where their K and V also go: no
  sequence's blocks are touched, and their logits are dropped.
- Buckets are captured largest first and share one memory pool, so the smaller graphs
  reuse the largest one's memory.

Anything else (prompts, chunks, verification, LoRA rows, batches above the largest
bucket) runs eagerly. The logits a replay returns live in the graph's static output:
they are valid until the next replay, which the executor's serial worker guarantees.

After capture, each bucket up to block_size rows is replayed against the eager step on
rows in the scratch block; a mismatch (or a failed capture) raises, and the executor then
decodes eagerly. On a CPU (`capture=False`, for tests) the same static-buffer step runs
eagerly, so the staging, padding and bucketing are checked without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from executors.logits import argmax_pairs
from executors.models.attention import StepContext
from executors.models.decoder import DecoderLM
from executors.models.few_row_matmuls import FewRowMatmuls
from executors.models.triton_attention import DecodeLaunch, KernelPlan, decode_partitions, partition_length
from executors.models.triton_glu import FusedGlu
from executors.models.triton_prologue import QkvPrologue
from kvcache.kv_pool import PagedKvPool

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def buckets_up_to(max_batch: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


def describe_failure(error: BaseException) -> str:
    """Why a capture failed, for the eager fallback's warning: the first error of the chain (the
    one a failed capture_end wraps, which says only that an earlier one happened) and the last
    frame of this project's code it passed through."""
    first = error
    while (first.__cause__ or first.__context__) is not None:
        first = first.__cause__ or first.__context__
    where = ""
    root = Path(__file__).resolve().parent.parent
    tb = first.__traceback__
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename).resolve()
        if path.is_relative_to(root) and "site-packages" not in path.parts:  # not a venv's packages
            where = f" at {path.relative_to(root)}:{tb.tb_lineno} ({tb.tb_frame.f_code.co_name})"
        tb = tb.tb_next
    message = str(first).splitlines()[0] if str(first) else ""
    hint = (" (an operation that waits for the device, such as reading a tensor's value on the host, "
            "cannot be captured)" if "capturing" in message else "")
    return f"{type(first).__name__}{where}: {message}{hint}"


class DecodeGraphs:
    """The decode step at fixed shapes: captured as CUDA graphs, or eager on a CPU."""

    def __init__(self, model: DecoderLM, pool: PagedKvPool, max_batch: int, max_sequence_length: int,
                 *, capture: bool, prologue: QkvPrologue | None = None, glu: FusedGlu | None = None,
                 matmuls: FewRowMatmuls | None = None, feeds: bool = False) -> None:
        """`prologue`, `glu`: the executor's fused kernels (triton_prologue.py, triton_glu.py), or None;
        `matmuls`: the few-row matmuls (few_row_matmuls.py) for buckets of up to 8 rows, or None;
        `feeds`: a row's token may be a row's argmax id of the replay before (`run`'s `fed`: the
        executor leaves steps in flight); off, the graphs hold neither the gather nor the ids."""
        if pool.scratch_block is None:
            raise ValueError("decode graphs need a pool with a scratch block for padding rows")
        self.model, self.pool, self.prologue, self.glu, self.matmuls = model, pool, prologue, glu, matmuls
        self.feeds = feeds
        self.buckets = buckets_up_to(max_batch)
        self.max_sequence_length = max_sequence_length
        dev = pool.device
        largest = self.buckets[-1]
        self.table_width = -(-max_sequence_length // pool.block_size)
        pinned = dev.type == "cuda"
        # Host staging: the rows of `_host_long` are ids, positions, slots and lengths (keys
        # each row sees), in its fifth row's first column the decode partitions' length for
        # the step's longest context, and in its sixth, per row, the row of the last replay
        # whose argmax id is the row's token (a fed token still on the device) or -1;
        # `_host_int` holds the block tables.
        self._host_long = torch.zeros(6, largest, dtype=torch.int64, pin_memory=pinned)
        self._host_int = torch.zeros(largest, self.table_width, dtype=torch.int32, pin_memory=pinned)
        self._long_np, self._int_np = self._host_long.numpy(), self._host_int.numpy()
        self._long = torch.zeros(6, largest, dtype=torch.int64, device=dev)
        # Each replay's argmax ids, kept for the next one's fed rows (executors/step_overlap.py).
        self._last_ids = torch.zeros(largest, dtype=torch.int64, device=dev) if feeds else None
        self._int = torch.zeros(largest, self.table_width, dtype=torch.int32, device=dev)
        self._rows = torch.arange(largest, dtype=torch.int32, device=dev)
        self._copied = torch.cuda.Event() if pinned else None
        # Per bucket: the graph, and its static outputs (logits, argmax pairs).
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, tuple[torch.Tensor, torch.Tensor] | None]] = {}
        # Partitions per bucket, fixed for the longest sequence; their length is set each step
        # for the step's longest context (`_long[4, 0]`), so short contexts split too.
        self._partitions = {b: decode_partitions(b, pool.num_kv_heads, max_sequence_length, dev)
                            for b in self.buckets}
        self._pad(0, largest)
        # One partition's length covers any context: right for the warm-up and capture steps.
        self._long_np[4, 0] = partition_length(max_sequence_length, 1)
        self._long.copy_(self._host_long)
        self._int.copy_(self._host_int)
        self.replays = 0
        if capture:
            self._capture()
        else:
            self._graphs = {b: (None, None) for b in self.buckets}

    @property
    def captured(self) -> list[int]:
        """The buckets replayed from CUDA graphs (none when the step runs eagerly, on a CPU)."""
        return [b for b, (graph, _) in sorted(self._graphs.items()) if graph is not None]

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _pad(self, lo: int, hi: int) -> None:
        """Rows lo..hi-1 become padding: token 0 at position 0 in the scratch block, its K and V
        stored in the block's last slot. Not slot 0: _verify's rows live in the scratch block from
        slot 0 up, and a padding row storing other K and V where a check row stores its own races
        with it on a GPU (run 24: logits 7.02 apart on an H100)."""
        scratch, bs = self.pool.scratch_block, self.pool.block_size
        self._long_np[:4, lo:hi] = 0
        self._long_np[2, lo:hi] = scratch * bs + bs - 1
        self._long_np[3, lo:hi] = 1
        self._long_np[5, lo:hi] = -1
        self._int_np[lo:hi, 0] = scratch

    def _step(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step of the first b rows of the static buffers: logits [b, vocab], and each
        row's argmax id and log-probability ([2, b] float64, logits.argmax_pairs): an ARGMAX
        step then needs nothing after the replay but one copy to the host."""
        parts = self._partitions[b]
        launch = DecodeLaunch(self._rows[:b], self._int[:b], self._long[3, :b], parts, self._long[4, :1])
        ctx = StepContext([], self.pool, self._long[2, :b], backend="triton", kernel_plan=KernelPlan(None, launch),
                          prologue=self.prologue, glu=self.glu, matmuls=self.matmuls)
        ids = self._long[0, :b]
        if self.feeds:  # a fed row's token: the argmax id of a row of the replay before, not yet the host's
            fed = self._long[5, :b]
            ids = torch.where(fed >= 0, self._last_ids[fed.clamp(min=0)], ids)
        hidden = self.model.hidden_states(ids, self._long[1, :b], ctx)
        logits = self.model.logits(hidden)
        pairs = argmax_pairs(logits)
        if self.feeds:
            self._last_ids[:b].copy_(pairs[0])
        return logits, pairs

    def _capture(self) -> None:
        log.info("capturing decode CUDA graphs for batch sizes %s, then replaying those up to %d rows against "
                 "the eager step", self.buckets, self.pool.block_size)
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for b in reversed(self.buckets):  # largest first: the others fit in its memory
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(b)  # compiles the kernels for this shape outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                out = self._step(b)
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize()
        for b in self.buckets:
            if b <= self.pool.block_size:
                self._verify(b)
        self._pad(0, self.max_batch)
        log.info("captured and checked decode CUDA graphs for batch sizes %s", self.buckets)

    def _verify(self, n: int) -> None:
        """Replay against the eager step on n rows of distinct tokens and lengths, all in the
        scratch block: a capture that went wrong raises here, at start-up, not in a reply."""
        scratch, bs = self.pool.scratch_block, self.pool.block_size
        got, got_pairs = (t.clone() for t in self.run(list(range(1, n + 1)), list(range(n)),
                                                      [scratch * bs + i for i in range(n)], [[scratch]] * n))
        want = self._step(self.bucket(n))[0][:n]
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        if not err <= 1e-3 * max(scale, 1.0):
            raise RuntimeError(f"the decode graph of {n} rows gives logits {err:.3g} away from the eager step's")
        if not torch.equal(got_pairs[0], got.argmax(-1).double()) or not torch.isfinite(got_pairs[1]).all():
            raise RuntimeError(f"the decode graph of {n} rows gives argmax ids that are not its logits'")

    def run(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]],
            fed: Sequence[int | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] of n decode rows (n <= max_batch) and their argmax pairs ([2, n]);
        tables[i] is row i's block table (at least its first positions[i] // block_size + 1 blocks).
        fed[i], where not None: row i's token is the argmax id of row fed[i] of the last replay
        (ids[i] is then not read)."""
        n = len(ids)
        b = self.bucket(n)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging
        self._long_np[0, :n] = ids
        self._long_np[1, :n] = positions
        self._long_np[2, :n] = slots
        bs = self.pool.block_size
        self._long_np[3, :n] = positions
        self._long_np[3, :n] += 1
        self._long_np[4, 0] = partition_length(max(positions) + 1, self._partitions[b])
        self._long_np[5, :n] = -1 if fed is None else [-1 if row is None else row for row in fed]
        for i, (table, pos) in enumerate(zip(tables, positions)):
            need = pos // bs + 1
            self._int_np[i, :need] = table[:need]  # a BlockTable.ids_array(): one copy, not a conversion
        self._pad(n, b)
        nonblocking = self._copied is not None
        # All of _long (6 x largest int64, a few KB): a column slice would not be contiguous,
        # and torch would stage a non-contiguous pinned source through pageable memory.
        self._long.copy_(self._host_long, non_blocking=nonblocking)
        self._int[:b].copy_(self._host_int[:b], non_blocking=nonblocking)
        if self._copied is not None:
            self._copied.record()
        graph, out = self._graphs[b]
        self.replays += 1
        if graph is None:
            logits, pairs = self._step(b)
            return logits[:n], pairs[:, :n]
        graph.replay()
        return out[0][:n], out[1][:, :n]
